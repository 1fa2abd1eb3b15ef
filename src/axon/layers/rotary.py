"""Rotary position embeddings (neox / rotate-half layout), with HF's rope scaling types."""

from __future__ import annotations

import math

import torch
from torch import nn

from axon.kernels import cpu_ops

# Token counts up to which the fused CPU kernel rotates in place (decode steps); longer
# prefills take torch's vectorized cos / sin.
FUSED_MAX_TOKENS = 64


def rope_inv_freq(rotary_dim: int, params: dict) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] for a HF `rope_parameters` dict."""
    base = float(params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (
        base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    )
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first `rotary_dim` channels of q and k ([T, H, D]) in place-free form."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: dict):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        # cos / sin are computed per step from the positions, as transformers does: a table for
        # every position costs 4 * max_position * rotary_dim bytes per layer (576 MiB for
        # gemma-3-270m's 32k context over 18 layers, more than its whole GGUF file).
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, params), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.numel() else out

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotated (q, k), each [T, H, D]; the fused CPU path rotates them in place."""
        if q.shape[0] <= FUSED_MAX_TOKENS and cpu_ops.usable(q, k) and _heads_contiguous(q, k):
            cpu_ops.rotary_(q, positions, self.inv_freq, self.rotary_dim)
            cpu_ops.rotary_(k, positions, self.inv_freq, self.rotary_dim)
            return q, k
        return self.forward_ref(positions, q, k)

    def forward_ref(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """The reference twin: new tensors, inputs unchanged."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [T, rotary_dim / 2]
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)  # [T, 1, rotary_dim / 2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def _heads_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in tensors)
