"""Gated activations over a fused [gate | up] projection: [T, 2I] -> [T, I]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axon.kernels import cpu_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.usable(x) and x.dim() == 2:
            return cpu_ops.act_and_mul(x, "silu")
        return self.forward_ref(x)

    def forward_ref(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.approximate == "tanh" and cpu_ops.usable(x) and x.dim() == 2:
            return cpu_ops.act_and_mul(x, "gelu_tanh")
        return self.forward_ref(x)

    def forward_ref(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


def get_act_and_mul(name: str) -> nn.Module:
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluAndMul("tanh")
    if name == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"unsupported activation {name!r}; supported: silu, gelu, gelu_pytorch_tanh")
