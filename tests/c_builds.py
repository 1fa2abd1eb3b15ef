"""Kernel sources that stand alone, built with other flags than the library's (the AVX2 build on a
CPU with AVX-512, the baseline ISA's plain loops), for tests of the builds this CPU does not load.

Each build is kept in ~/.cache/axon-test/kernels under a name hashing the source, the kernel
headers, the flags and the compiler, so only a fresh machine or an edit compiles (seconds each).
`python tests/c_builds.py` builds them all at once: scripts/setup.sh runs it beside the library's
own build, on the core that build leaves idle."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "src" / "axon" / "kernels"
HEADERS = tuple(sorted(KERNELS.glob("*.h")))
AVX2 = ["-march=native", "-mno-avx512f"]  # this CPU without AVX-512
PORTABLE: list[str] = []  # the baseline ISA

# name: (source, optimization, flags). The ggml_q8 pair: the library's own build is
# -march=native (VNNI where the CPU has it); these are the AVX2 tiles and the scalar loops.
VARIANTS = {
    "ggml_cpu-avx2": ("ggml_cpu.c", "-O2", AVX2),
    "ggml_cpu-portable": ("ggml_cpu.c", "-O2", PORTABLE),
    "cpu_ops-avx2": ("cpu_ops.c", "-O2", AVX2),
    "cpu_ops-portable": ("cpu_ops.c", "-O2", PORTABLE),
    "ggml_q8-avx2": ("ggml_q8.c", "-O3", ["-march=native", "-mno-avx512vnni"]),
    "ggml_q8-portable": ("ggml_q8.c", "-O3", ["-march=x86-64"]),
}


class Unbuildable(Exception):
    """No C compiler, or x86 flags on another CPU: the calling test skips."""


def variant(name: str) -> ctypes.CDLL:
    """The library of VARIANTS[name], built once per machine and source; skips the calling test
    where it cannot be built here."""
    import pytest

    try:
        return ctypes.CDLL(str(build(name)))
    except Unbuildable as exc:
        pytest.skip(str(exc))


def build(name: str) -> Path:
    """The path of VARIANTS[name]'s library, compiling it when the cache misses."""
    from llama_cpp_sdist import CACHE, cache_lock

    source, optimization, flags = VARIANTS[name]
    compiler = _compiler(flags)
    command = [compiler, optimization, *flags, "-fopenmp", "-fPIC", "-shared"]
    command.append(str(KERNELS / source))
    key = hashlib.sha256(" ".join(command).encode() + _version(compiler).encode())
    for path in (KERNELS / source, *HEADERS):
        key.update(path.read_bytes())
    target = CACHE / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    with cache_lock(f"kernel-{name}"):
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".part")
            subprocess.run([*command, "-o", str(partial), "-lm"], check=True, capture_output=True)
            os.replace(partial, target)
    return target


def _compiler(flags: list[str]) -> str:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise Unbuildable("no C compiler")
    x86 = any(flag.startswith(("-mno-avx", "-march=x86")) for flag in flags)
    if x86 and platform.machine() not in ("x86_64", "AMD64"):
        raise Unbuildable("not an x86 CPU")
    return compiler


def _version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return result.stdout.split("\n", 1)[0]


def _build_or_say(name: str) -> str:
    try:
        build(name)
    except (Unbuildable, subprocess.CalledProcessError) as exc:
        return f"{name}: not built ({exc})"
    return f"{name}: ready"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # llama_cpp_sdist, for the cache and its lock
    # One compiler per core but one: setup.sh runs this beside the library's own build.
    with ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1)) as pool:
        for line in pool.map(_build_or_say, VARIANTS):
            print(f"test kernel builds: {line}")
