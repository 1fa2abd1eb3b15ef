"""The Python side of the C kernels' one interface (kernels/axon_kernels.h): the ctypes
signature of every function the library exports, and the structs Python fills in, mirrored
field for field. The kernel modules call the library `library()` returns and declare nothing of
their own. tests/unit/test_kernel_abi.py holds this module to the header (every function, its
parameter types) and to the built library (every struct's size and field offsets).
"""

from __future__ import annotations

import ctypes
import functools

from axon.kernels import build

_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_int = ctypes.c_int
_PTRS = ctypes.POINTER(ctypes.c_void_p)


class Projection(ctypes.Structure):
    _fields_ = [
        ("parts", _i32),
        ("parallel", _i32),
        ("int8", _i32),  # 8-bit activations (ggml_q8.c), as the weights' GGMLWeights.int8
        ("types", _i32 * 3),
        ("weights", _ptr * 3),
        ("rows", _i64 * 3),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "rotary_dim")),
        ("inter", _i64),
        ("window", _i64),
        *((name, _f32) for name in ("eps", "scale", "softcap")),
        ("unit_offset", _i32),
        ("activation", _i32),
        *((name, _ptr) for name in ("input_norm", "attn_out_norm", "mlp_in_norm")),
        *((name, _ptr) for name in ("mlp_out_norm", "q_norm", "k_norm", "qkv_bias")),
        ("inv_freq", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        *((name, Projection) for name in ("qkv", "o", "gate_up", "down")),
        ("kv_type", _i32),  # the caches' element type (cpu_ops.KV_TYPES)
    ]


class Experts(ctypes.Structure):
    _fields_ = [
        ("experts", _i64),
        ("hidden", _i64),
        ("inter", _i64),
        ("types", _i32 * 3),
        ("activation", _i32),
        ("threads", _i32),
        ("int8", _i32),
        ("gate", _PTRS),
        ("up", _PTRS),
        ("down", _PTRS),
        ("row_bytes", _i64 * 3),
    ]


class Router(ctypes.Structure):
    _fields_ = [
        ("norm", _ptr),
        ("router", _ptr),
        ("eps", _f32),
        ("unit_offset", _i32),
        ("top_k", _i32),
        ("renormalize", _i32),
    ]


class SparseLayer(ctypes.Structure):
    _fields_ = [("attention", _ptr), ("experts", _ptr), ("router", _ptr), ("parallel", _i64)]


class FinalNorm(ctypes.Structure):
    _fields_ = [("weight", _ptr), ("dim", _i64), ("eps", _f32), ("unit_offset", _i32)]


# The mirrored structs, named as in C.
STRUCTS = (Projection, Layer, Experts, Router, SparseLayer, FinalNorm)

_LAYER, _I64S, _NAMES = ctypes.POINTER(Layer), ctypes.POINTER(_i64), ctypes.POINTER(ctypes.c_char_p)
_MATMUL_PARTS = [
    *(_int, ctypes.POINTER(_int), ctypes.POINTER(_ptr), ctypes.POINTER(_i64)),
    *(_i64, _ptr, _i64, _ptr, _i64, _int),
]
# A decode step's arguments after `hidden`: tokens, positions, slot mapping, key slots, their
# width, context lengths, scratch.
_STEP = [_i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]

# name -> (restype, argtypes), in the header's order.
SIGNATURES: dict[str, tuple[type | None, list]] = {
    # layout.c
    "axon_struct_layout": (_i64, [_i64, _NAMES, _I64S, _NAMES, _I64S, _I64S, _i64]),
    # cpu_ops.c
    "axon_rms_norm": (None, [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _int]),
    "axon_rms_norm_heads": (None, [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _f32, _int]),
    "axon_rotary": (None, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr]),
    "axon_rotary_angles": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr]),
    "axon_rotary_table": (None, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr]),
    "axon_decode_split": (_i64, [_i64]),
    "axon_paged_decode_attention": (
        _int,
        [
            *(_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _f32, _f32, _i64),
            *(_ptr, _ptr, _int, _int),
        ],
    ),
    "axon_paged_prefill_attention": (
        _int,
        [
            *(_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _f32, _f32, _i64, _ptr),
            *(_int, _int),
        ],
    ),
    "axon_act_and_mul": (None, [_ptr, _i64, _ptr, _i64, _i64, _int]),
    "axon_cache_write": (None, [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _int]),
    # ggml_cpu.c
    "axon_ggml_supported": (_int, [_int]),
    "axon_ggml_matmul_parts": (_int, _MATMUL_PARTS),
    "axon_ggml_matmul": (_int, [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _int]),
    "axon_ggml_dequant": (_int, [_int, _ptr, _i64, _i64, _ptr, _int]),
    "axon_ggml_panel_rows": (_i64, [_i64]),
    "axon_ggml_matmul_panels": (_int, _MATMUL_PARTS),
    # ggml_q8.c
    "axon_q8_supported": (_int, [_int]),
    "axon_q8_pack": (_int, [_int, _ptr, _i64, _i64, _ptr]),
    "axon_q8_matmul_parts": (_int, _MATMUL_PARTS),
    "axon_q8_quantize": (None, [_ptr, _i64, _int, _ptr, _ptr, _ptr]),
    # cpu_layer.c
    "axon_decode_layer_scratch": (_i64, [_LAYER, _i64, _i64, _int]),
    "axon_decode_attention": (_int, [_LAYER, _ptr, *_STEP, _int]),
    "axon_decode_layer": (_int, [_LAYER, _ptr, *_STEP, _int]),
    # cpu_moe.c
    "axon_moe_experts": (_int, [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr]),
    "axon_moe_block_scratch": (_i64, [_ptr, _ptr, _i64]),
    "axon_moe_block": (_int, [_ptr, _ptr, _ptr, _i64, _ptr]),
    "axon_sparse_layer_scratch": (_i64, [_ptr, _i64, _i64, _int]),
    "axon_sparse_decode_layer": (_int, [_ptr, _ptr, *_STEP, _i64, _int]),
    "axon_decode_stack_scratch": (_i64, [_ptr, _ptr, _i64, _i64, _i64, _int]),
    "axon_decode_stack": (_int, [_ptr, _ptr, _i64, _ptr, _ptr, *_STEP, _i64, _int]),
}


def declare(lib: ctypes.CDLL, *names: str) -> ctypes.CDLL:
    """Gives `lib`'s functions `names` (all of SIGNATURES when none are named: the whole
    library) their signatures; a test's build of one source names the ones it has."""
    for name in names or SIGNATURES:
        function = getattr(lib, name)
        function.restype, function.argtypes = SIGNATURES[name]
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel library with every function declared, or None where it could not be built
    (build.load logs why; the callers take their PyTorch paths)."""
    lib = build.load()
    return None if lib is None else declare(lib)
