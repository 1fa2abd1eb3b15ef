"""Fused float32 CPU operations (cpu_ops.c, through ctypes): RMSNorm, rotary, gated
activations, the KV cache write and paged attention. Each replaces a sequence of small torch ops
whose dispatch costs far more than its arithmetic at decode sizes (prefill attention: a mask,
copies and SDPA over the whole square where the causal triangle is all that is needed);
each has a pure-PyTorch reference twin in `axon.layers` that runs on other devices and dtypes,
and that the tests compare against.

`usable(*tensors)` says whether a call may take this path: the library built, every tensor a
float32 CPU tensor.
"""

from __future__ import annotations

import torch

from axon.kernels.abi import library

# Work (multiply-adds) below which attention runs on one thread: waking a second costs more.
PARALLEL_MIN_WORK = 1 << 18

# A q8_0 KV cache's storage dtype (layers/kv_quant.py lays it out): its dtype names its type.
Q8_0 = torch.uint8
# The KV cache element types the kernels read and write -> cpu_ops.c's kv_type codes.
KV_TYPES = {torch.float32: 0, torch.float16: 1, Q8_0: 2}


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the C path may run on these tensors (float32, CPU, library built)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return False
    return library() is not None


def cache_usable(cache: torch.Tensor) -> bool:
    """Whether the C attention kernels read (and cache_write writes) this KV cache: float32,
    float16 or q8_0, on the CPU, library built."""
    if cache.device.type != "cpu" or cache.dtype not in KV_TYPES:
        return False
    return library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """x [..., D] (last dim contiguous) -> normalized copy [..., D], contiguous."""
    dim = x.shape[-1]
    if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == dim and x.stride(0) > x.shape[1] * dim:
        # [T, H, D] heads of a fused projection (token rows strided): read in place, no copy
        out = torch.empty(x.shape, dtype=torch.float32)
        library().axon_rms_norm_heads(
            x.data_ptr(), x.stride(0), x.shape[1], weight.data_ptr(), out.data_ptr(),
            x.shape[0], dim, eps, int(unit_offset),
        )  # fmt: skip
        return out
    rows = x.reshape(-1, dim) if x.stride(-1) == 1 else x.contiguous().view(-1, dim)
    if rows.shape[0] > 1 and rows.stride(0) < dim:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    library().axon_rms_norm(
        rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), dim,
        rows.shape[0], dim, eps, int(unit_offset),
    )  # fmt: skip
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int):
    """Rotate x [T, H, D] in place (heads D apart, channels contiguous; tokens any stride)."""
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError("rotary_: each token's heads must be contiguous")
    positions = positions.contiguous()
    library().axon_rotary(
        x.data_ptr(), x.stride(0), tokens, heads, head_dim, rotary_dim,
        positions.data_ptr(), inv_freq.data_ptr(),
    )  # fmt: skip
    return x


def rotary_angles(positions: torch.Tensor, inv_freq: torch.Tensor):
    """(cos, sin) [T, half] of positions * inv_freq, computed as rotary_ computes them."""
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    cos = torch.empty(positions.shape[0], inv_freq.shape[0], dtype=torch.float32)
    sin = torch.empty_like(cos)
    library().axon_rotary_angles(
        positions.data_ptr(), positions.shape[0], inv_freq.data_ptr(), inv_freq.shape[0],
        cos.data_ptr(), sin.data_ptr(),
    )  # fmt: skip
    return cos, sin


def rotary_table_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int):
    """As rotary_, each token's angles given as cos / sin [T, rotary_dim / 2] (float32)."""
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError("rotary_table_: each token's heads must be contiguous")
    cos, sin = cos.contiguous(), sin.contiguous()
    library().axon_rotary_table(
        x.data_ptr(), x.stride(0), tokens, heads, head_dim, rotary_dim, cos.data_ptr(),
        sin.data_ptr(),
    )  # fmt: skip
    return x


def set_decode_split(positions: int) -> int:
    """Decode attention splits a context longer than `positions` (1024 unless set) in parts of
    it, spread over the threads and combined after; returns the previous setting. The tests set
    a few dozen to cross parts on short contexts."""
    return library().axon_decode_split(positions)


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D] float32 or float16, or q8_0 [slots, Hkv, bytes]
    v_cache: torch.Tensor,
    key_slots: torch.Tensor,  # [B, C] int64, padded
    context_lens: torch.Tensor,  # [B] int64
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """Each query against its own cached keys, read in place from the cache -> [B, H, D]."""
    batch, heads, head_dim = q.shape
    q = q.contiguous()
    key_slots, context_lens = key_slots.contiguous(), context_lens.contiguous()
    width = key_slots.shape[1]
    work = batch * heads * width * head_dim
    threads = torch.get_num_threads() if work >= PARALLEL_MIN_WORK else 1
    scratch = torch.empty(threads * heads * width, dtype=torch.float32)
    out = torch.empty_like(q)
    status = library().axon_paged_decode_attention(
        q.data_ptr(), heads * head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
        key_slots.data_ptr(), width,
        context_lens.data_ptr(), batch, heads, k_cache.shape[1], head_dim, scale,
        softcap or 0.0, window or 0, out.data_ptr(), scratch.data_ptr(), threads,
        KV_TYPES[k_cache.dtype],
    )  # fmt: skip
    if status:
        raise MemoryError("paged_decode_attention: no memory for the cache's staging rows")
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D] float32 or float16, or q8_0 [slots, Hkv, bytes]
    v_cache: torch.Tensor,
    chunks: torch.Tensor,  # [N, 4] int64: query_start, query_len, context_len, slots offset
    slots: torch.Tensor,  # every chunk's key slots, concatenated
    scale: float,
    softcap: float | None,
    window: int | None,
    out: torch.Tensor,  # [T, H, D] contiguous: the chunks' rows written
) -> torch.Tensor:
    """Each prefill chunk's queries over the keys they may see (causal, sliding window), read in
    place from the cache: the step's K / V must already be written."""
    heads, head_dim = q.shape[1], q.shape[2]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    work = int(chunks[:, 1].mul(chunks[:, 2]).sum()) * heads * head_dim
    threads = torch.get_num_threads() if work >= PARALLEL_MIN_WORK else 1
    status = library().axon_paged_prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        chunks.data_ptr(), chunks.shape[0], heads, k_cache.shape[1], head_dim, scale,
        softcap or 0.0, window or 0, out.data_ptr(), threads, KV_TYPES[k_cache.dtype],
    )  # fmt: skip
    if status:
        raise MemoryError("paged_prefill_attention: no memory for a thread's scratch")
    return out


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """x [T, 2I] (rows contiguous) -> act(x[:, :I]) * x[:, I:] [T, I]; activation in
    ACTIVATIONS."""
    tokens, width = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(tokens, width // 2, dtype=torch.float32)
    library().axon_act_and_mul(
        x.data_ptr(), x.stride(0), out.data_ptr(), tokens, width // 2, ACTIVATIONS[activation]
    )
    return out


def cache_write(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache
) -> None:
    """k_cache[slots] = k and v_cache[slots] = v for k / v [T, Hkv, D] (token rows may be
    strided, each row contiguous); a float16 cache gets them rounded as .to(float16) would, a
    q8_0 cache quantized as kv_quant.quantize_q8 would (the same bytes)."""
    tokens, heads, head_dim = k.shape
    k, v = (t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous() for t in (k, v))
    slots = slots.contiguous()
    library().axon_cache_write(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), tokens, heads,
        head_dim, k_cache.data_ptr(), v_cache.data_ptr(), KV_TYPES[k_cache.dtype],
    )  # fmt: skip
