"""GGML weights times 8-bit activations (ggml_q8.c, through ctypes): the
`activation_precision="int8"` path (every step size), the default on CPUs with AVX2 (`simd`).

Each token's activations are quantized on their own per block, with llama.cpp's schemes (Q8_K,
256 wide, for the K-quants; Q8_0 / Q8_1, 32 wide, for the legacy formats): a float scale
d = max|x| / 127 and int8 values round(x / d). The products are integer dot products of those
values with the weights' codes, scaled once per block: the same math, up to float32 rounding, as
`F.linear(dequantize_activations(x), dequantize(W))`, which is the reference twin
(`matmul_ref`). A token's output does not depend on the rest of the batch.

The exact path (kernels/ggml_cpu.py) keeps float32 activations; GGMLWeights calls `matmul`
here when its weights were built with int8 activations. The C side has two kernels with the
same float steps per (row, token), so their results are the same bits: many tokens multiply
16 decoded rows x 6 tokens at a time (VNNI dpbusd where the CPU has it), one token multiplies
8 rows straight from their GGUF blocks.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import TYPE_CHECKING

import torch

from axon.kernels import build
from axon.kernels.abi import library
from axon.kernels.ggml_dequant import dequantize_rows_ref

if TYPE_CHECKING:
    from axon.kernels.ggml_cpu import GGMLWeights

# Not GGML types: Q4_K and Q6_K repacked into the tiles' units of 16 rows (`pack`), and the
# bytes a block of 16 rows takes (16 x 144 and 16 x 210 in the GGUF).
Q4_K_PANELS, Q6_K_PANELS = 112, 114
PACKED = {12: (Q4_K_PANELS, 2432), 14: (Q6_K_PANELS, 3392)}
K_TYPES = (10, 11, 12, 13, 14, Q4_K_PANELS, Q6_K_PANELS)  # Q8_K activations; others Q8_0 / Q8_1


def supports(ggml_types) -> bool:
    """Whether every type in `ggml_types` has an 8-bit-activation kernel (F32 has none: float
    weights stay on the float path), False when the C kernels could not be built."""
    lib = library()
    return lib is not None and all(lib.axon_q8_supported(int(t)) for t in ggml_types)


def simd() -> bool:
    """Whether the 8-bit kernels run their SIMD path here: the library is built (-march=native)
    on a CPU with AVX2 (AVX-512 VNNI's tiles where it has those too). Elsewhere only the portable
    C loops exist, which are there for exactness, not speed: the float path is the default."""
    return library() is not None and "avx2" in build.cpu_flags().split()


def block_of(ggml_type: int) -> int:
    """The activation block width for weights of `ggml_type`: 256 (Q8_K) or 32 (Q8_0)."""
    return 256 if int(ggml_type) in K_TYPES else 32


def pack(raw: torch.Tensor, ggml_type: int, cols: int) -> tuple[int, torch.Tensor]:
    """Q4_K or Q6_K rows raw [N, row_bytes] -> (packed type, bytes [(N + 15) / 16, cols / 256 *
    block bytes] uint8): the layout the tiles read without decoding, 16 rows' codes interleaved
    as bits block by block, their multipliers as bytes, d (and Q4_K's dmin) as float32
    (ggml_q8.c): 5.6 % (Q4_K) and 1 % (Q6_K) more bytes than the GGUF's, and the products are
    the same bits as from `raw`. Packed once at load, so no step decodes the GGUF blocks into
    panels."""
    packed_type, block_bytes = PACKED[int(ggml_type)]
    raw = raw.contiguous()
    rows = raw.shape[0]
    out = _huge_empty((rows + 15) // 16, cols // 256 * block_bytes)
    status = library().axon_q8_pack(int(ggml_type), raw.data_ptr(), rows, cols, out.data_ptr())
    if status == -2:
        raise MemoryError("ggml_q8: out of memory packing a weight")
    if status != 0:
        raise ValueError(f"ggml_q8: cannot pack type {ggml_type} of {cols} columns")
    return packed_type, out


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def _huge_empty(rows: int, row_bytes: int) -> torch.Tensor:
    """An uncommitted uint8 [rows, row_bytes] on 2 MiB boundaries, asked for transparent huge
    pages (madvise MADV_HUGEPAGE, which `enabled=madvise` kernels need) before it is first
    written: a weight streamed from memory crosses a 4 KiB page every 4 KiB, and the hardware
    prefetchers stop at each. Small weights (under a huge page) are a plain allocation."""
    size = rows * row_bytes
    libc = _libc()
    if size < HUGE_PAGE or libc is None:
        return torch.empty(rows, row_bytes, dtype=torch.uint8)
    room = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
    skip = -room.data_ptr() % HUGE_PAGE
    out = room[skip : skip + size].view(rows, row_bytes)  # keeps `room` alive
    libc.madvise(out.data_ptr(), size // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)
    return out


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """libc for madvise, on Linux only (the advice numbers below are Linux's)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the pages; non-destructive (a later read faults them in)


def release_pages(raw: torch.Tensor) -> None:
    """Hands the whole pages of `raw` back to the kernel (madvise MADV_PAGEOUT): once a weight is
    packed nothing reads its GGUF blocks, and a view of the mapped file would otherwise stay
    resident beside the packed copy. Not destructive: anything that reads the blocks later
    (an embedding lookup of a tied weight) faults them in again. A no-op where unsupported."""
    libc = _libc()
    if libc is None or raw.numel() == 0:
        return
    page = 4096
    start, end = raw.data_ptr(), raw.data_ptr() + raw.numel() * raw.element_size()
    first, last = (start + page - 1) // page * page, end // page * page
    if last > first:
        libc.madvise(first, last - first, MADV_PAGEOUT)  # an old kernel says EINVAL: ignored


def kernel_parts(
    parts: list[tuple[int, torch.Tensor]], cols: int
) -> list[tuple[int, torch.Tensor, int]]:
    """The parts as the 8-bit kernel takes them, (type, bytes, rows): Q4_K and Q6_K packed
    (`pack`, their GGUF pages then given back: `release_pages`), the other formats as they
    are."""
    out = []
    for t, raw in parts:
        if int(t) not in PACKED:
            out.append((int(t), raw, raw.shape[0]))
            continue
        out.append((*pack(raw, t, cols), raw.shape[0]))
        release_pages(raw)
    return out


def matmul(weights: GGMLWeights, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [T, cols] float32 (contiguous) -> `out` [T, rows] (float32, contiguous rows) with
    8-bit activations; `weights` holds the C call's prepared arguments."""
    # Many tokens make even a small weight worth the threads (the work is tokens x weights).
    threads = torch.get_num_threads() if weights.parallel or x.shape[0] >= 64 else 1
    status = library().axon_q8_matmul_parts(
        len(weights.parts), weights._types, weights._ptrs, weights._rows, weights.cols,
        x.data_ptr(), x.shape[0], out.data_ptr(), out.stride(0), threads,
    )  # fmt: skip
    if status == -2:
        raise MemoryError("ggml_q8: out of memory for the quantized activations")
    if status != 0:
        types = [t for t, _ in weights.parts]
        raise ValueError(f"ggml_q8: unsupported types {types} or cols {weights.cols}")
    return out


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token x [cols] as the C kernel quantizes it (a test hook): int8 values [cols],
    scales [cols / block], and the sums (block 256: int16 per 16; block 32: float d * sum)."""
    x = x.to(torch.float32).contiguous()
    cols = x.shape[0]
    q = torch.empty(cols, dtype=torch.int8)
    d = torch.empty(cols // block, dtype=torch.float32)
    k = block == 256
    sums = torch.empty(cols // 16, dtype=torch.int16) if k else torch.empty(cols // 32)
    library().axon_q8_quantize(x.data_ptr(), cols, int(k), q.data_ptr(), d.data_ptr(),
                                sums.data_ptr())  # fmt: skip
    return q, d, sums


def quantize_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, cols] -> int8 values [T, cols] and scales [T, cols / block] float32, each block
    on its own: d = max|x| / 127, q = round(x / d) (ties to even; 0 for an all-zero block)."""
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, block)  # [T, cols / block, block]
    d = blocks.abs().amax(-1) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse.unsqueeze(-1)).to(torch.int8)
    return q.reshape(x.shape), d


def matmul_ref(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """The reference twin: x [T, cols] quantized per token per block (`quantize_ref`), times
    the dequantized weight raw [N, row_bytes], in float64 -> [T, N] float32. Equal in exact
    arithmetic to the kernel's integer sums times the block scales."""
    block = block_of(ggml_type)
    q, d = quantize_ref(x, block)
    x_hat = q.double().reshape(x.shape[0], -1, block) * d.double().unsqueeze(-1)
    weight = dequantize_rows_ref(raw, ggml_type, cols).double()
    return (x_hat.reshape(x.shape[0], cols) @ weight.T).float()
