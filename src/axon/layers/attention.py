"""Paged attention over a block KV cache, in pure PyTorch (runs on CPU and GPU), with C kernels
on the CPU (kernels/cpu_ops.c: the cache write, decode and prefill attention read in place).

New K/V are written to the cache at `slot_mapping`; each query then attends to its sequence's
keys gathered from the cache. GQA never repeats K/V: the query heads sharing a KV head are
folded into the query-length axis, so a [Hkv, G*Q, D] x [Hkv, C, D] product does the work.
The cache may hold another dtype than the model's (`kv_cache_dtype`, e.g. float16 on a float32
model, or 8-bit q8_0: layers/kv_quant.py): K/V are rounded to it as written and widened back as
read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axon.kernels import cpu_ops
from axon.layers import kv_quant
from axon.layers.forward_context import AttentionMetadata, get_forward_context


def attend_ref(
    q: torch.Tensor,  # [B, Hkv, M, D]
    k: torch.Tensor,  # [B, Hkv, C, D]
    v: torch.Tensor,  # [B, Hkv, C, D]
    mask: torch.Tensor,  # [B, 1, M, C] bool
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Masked softmax attention; the reference twin of the SDPA path (and the softcap path)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, Hkv, M, C]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def attend(q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
    if softcap is not None:
        return attend_ref(q, k, v, mask, scale, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


_SCRATCH: dict[tuple, torch.Tensor] = {}


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, name: str) -> torch.Tensor:
    """cache[slots] ([Bd, C, Hkv, D]) written into a scratch buffer reused by every layer and
    step: a fresh 30+ MB tensor per layer costs page faults that outweigh the copy itself."""
    numel = slots.numel() * cache[0].numel()
    key = (name, cache.device, cache.dtype)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH[key] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
    out = buffer[:numel].view(slots.numel(), *cache.shape[1:])
    torch.index_select(cache, 0, slots.view(-1), out=out)
    return out.view(*slots.shape, *cache.shape[1:])


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # [num_blocks * block_size, Hkv, D] (q8_0: [.., Hkv, head bytes]), bound by the runner
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        meta = get_forward_context()
        fast = cpu_ops.usable(q, k, v) and cpu_ops.cache_usable(self.k_cache)
        if fast:
            cpu_ops.cache_write(k, v, meta.slot_mapping, self.k_cache, self.v_cache)
        else:
            kv_quant.store(self.k_cache, meta.slot_mapping, k)
            kv_quant.store(self.v_cache, meta.slot_mapping, v)
        if not meta.prefills:  # every row decodes: no gather of rows, no scatter back
            return self._decode(meta, q).reshape(q.shape[0], -1)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
        if fast:  # keys read in place: prompt chunks in one call, verified drafts as decodes
            layout = meta.prefill_layout()
            if layout is not None:
                cpu_ops.paged_prefill_attention(
                    q, self.k_cache, self.v_cache, *layout, self.scale, self.logit_softcap,
                    self.sliding_window, out,
                )  # fmt: skip
            verify = meta.verify_queries()
            if verify is not None:
                rows, slots, lens = verify
                out[rows] = cpu_ops.paged_decode_attention(
                    q[rows], self.k_cache, self.v_cache, slots, lens, self.scale,
                    self.logit_softcap, self.sliding_window,
                )  # fmt: skip
        else:
            for index, chunk in enumerate(meta.prefills):
                rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
                out[rows] = self._prefill(meta, index, q[rows], k[rows], v[rows])
        if meta.decode_token_index is not None:
            out[meta.decode_token_index] = self._decode(meta, q[meta.decode_token_index])
        return out.view(q.shape[0], -1)

    def _prefill(self, meta: AttentionMetadata, index: int, q, k, v) -> torch.Tensor:
        chunk = meta.prefills[index]
        # Earlier chunks or a prefix hit, or a cache of another dtype (the keys as it rounded
        # them, as the decodes will see them): read the cache.
        if chunk.context_len > chunk.query_len or self.k_cache.dtype != k.dtype:
            k = kv_quant.widen(self.k_cache[chunk.key_slots], self.head_dim, q.dtype)
            v = kv_quant.widen(self.v_cache[chunk.key_slots], self.head_dim, q.dtype)
            q = kv_quant.round_query(q, self.k_cache)
        query_len = chunk.query_len
        # [Q, H, D] -> [1, Hkv, G*Q, D]; query head h uses KV head h // G.
        qg = q.view(query_len, self.num_kv_heads, self.group, self.head_dim)
        qg = qg.permute(1, 2, 0, 3).reshape(1, self.num_kv_heads, self.group * query_len, -1)
        kt = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, D]
        vt = v.transpose(0, 1).unsqueeze(0)
        mask = meta.prefill_mask(index, self.sliding_window).repeat(self.group, 1)  # [G*Q, C]
        o = attend(qg, kt, vt, mask[None, None], self.scale, self.logit_softcap)
        o = o.view(self.num_kv_heads, self.group, query_len, self.head_dim)
        return o.permute(2, 0, 1, 3).reshape(query_len, self.num_heads, self.head_dim)

    def _decode(self, meta: AttentionMetadata, q: torch.Tensor) -> torch.Tensor:
        if cpu_ops.usable(q) and cpu_ops.cache_usable(self.k_cache):  # in place: no gather
            return cpu_ops.paged_decode_attention(
                q, self.k_cache, self.v_cache, meta.decode_key_slots, meta.decode_context_lens,
                self.scale, self.logit_softcap, self.sliding_window,
            )  # fmt: skip
        return self._decode_ref(meta, q)

    def _decode_ref(self, meta: AttentionMetadata, q: torch.Tensor) -> torch.Tensor:
        """The reference twin: gather the keys, mask, SDPA."""
        batch = q.shape[0]
        q = kv_quant.round_query(q, self.k_cache)
        qg = q.view(batch, self.num_kv_heads, self.group, self.head_dim)  # [Bd, Hkv, G, D]
        k = gather_slots(self.k_cache, meta.decode_key_slots, "k").transpose(1, 2)  # [Bd,Hkv,C,D]
        v = gather_slots(self.v_cache, meta.decode_key_slots, "v").transpose(1, 2)
        # a cache of another dtype (float16, q8_0)
        k, v = (kv_quant.widen(t, self.head_dim, q.dtype) for t in (k, v))
        mask = meta.decode_mask(self.sliding_window)[:, None, None, :]  # [Bd, 1, 1, C]
        o = attend(qg, k, v, mask, self.scale, self.logit_softcap)
        return o.reshape(batch, self.num_heads, self.head_dim)
