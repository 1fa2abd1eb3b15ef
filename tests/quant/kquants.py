"""Simple (not llama.cpp-optimal) Q4_K, Q5_K and Q6_K quantizers: gguf-py can only dequantize
K-quants, and the tests need K-quant files whose weights stay close to the float ones."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

QK_K = 256


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> the 12-byte Q4_K / Q5_K layout."""
    low = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([low, mid, high], axis=1).astype(np.uint8)


def _affine_k(blocks: np.ndarray, levels: int):
    """Codes [n, 8, 32] in [0, levels] and the packed header (d, dmin, scales) of Q4_K / Q5_K."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)
    scale = (sub.max(axis=-1) - low) / levels
    d = scale.max(axis=-1, keepdims=True) / 63
    dmin = (-low).max(axis=-1, keepdims=True) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_safe_div(-low, dmin)), 0, 63).astype(np.uint8)
    step = (d * sc)[..., None]
    offset = (dmin * mn)[..., None]
    codes = np.clip(np.round(_safe_div(sub + offset, step)), 0, levels).astype(np.uint8)
    header = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn)], axis=1)
    return codes, header


def _nibble_pack(codes: np.ndarray) -> np.ndarray:
    """[n, 8, 32] 4-bit codes -> 128 bytes: sub-blocks 2i (low) and 2i + 1 (high) share bytes."""
    pairs = codes.reshape(-1, 4, 2, 32) & 15
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    codes, header = _affine_k(blocks, 15)
    return np.concatenate([header, _nibble_pack(codes)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    codes, header = _affine_k(blocks, 31)
    high = (codes >> 4).astype(np.uint8)  # [n, 8, 32]: bit j of qh[l] is sub-block j's bit 4
    qh = np.zeros((codes.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([header, qh, _nibble_pack(codes)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = (np.abs(scale).max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d)), -128, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = (np.clip(np.round(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    low, high = q & 15, q >> 4  # [n, 2, 128]
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    parts = high.reshape(-1, 2, 4, 32)
    qh = parts[:, :, 0] | (parts[:, :, 1] << 2) | (parts[:, :, 2] << 4) | (parts[:, :, 3] << 6)
    scales = sc.view(np.uint8)
    return np.concatenate([ql, qh.reshape(-1, 64), scales, _f16_bytes(d)], axis=1)


_QUANTIZERS = {
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
K_TYPES = tuple(_QUANTIZERS)


def quantize_k(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> raw blocks uint8 [rows, cols // 256 * size]."""
    rows = data.shape[0]
    blocks = data.astype(np.float32).reshape(-1, QK_K)
    return _QUANTIZERS[qtype](blocks).reshape(rows, -1)
