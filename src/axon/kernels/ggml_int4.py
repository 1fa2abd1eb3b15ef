"""GGML formats repacked for torch's int4 weight-only CPU kernel (group size 32, bf16).

The kernel computes `w = (code - 8) * scale + zero` with one (scale, zero) per 32 inputs of each
output row. Q4_0, Q4_1 and Q4_K are exactly that form. Wider codes are split into a high and a low
piece (`q = 16 * hi + lo`) that become a weight with `P = 2` times the inputs; the input is then
expanded to match: every run of `piece_width` inputs is repeated once per piece, times that piece's
multiplier. Q8_0 and Q5_* pieces are whole 32-groups; a Q6_K group holds the high and low piece of
one 16-input sub-block, with the high piece's input multiplied by 16 (exact in bf16) so that both
share the sub-block's scale. The only loss is the rounding of scales and zeros to bf16 (and the
bf16 activations), which the tests bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from axon.kernels.ggml_dequant import _f16, _nibbles, k_scale_min, q6_k_codes

T = GGMLQuantizationType
GROUP = 32


@dataclass
class Int4Weight:
    """A weight [N, K] as int4 codes packed for `_weight_int4pack_mm_for_cpu`."""

    packed: torch.Tensor  # [N, K * P / 2] uint8 (the kernel's own layout)
    scales_and_zeros: torch.Tensor  # [K * P / 32, N, 2] bf16
    piece_width: int  # inputs per run that the expansion repeats (32, or 16 for Q6_K)
    multipliers: tuple[float, ...]  # per piece; () when the input is used as it is


def _q4_0(b):
    d = _f16(b[:, :2])  # [nb, 1]
    return _nibbles(b[:, 2:], 16).reshape(-1, 32), d, torch.zeros_like(d)


def _q4_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:], 16).reshape(-1, 32), d, m + 8 * d


def _q4_k(b):
    sc, mn = k_scale_min(b[:, 4:16])
    scale = _f16(b[:, :2]) * sc.float()  # [nb, 8]
    zero = 8 * scale - _f16(b[:, 2:4]) * mn.float()
    return _nibbles(b[:, 16:], 32).reshape(-1, 8 * 32), scale, zero


def _split(codes: torch.Tensor, scale: torch.Tensor, low_zero: torch.Tensor):
    """Signed or 5-bit codes [nb, G, 32] -> pieces (hi + 8, lo) per 32-group: [nb, G * 64]."""
    hi, lo = (codes >> 4) + 8, codes & 0x0F
    pieces = torch.stack([hi, lo], dim=2)  # [nb, G, 2, 32]
    scales = torch.stack([16 * scale, scale], dim=-1)  # [nb, G, 2]
    zeros = torch.stack([torch.zeros_like(scale), low_zero], dim=-1)
    nb = codes.shape[0]
    return pieces.reshape(nb, -1), scales.reshape(nb, -1), zeros.reshape(nb, -1)


def _q8_0(b):
    d = _f16(b[:, :2])  # [nb, 1]
    codes = b[:, 2:].contiguous().view(torch.int8).reshape(-1, 1, 32)
    return _split(codes, d, 8 * d)


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8)
    high = ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 1, 32)
    return _nibbles(qs, 16).reshape(qs.shape[0], 1, 32) | (high << 4)


def _q5_0(b):
    d = _f16(b[:, :2])
    return _split(_q5_codes(b[:, 2:6], b[:, 6:]), d, -8 * d)


def _q5_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _split(_q5_codes(b[:, 4:8], b[:, 8:]), d, 8 * d + m)


def _q5_k(b):
    sc, mn = k_scale_min(b[:, 4:16])
    scale = _f16(b[:, :2]) * sc.float()  # [nb, 8]
    low = _nibbles(b[:, 48:], 32).reshape(-1, 8, 32)
    high = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    codes = low | (high << 4)  # [nb, 8, 32]
    return _split(codes, scale, 8 * scale - _f16(b[:, 2:4]) * mn.float())


def _q6_k(b):
    """Per 16-input sub-block one group: [hi + 6 (input x16), lo], zero 8 s / 17 (see module)."""
    q6 = q6_k_codes(b) + 32  # [nb, 16, 16] in [0, 63]
    pieces = torch.stack([(q6 >> 4) + 6, q6 & 0x0F], dim=2)  # [nb, 16, 2, 16]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    scale = _f16(b[:, 208:210]) * scales  # [nb, 16]
    return pieces.reshape(b.shape[0], -1), scale, scale * (8 / 17)


# type -> (repack, piece width, input multipliers per piece)
_FORMATS = {
    T.Q4_0: (_q4_0, GROUP, ()),
    T.Q4_1: (_q4_1, GROUP, ()),
    T.Q4_K: (_q4_k, GROUP, ()),
    T.Q8_0: (_q8_0, GROUP, (1.0, 1.0)),
    T.Q5_0: (_q5_0, GROUP, (1.0, 1.0)),
    T.Q5_1: (_q5_1, GROUP, (1.0, 1.0)),
    T.Q5_K: (_q5_k, GROUP, (1.0, 1.0)),
    T.Q6_K: (_q6_k, 16, (16.0, 1.0)),
}
INT4_TYPES = frozenset(_FORMATS)


def repack_int4(raw: torch.Tensor, ggml_type: int, num_rows: int) -> Int4Weight:
    """Repack raw rows [N, row_bytes] of an INT4_TYPES format for the int4 kernel."""
    repack, piece_width, multipliers = _FORMATS[ggml_type]
    type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][1]
    codes, scale, zero = repack(raw.reshape(-1, type_size))
    codes = codes.reshape(num_rows, -1).to(torch.int32)  # [N, K * P]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.stack(
        [scale.reshape(num_rows, -1).t(), zero.reshape(num_rows, -1).t()], dim=-1
    )  # [K * P / 32, N, 2]
    sz = scales_and_zeros.to(torch.bfloat16).contiguous()
    return Int4Weight(packed, sz, piece_width, multipliers)


def expand_input(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [T, K] bf16 -> the kernel's input [T, K * P] (see the module docstring)."""
    if not weight.multipliers:
        return x
    runs = x.view(x.shape[0], -1, 1, weight.piece_width)  # [T, K / w, 1, w]
    mult = torch.tensor(weight.multipliers, dtype=x.dtype).view(1, 1, -1, 1)
    return (runs * mult).reshape(x.shape[0], -1)  # [T, K * P]


def int4_matmul(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [T, K] -> x @ W.T [T, N] in x's dtype, computed with bf16 activations."""
    xb = expand_input(x.to(torch.bfloat16), weight)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        xb, weight.packed, GROUP, weight.scales_and_zeros
    )
    return out.to(x.dtype)
