"""Rotary position embeddings (neox / rotate-half layout), with HF's rope scaling types."""

from __future__ import annotations

import math

import torch
from torch import nn

from axon.kernels import cpu_ops

# Token counts up to which the fused CPU kernel computes its own cos / sin (decode steps); longer
# prefills compute the same cos / sin once for q and k, and rotate in place in C.
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
        if not (cpu_ops.usable(q, k) and _heads_contiguous(q, k)):
            return self.forward_ref(positions, q, k)
        if q.shape[0] <= FUSED_MAX_TOKENS:
            cpu_ops.rotary_(q, positions, self.inv_freq, self.rotary_dim)
            cpu_ops.rotary_(k, positions, self.inv_freq, self.rotary_dim)
            return q, k
        # a prefill: cos / sin computed once for q and k, as rotary_ computes them (torch's
        # vectorised cos / sin differ in the last bit: a token's row would depend on its step)
        cos, sin = cpu_ops.rotary_angles(positions, self.inv_freq)
        cpu_ops.rotary_table_(q, cos, sin, self.rotary_dim)
        cpu_ops.rotary_table_(k, cos, sin, self.rotary_dim)
        return q, k

    def forward_ref(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """The reference twin: new tensors, inputs unchanged."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [T, rotary_dim / 2]
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)  # [T, 1, rotary_dim / 2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def _heads_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in tensors)


def mrope_axis_of(num_freqs: int, mrope_section: list[int], interleaved: bool) -> torch.Tensor:
    """Which position row (0 = t, 1 = h, 2 = w) drives each of the `num_freqs` frequency pairs;
    [num_freqs] int64. Interleaved (Qwen3-VL, Qwen3.5) is T,H,W,T,H,W,... with H on 1, 4, ...
    up to 3 * section[1] and W on 2, 5, ... up to 3 * section[2], T on the rest; blocked
    (Qwen2-VL) is section[0] T's, then section[1] H's, then section[2] W's."""
    section = [int(size) for size in mrope_section]
    if len(section) != 3 or min(section) < 0:
        raise ValueError(f"mrope_section must be 3 non-negative sizes (t, h, w), got {section}")
    axis = torch.zeros(num_freqs, dtype=torch.int64)
    if interleaved:
        # transformers overwrites these slices of the T frequencies; slices past the end clip.
        axis[1 : 3 * section[1] : 3] = 1
        axis[2 : 3 * section[2] : 3] = 2
        return axis
    if sum(section) != num_freqs:
        raise ValueError(f"mrope_section {section} must sum to the {num_freqs} rotary frequencies")
    axis[section[0] : section[0] + section[1]] = 1
    axis[section[0] + section[1] :] = 2
    return axis


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (M-RoPE): positions [3, T] (rows t, h, w) each drive a subset of the
    rotary frequencies, chosen by `mrope_section` and `interleaved`. Positions [T] are plain RoPE,
    exactly `RotaryEmbedding` including its fused CPU path (text-only batches, decode)."""

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        params: dict,
        mrope_section: list[int],
        interleaved: bool = True,
    ):
        super().__init__(head_dim, rotary_dim, max_position, params)
        self.mrope_section = list(mrope_section)
        self.interleaved = interleaved
        axis = mrope_axis_of(rotary_dim // 2, self.mrope_section, interleaved)
        self.register_buffer("mrope_axis", axis, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, rotary_dim / 2] float32, for positions [3, T] int64."""
        # Per frequency pick the row that drives it, then scale: the same fp32 products as
        # transformers' per-row freqs followed by its recomposition.
        picked = positions.to(torch.float32).t()[:, self.mrope_axis]  # [T, rotary_dim / 2]
        freqs = picked * self.inv_freq
        return freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotated (q, k), each [T, H, D]; positions [3, T] or [T] (then as RotaryEmbedding)."""
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        return self.forward_ref(positions, q, k)

    def forward_ref(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """The reference twin: new tensors, inputs unchanged."""
        if positions.dim() == 1:
            return super().forward_ref(positions, q, k)
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(
                f"M-RoPE positions must be [3, T] or [T], got {tuple(positions.shape)}"
            )
        cos, sin = self.cos_sin(positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, rotary_dim / 2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
