"""RMSNorm in both conventions: `w * x̂` (Llama, Qwen) and `(1 + w) * x̂` (Gemma, Qwen3.5)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        init = torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size)
        self.weight = nn.Parameter(init, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            # Gemma multiplies in float32 before casting back.
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)
