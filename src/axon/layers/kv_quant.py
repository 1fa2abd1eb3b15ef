"""The KV cache's element types, and the pure-PyTorch twin of the C kernels' q8_0 cache.

A cache holds float32 / float16 / bfloat16 (K and V rounded to it as written, widened back as
read), float8_e4m3fn on a GPU that has it, or q8_0: llama.cpp's 8-bit layout, each group of 32
channels of a head (the whole head where head_dim is no multiple of 32) stored as int8 values
times one float16 scale. A q8_0 cache is a uint8 tensor [slots, Hkv, head_bytes]: per head its
head_dim int8 values, then its groups' float16 scales (kernels/cpu_ops.c reads and writes the
same bytes). That is head_dim * 34 / 32 bytes a head instead of float16's head_dim * 2: 1.88x
the tokens in the same memory.
"""

from __future__ import annotations

import torch

from axon.kernels.cpu_ops import Q8_0


def q8_group(head_dim: int) -> int:
    """Channels sharing one scale."""
    return 32 if head_dim % 32 == 0 else head_dim


def head_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one KV head of one cache slot."""
    if dtype == Q8_0:
        return head_dim + 2 * (head_dim // q8_group(head_dim))
    return head_dim * dtype.itemsize


def cache_shape(dtype: torch.dtype, slots: int, num_kv_heads: int, head_dim: int) -> tuple:
    """The shape of one layer's K (or V) cache: [slots, Hkv, D], or [slots, Hkv, head_bytes]
    for q8_0."""
    last = head_bytes(dtype, head_dim) if dtype == Q8_0 else head_dim
    return (slots, num_kv_heads, last)


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> uint8 [..., head_bytes]: per group, scale = float16(max |x| / 127) and
    value = round(x / scale) (half to even), as cpu_ops.c's quantize_head: the same bytes."""
    head_dim = x.shape[-1]
    group = q8_group(head_dim)
    xg = x.float().reshape(*x.shape[:-1], head_dim // group, group)  # [..., G, 32]
    scale = (xg.abs().amax(-1, keepdim=True) / 127.0).half()  # [..., G, 1]
    d = scale.float()
    values = torch.where(d > 0, torch.round(xg / d), torch.zeros_like(xg)).clamp_(-127, 127)
    values = values.to(torch.int8).reshape(*x.shape[:-1], head_dim).view(torch.uint8)
    scales = scale.reshape(*x.shape[:-1], head_dim // group).view(torch.uint8)
    return torch.cat([values, scales], dim=-1)


def dequantize_q8(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., head_bytes] q8_0 heads -> [..., D] in `dtype`."""
    group = q8_group(head_dim)
    values = rows[..., :head_dim].view(torch.int8).float()
    scales = rows[..., head_dim:].contiguous().view(torch.float16).float()  # [..., D / 32]
    values = values.reshape(*rows.shape[:-1], head_dim // group, group) * scales[..., None]
    return values.reshape(*rows.shape[:-1], head_dim).to(dtype)


def round_query(q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """q [..., D] as the attention of `cache` reads it: rounded to q8_0 and back for a q8_0
    cache (its keys' dot products are q8_0 by q8_0, as llama.cpp's and the C kernels' integer
    products), else q itself."""
    if cache.dtype != Q8_0:
        return q
    return dequantize_q8(quantize_q8(q), q.shape[-1], q.dtype)


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots] = x [T, Hkv, D] in the cache's element type."""
    encoded = quantize_q8(x) if cache.dtype == Q8_0 else x.to(cache.dtype)
    cache.index_copy_(0, slots, encoded)


def widen(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., Hkv, D or head_bytes] as `dtype` [..., Hkv, D] (a copy, or rows itself
    when they already are)."""
    if rows.dtype == Q8_0:
        return dequantize_q8(rows, head_dim, dtype)
    return rows.to(dtype)
