"""Qwen3.5-MoE (`qwen3_5_moe`, `qwen3_5_moe_text`): the Qwen3.5 hybrid stack (see qwen3_5.py)
with a mixture of experts in every layer: softmax top-k routed experts (always renormalised)
plus a shared SwiGLU expert scaled by `sigmoid(shared_expert_gate(x))`."""

from __future__ import annotations

import torch
from torch import nn

from axon.layers.activation import get_act_and_mul
from axon.layers.fused_moe import SparseMoeBlock, expert_packed_mapping
from axon.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from axon.models.qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
)


class PartialRowParallelLinear(RowParallelLinear):
    """A RowParallelLinear whose output stays this rank's partial sum: the MoE block adds it to
    the routed experts' partial and sums both over the ranks in one all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias if self.tp_rank == 0 else None)


class SharedExpert(nn.Module):
    """A SwiGLU MLP of width `shared_expert_intermediate_size`, sharded as a dense MLP;
    `forward` returns this rank's partial sum (the whole output with one rank)."""

    def __init__(self, config):
        super().__init__()
        inter = config.shared_expert_intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = PartialRowParallelLinear(inter, config.hidden_size)
        self.act_fn = get_act_and_mul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3_5MoeSparseBlock(SparseMoeBlock):
    """Routed experts plus the shared one; the shared expert's gate is replicated, so each
    rank's gated shared partial adds to its routed partial before the block's one all-reduce."""

    def __init__(self, config):
        super().__init__(config, renormalize=True)
        self.shared_expert = SharedExpert(config)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def partial(self, hidden: torch.Tensor) -> torch.Tensor:
        routed = super().partial(hidden)  # [T, H]
        shared = self.shared_expert(hidden) * torch.sigmoid(self.shared_expert_gate(hidden))
        return routed + shared


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    mlp_cls = Qwen3_5MoeSparseBlock


def _with_experts(model: Qwen3_5ForCausalLM) -> None:
    model.packed_modules_mapping = {
        **Qwen3_5ForCausalLM.packed_modules_mapping,
        **expert_packed_mapping(model.config.num_experts),
    }


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    layer_cls = Qwen3_5MoeDecoderLayer

    def __init__(self, config, enable_mtp: bool = False):
        super().__init__(config, enable_mtp)
        _with_experts(self)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    layer_cls = Qwen3_5MoeDecoderLayer

    def __init__(self, config, enable_vision: bool = True, enable_mtp: bool = False):
        super().__init__(config, enable_vision, enable_mtp)
        _with_experts(self)
