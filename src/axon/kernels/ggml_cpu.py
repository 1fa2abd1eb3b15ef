"""GGML blocks read in place on the CPU with float32 activations (ggml_cpu.c, through ctypes).

`GGMLWeights(parts, cols).matmul(x)` is `F.linear(x, cat(dequantize(raw)))` without the dense
weight: the weight stays in its GGUF bytes (1.0x the file), the math is float32 (the tokens equal
those of transformers running the dequantized model), and decode reads each weight byte once per
step.
Its reference twin is `axon.layers.quantized.matmul_ref`.

The C file is compiled once per machine (kernels/build.py); `available()` is False when it
cannot be built, and the callers fall back to the int4 path.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from axon.kernels import abi, ggml_q8

logger = logging.getLogger(__name__)

F32 = 0  # the C kernel also multiplies plain float32 rows (as 32-wide "blocks")
# Register tiles up to this many tokens; longer batches (prefill) take the panel kernel, which
# dequantizes L2-sized panels of rows once and multiplies them with every token.
MAX_TOKENS = 64
# Below this many weight bytes a matmul runs on one thread: a layer of a small model takes
# ~0.1 ms, less than waking and joining threads costs, and far less than one descheduled thread
# stalls the rest on a shared machine.
PARALLEL_MIN_BYTES = 256 << 10


@functools.cache
def _library() -> ctypes.CDLL | None:
    """abi.library(), saying once where it is missing what GGUF matmuls do instead."""
    lib = abi.library()
    if lib is None:
        logger.warning("GGUF matmuls use the int4 kernel (bf16 activations) instead")
    return lib


def available() -> bool:
    return _library() is not None


def panel_rows(cols: int) -> int:
    """Rows the long-batch kernel dequantizes per panel at `cols` columns (sized from the L2)."""
    return int(_library().axon_ggml_panel_rows(cols))


def supports(ggml_type: int) -> bool:
    """Whether the C kernel handles `ggml_type` (False when it could not be built)."""
    lib = _library()
    return lib is not None and bool(lib.axon_ggml_supported(int(ggml_type)))


def ggml_dequant(raw: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """raw rows [R, row_bytes] uint8 -> float32 [R, cols]."""
    raw = raw.contiguous()
    out = torch.empty(raw.shape[0], cols, dtype=torch.float32)
    threads = torch.get_num_threads() if raw.numel() >= PARALLEL_MIN_BYTES else 1
    status = _library().axon_ggml_dequant(
        int(ggml_type), raw.data_ptr(), raw.shape[0], cols, out.data_ptr(), threads
    )
    if status != 0:
        raise ValueError(f"ggml_dequant: unsupported type {ggml_type} or cols {cols}")
    return out


class GGMLWeights:
    """One or more GGML weights over the same input (a fused projection kept as its GGUF parts,
    e.g. q, k, v), with the C call's arguments prepared once: `matmul(x)` is
    `x @ cat([dequantize(W_p)]).T` in one call, parts side by side in the output. Built with
    int8=True (and types kernels/ggml_q8.py has), every matmul, batch-1 decode included,
    quantizes the activations to 8 bits instead (`self.int8`)."""

    def __init__(
        self,
        parts: list[tuple[int, torch.Tensor]],
        cols: int,
        int8: bool = False,
        pack: bool = False,
    ):
        self.parts = parts  # (ggml_type, raw [rows, row_bytes]); keeps the bytes alive
        self.cols = cols
        self.rows = sum(raw.shape[0] for _, raw in parts)
        size = sum(raw.numel() for _, raw in parts)
        self.parallel = size >= PARALLEL_MIN_BYTES
        # Opt-in 8-bit activations, every step size (kernels/ggml_q8.py); F32 weights keep the
        # float path. pack: Q4_K and Q6_K parts repacked once into the 8-bit tiles' layout,
        # which the kernel then reads in place of the GGUF blocks (`ggml_q8.kernel_parts`).
        self.int8 = int8 and ggml_q8.supports(t for t, _ in parts)
        if self.int8 and pack:
            kernel_parts = ggml_q8.kernel_parts(parts, cols)
        else:
            kernel_parts = [(int(t), raw, raw.shape[0]) for t, raw in parts]
        self._kernel_parts = kernel_parts  # keeps the packed bytes alive
        count = len(parts)
        self._types = (ctypes.c_int * count)(*(t for t, _, _ in kernel_parts))
        self._ptrs = (ctypes.c_void_p * count)(*(data.data_ptr() for _, data, _ in kernel_parts))
        self._rows = (ctypes.c_int64 * count)(*(rows for _, _, rows in kernel_parts))

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, cols] -> [T, rows] float32 (into `out`, a float32 view with contiguous rows,
        when given)."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        tokens = x.shape[0]
        if out is None:
            out = torch.empty(tokens, self.rows, dtype=torch.float32)
        elif out.stride(1) != 1 or out.dtype != torch.float32:
            raise ValueError("ggml_matmul: out must be float32 with contiguous rows")
        if self.int8:
            return ggml_q8.matmul(self, x, out)
        threads = torch.get_num_threads() if self.parallel else 1
        kernel = _library().axon_ggml_matmul_parts
        if tokens > MAX_TOKENS:
            kernel = _library().axon_ggml_matmul_panels
            threads = torch.get_num_threads()  # a long batch is worth the threads at any size
        status = kernel(
            len(self.parts), self._types, self._ptrs, self._rows, self.cols,
            x.data_ptr(), tokens, out.data_ptr(), out.stride(0), threads,
        )  # fmt: skip
        if status == -2:
            raise MemoryError("ggml_matmul: no memory for the dequantized panels")
        if status != 0:
            types = [t for t, _ in self.parts]
            raise ValueError(f"ggml_matmul: unsupported types {types} or cols {self.cols}")
        return out  # [T, rows]


def dense_weights(weight: torch.Tensor) -> GGMLWeights | None:
    """A float32 weight [N, K] as a one-part GGMLWeights (its own memory, no copy), or None
    where the C kernel does not apply (other dtypes or devices, K not a multiple of 32, no
    compiler). At 2-64 rows torch's float32 GEMM (MKL) runs far below the memory bandwidth on
    some CPUs; this kernel stays bandwidth-bound."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.shape[1] % 32 or not weight.is_contiguous() or not supports(F32):
        return None
    return GGMLWeights([(F32, weight.view(torch.uint8))], weight.shape[1])
