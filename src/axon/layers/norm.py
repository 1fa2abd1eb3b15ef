"""RMSNorm in both conventions: `w * x̂` (Llama, Qwen) and `(1 + w) * x̂` (Gemma, Qwen3.5)."""

from __future__ import annotations

import torch
from torch import nn

from axon.kernels import cpu_ops


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool):
    """The reference twin of the fused CPU kernel (and the path for other devices / dtypes)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        # Gemma multiplies in float32 before casting back.
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        init = torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size)
        self.weight = nn.Parameter(init, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.usable(x, self.weight):
            return cpu_ops.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return rms_norm_ref(x, self.weight, self.eps, self.unit_offset)
