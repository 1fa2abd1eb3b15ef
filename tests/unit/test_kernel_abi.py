"""The C kernels' one interface held together: every function kernels/axon_kernels.h declares
has its ctypes signature in kernels/abi.py with the same parameter types, and abi.py declares no
other; every function a kernel source exports is in the header; and every struct Python mirrors
has the built library's size, field offsets and field sizes. A change on one side only fails
here instead of passing a decode step misread arguments."""

from __future__ import annotations

import ctypes
import re

import pytest

from axon.kernels import abi, build

HEADER = build.HEADERS[0]
SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64}
SCALARS["float"] = ctypes.c_float
needs_library = pytest.mark.skipif(abi.library() is None, reason="no C compiler")


def _declarations(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, parameter types) of the axon_ functions a header declares."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    found = {}
    for statement in text.split(";"):
        match = re.fullmatch(r"\s*([\w\s*]+?)\s*\b(axon_\w+)\s*\((.*)\)\s*", statement, re.S)
        if match is None or "{" in statement:
            continue
        returns, name, params = match.groups()
        types = [re.sub(r"\w+\s*$", "", p).strip() for p in params.split(",")]
        found[name] = (" ".join(returns.split()), [" ".join(t.split()) for t in types])
    return found


def _agrees(c_type: str, ctype) -> bool:
    """Whether a ctypes type passes the C type `c_type` (its text, as in the header)."""
    stars = c_type.count("*")
    base = c_type.replace("const", "").replace("*", "").strip()
    if stars == 0:
        return ctype is None if base == "void" else SCALARS.get(base) is ctype
    if ctype is ctypes.c_void_p:
        return True
    if not (isinstance(ctype, type) and issubclass(ctype, ctypes._Pointer)):
        return False
    target = ctype._type_
    if issubclass(target, ctypes.Structure):
        return stars == 1 and base == target.__name__
    if target in (ctypes.c_void_p, ctypes.c_char_p):  # a pointer to pointers
        return stars == 2
    return stars == 1 and SCALARS.get(base) is target


def test_the_header_and_abi_py_declare_the_same_functions_with_the_same_types():
    declared = _declarations(HEADER.read_text())
    assert declared.keys() == abi.SIGNATURES.keys()
    for name, (returns, params) in declared.items():
        restype, argtypes = abi.SIGNATURES[name]
        assert _agrees(returns, restype), (name, returns, restype)
        assert len(params) == len(argtypes), name
        for index, (c_type, ctype) in enumerate(zip(params, argtypes, strict=True)):
            assert _agrees(c_type, ctype), (name, index, c_type, ctype)


def test_the_type_check_sees_a_wrong_signature():
    restype, argtypes = abi.SIGNATURES["axon_decode_layer"]
    _, params = _declarations(HEADER.read_text())["axon_decode_layer"]
    assert not _agrees(params[2], ctypes.c_int)  # int64_t tokens as an int
    assert not _agrees(params[0], ctypes.POINTER(abi.SparseLayer))  # another struct
    assert not _agrees("void", restype)


def test_every_source_includes_the_header_and_exports_only_what_it_declares():
    declared = _declarations(HEADER.read_text())
    defined = set()
    for source in build.SOURCES:
        text = source.read_text()
        assert '#include "axon_kernels.h"' in text, source.name
        defined |= set(re.findall(r"^(?:int|void|int64_t)\s+\**(axon_\w+)\(", text, re.M))
    assert defined == declared.keys()


def _library_layouts() -> dict[str, tuple[int, list[tuple[str, int, int]]]]:
    """struct name -> (size, [(field, offset, size)]) as the library reports them."""
    lib, capacity, layouts = abi.library(), 64, {}
    while True:
        name, size = ctypes.c_char_p(), ctypes.c_int64()
        fields = (ctypes.c_char_p * capacity)()
        offsets, sizes = (ctypes.c_int64 * capacity)(), (ctypes.c_int64 * capacity)()
        count = lib.axon_struct_layout(
            len(layouts), ctypes.byref(name), ctypes.byref(size), fields, offsets, sizes, capacity
        )
        if count < 0:
            return layouts
        assert count <= capacity
        rows = [(fields[i].decode(), offsets[i], sizes[i]) for i in range(count)]
        layouts[name.value.decode()] = (size.value, rows)


def _layout_of(struct: type[ctypes.Structure]) -> tuple[int, list[tuple[str, int, int]]]:
    rows = [(name, getattr(struct, name).offset, getattr(struct, name).size) for name, *_ in
            struct._fields_]  # fmt: skip
    return ctypes.sizeof(struct), rows


@needs_library
def test_every_mirrored_struct_has_the_library_layout():
    layouts = _library_layouts()
    assert layouts.keys() == {struct.__name__ for struct in abi.STRUCTS}
    for struct in abi.STRUCTS:
        assert _layout_of(struct) == layouts[struct.__name__], struct.__name__


@needs_library
def test_a_drifted_mirror_differs_from_the_library_layout():
    fields = list(abi.Layer._fields_)
    fields[-1] = ("kv_type", ctypes.c_int64)  # the trailing flag widened: the size holds
    drifted = type("Layer", (ctypes.Structure,), {"_fields_": fields})
    assert ctypes.sizeof(drifted) == ctypes.sizeof(abi.Layer)
    assert _layout_of(drifted) != _library_layouts()["Layer"]
