"""Qwen3-MoE (`qwen3_moe`): Qwen3 attention with routed SwiGLU experts in the sparse layers.

Layer i is sparse unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`,
exactly as transformers decides; a dense layer is a Qwen3 layer (and takes the fused C decode
path). The router is softmax top-k, renormalised when `norm_topk_prob`.
"""

from __future__ import annotations

import torch
from torch import nn

from axon.layers import fused_decode, fused_moe_decode
from axon.layers.fused_decode import DecodeWeights
from axon.layers.fused_moe import SparseMoeBlock, expert_packed_mapping
from axon.layers.norm import RMSNorm
from axon.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from axon.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM


def is_sparse_layer(config, layer_idx: int) -> bool:
    if layer_idx in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", 1)
    return config.num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx: int):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: a sparse layer has no dense MLP
        self.self_attn = Qwen3Attention(config, layer_idx)
        self.is_sparse = is_sparse_layer(config, layer_idx)
        if self.is_sparse:
            self.mlp = SparseMoeBlock(config, renormalize=bool(config.norm_topk_prob))
        else:
            self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if not self.is_sparse:
            return super().forward(positions, hidden)
        fused = fused_moe_decode.run(self, positions, hidden)  # a decode step in one C call
        if fused is not None:
            return fused
        # Else (tensor parallelism, a prefill, weights a C kernel lacks) each half in one C call
        # where it has one, in place in `hidden`.
        if fused_decode.run_attention(self, positions, hidden) is None:
            hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        fused = self.mlp.add_in_place(hidden, self.post_attention_layernorm)
        if fused is not None:
            return fused
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def decode_weights(self) -> DecodeWeights:
        """A dense layer's as Llama's; a sparse one's MLP is its SparseMoeBlock."""
        if not self.is_sparse:
            return super().decode_weights()
        attention = self.self_attn.decode_weights()
        return DecodeWeights(
            attention, self.input_layernorm, self.post_attention_layernorm, moe=self.mlp
        )


class Qwen3MoeModel(LlamaModel):
    def layers_and_norm(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """A decode step's layers and final norm in one C call where they all have one (no
        Python between layers, which costs most at batch 1), else LlamaModel's."""
        fused = fused_moe_decode.run_stack(self.layers, positions, hidden, self.norm)
        if fused is not None:
            return fused
        return super().layers_and_norm(positions, hidden)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel
    layer_cls = Qwen3MoeDecoderLayer

    def __init__(self, config):
        super().__init__(config)
        self.packed_modules_mapping = {
            **Qwen3ForCausalLM.packed_modules_mapping,
            **expert_packed_mapping(config.num_experts),
        }
