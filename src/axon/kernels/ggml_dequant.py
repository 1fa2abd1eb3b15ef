"""GGML block formats dequantized in pure PyTorch, bit-identical to `gguf.quants.dequantize`.

Every function takes the raw blocks of a tensor as uint8 `[num_blocks, type_size]` and returns
float32 `[num_blocks, block_size]`. The arithmetic follows gguf-py's numpy code operation by
operation (float32 products, then sums), so the results are equal bit for bit; nothing here may be
fused into an FMA (no torch.compile).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
T = GGMLQuantizationType


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32 (an fp16 scale)."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """[n, bytes] -> [n, bytes // width, 2, width]: low nibbles first, then high, per run."""
    qs = qs.reshape(qs.shape[0], -1, 1, width)
    return (qs >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F


def _bits(raw: torch.Tensor, shifts: list[int], mask: int, width: int) -> torch.Tensor:
    """[n, bytes] -> [n, bytes // width, len(shifts), width] bit fields of each byte."""
    raw = raw.reshape(raw.shape[0], -1, 1, width)
    return (raw >> torch.tensor(shifts, dtype=torch.uint8).view(1, 1, -1, 1)) & mask


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], 32).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], 32).float()
    return d * q + m


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """The 5-bit codes [n, 32] of Q5_0 / Q5_1 (high bits little-endian in a uint32)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    high = ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)  # bit i -> element i
    low = _nibbles(qs, 16).reshape(qs.shape[0], 32)
    return low | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _q5_codes(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _q5_codes(b[:, 4:8], b[:, 8:]).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K packed 6-bit scales and mins: [n, 12] uint8 -> two [n, 8] uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sub-block scale and min [n, 8, 1] of Q4_K / Q5_K."""
    sc, mn = k_scale_min(b[:, 4:16])
    d = _f16(b[:, :2]) * sc.float()
    dm = _f16(b[:, 2:4]) * mn.float()
    return d.unsqueeze(-1), dm.unsqueeze(-1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k_affine(b)
    q = _nibbles(b[:, 16:], 32).reshape(b.shape[0], 8, 32).float()
    return (d * q - dm).reshape(b.shape[0], QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k_affine(b)
    low = _nibbles(b[:, 48:], 32).reshape(b.shape[0], 8, 32)
    high = _bits(b[:, 16:48], list(range(8)), 1, 32).reshape(b.shape[0], 8, 32)
    q = (low | (high << 4)).float()
    return (d * q - dm).reshape(b.shape[0], QK_K)


def q6_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K signed codes [n, 16, 16] int8 in [-32, 31]."""
    low = _nibbles(b[:, :128], 64).reshape(b.shape[0], 8, 32)
    high = _bits(b[:, 128:192], [0, 2, 4, 6], 3, 32).reshape(b.shape[0], 8, 32)
    return ((low | (high << 4)).to(torch.int8) - 32).reshape(b.shape[0], 16, 16)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).unsqueeze(-1)  # [n, 16, 1]
    return (d * q6_k_codes(b).float()).reshape(b.shape[0], QK_K)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n, scales = b.shape[0], b[:, :16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _bits(b[:, 16:80], [0, 2, 4, 6], 3, 32).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """[n, 12] packed 6-bit scales -> [n, 16] float32 in [-32, 31]."""
    low = _nibbles(scales[:, :8], 8).reshape(-1, 16)
    high = _bits(scales[:, 8:12], [0, 2, 4, 6], 3, 4).reshape(-1, 16)
    return ((low | (high << 4)).to(torch.int8) - 32).float()


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl = (_f16(b[:, 108:110]) * _q3_k_scales(b[:, 96:108])).reshape(n, 16, 1)
    low = _bits(b[:, 32:96], [0, 2, 4, 6], 3, 32).reshape(n, 16, 16)
    high = _bits(b[:, :32], list(range(8)), 1, 32).reshape(n, 16, 16) ^ 1
    q = (low.to(torch.int8) - (high << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _f16_blocks(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    T.F32: _f32,
    T.F16: _f16_blocks,
    T.BF16: _bf16,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}


def dequantize_rows_ref(raw: torch.Tensor, ggml_type: int, num_cols: int) -> torch.Tensor:
    """Dequantize raw rows [R, row_bytes] uint8 of `ggml_type` to float32 [R, num_cols]."""
    try:
        dequantize = DEQUANTIZERS[ggml_type]
    except KeyError:
        name = GGMLQuantizationType(ggml_type).name
        supported = ", ".join(GGMLQuantizationType(t).name for t in DEQUANTIZERS)
        raise ValueError(f"unsupported GGML type {name}; supported: {supported}") from None
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    blocks = raw.reshape(-1, type_size)  # [R * blocks_per_row, type_size]
    return dequantize(blocks).reshape(raw.shape[0], num_cols)
