"""GGML blocks read in place on the CPU with float32 activations (ggml_cpu.c, through ctypes).

`ggml_matmul(x, raw, type, cols)` is `F.linear(x, dequantize(raw))` without the dense weight: the
weight stays in its GGUF bytes (1.0x the file), the math is float32 (the tokens equal those of
transformers running the dequantized model), and decode reads each weight byte once per step.
Its reference twin is `axon.layers.quantized.matmul_ref`.

The C file is compiled once per machine with the system C compiler into the cache
(`$AXON_CACHE_DIR/kernels`, else `$XDG_CACHE_HOME/axon/kernels`, else `~/.cache/axon/kernels`);
`available()` is False when no compiler is found, and the callers fall back to the int4 path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ggml_cpu.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared")
MAX_TOKENS = 64  # the C kernel's limit per call; longer batches dequantize and use F.linear
DEQUANT_CHUNK_BYTES = 16 << 20  # float32 rows dequantized at once on that path
# Below this many weight bytes a matmul runs on one thread: a layer of a small model takes
# ~0.1 ms, less than waking and joining threads costs, and far less than one descheduled thread
# stalls the rest on a shared machine (measured: 2 threads decoded 6x slower than 1 at load 5).
PARALLEL_MIN_BYTES = 4 << 20


def cache_dir() -> Path:
    """axon's cache: $AXON_CACHE_DIR, else $XDG_CACHE_HOME/axon, else ~/.cache/axon."""
    if os.environ.get("AXON_CACHE_DIR"):
        return Path(os.environ["AXON_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "axon"


def _build(compiler: str) -> Path:
    """Compile the C file (once: the name hashes source, flags and CPU) and return the .so."""
    cpu = next((line for line in _cpuinfo() if line.startswith("flags")), "")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + cpu.encode())
    target = cache_dir() / "kernels" / f"ggml_cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True
        )
        os.replace(tmp, target)  # atomic: concurrent builders each rename a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler: GGUF matmuls use the int4 kernel (bf16 activations)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("building %s failed (%s); GGUF matmuls use the int4 kernel", SOURCE, detail)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.axon_ggml_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.axon_ggml_dequant.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int]
    lib.axon_ggml_supported.argtypes = [ctypes.c_int]
    return lib


def available() -> bool:
    return _library() is not None


def supports(ggml_type: int) -> bool:
    """Whether the C kernel handles `ggml_type` (False when it could not be built)."""
    lib = _library()
    return lib is not None and bool(lib.axon_ggml_supported(int(ggml_type)))


def ggml_dequant(raw: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """raw rows [R, row_bytes] uint8 -> float32 [R, cols]."""
    raw = raw.contiguous()
    out = torch.empty(raw.shape[0], cols, dtype=torch.float32)
    status = _library().axon_ggml_dequant(
        int(ggml_type), raw.data_ptr(), raw.shape[0], cols, out.data_ptr(), torch.get_num_threads()
    )
    if status != 0:
        raise ValueError(f"ggml_dequant: unsupported type {ggml_type} or cols {cols}")
    return out


def _dequant_matmul(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, cols: int):
    """Long batches (prefill): dequantize a few MiB of rows at a time and use F.linear."""
    step = max(1, DEQUANT_CHUNK_BYTES // (4 * cols))
    parts = [
        torch.nn.functional.linear(x, ggml_dequant(raw[start : start + step], ggml_type, cols))
        for start in range(0, raw.shape[0], step)
    ]
    return torch.cat(parts, dim=1)  # [T, rows]


def ggml_matmul(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """x [T, cols] -> x @ W.T [T, rows] float32, W given as raw rows [rows, row_bytes]."""
    x = x.to(torch.float32).contiguous()
    if x.shape[0] > MAX_TOKENS:
        return _dequant_matmul(x, raw, ggml_type, cols)
    rows = raw.shape[0]
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)
    status = _library().axon_ggml_matmul(
        int(ggml_type),
        raw.data_ptr(),
        rows,
        cols,
        x.data_ptr(),
        x.shape[0],
        y.data_ptr(),
        torch.get_num_threads() if raw.numel() >= PARALLEL_MIN_BYTES else 1,
    )
    if status != 0:
        raise ValueError(f"ggml_matmul: unsupported type {ggml_type} or cols {cols}")
    return y  # [T, rows]
