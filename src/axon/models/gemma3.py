"""Gemma3 text (Gemma3ForCausalLM): sliding and global layers with their own RoPE bases,
(1 + w) RMSNorms, q/k norms, pre- and post-norms around attention and MLP, GeGLU, and
embeddings scaled by sqrt(hidden_size)."""

from __future__ import annotations

from dataclasses import replace

import torch

from axon.layers import fused_decode
from axon.layers.fused_decode import DecodeWeights
from axon.layers.norm import RMSNorm
from axon.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Gemma3Attention(LlamaAttention):
    use_qk_norm = True
    norm_unit_offset = True

    def attention_scale(self, config) -> float:
        return config.query_pre_attn_scalar**-0.5


class Gemma3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Gemma3Attention

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(size, eps, unit_offset=True)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        fused = fused_decode.run(self, positions, hidden)  # the whole layer in one kernel
        if fused is not None:
            return fused
        attn_out = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp_out)

    def decode_weights(self) -> DecodeWeights:
        """Llama's, with the norms on both sides of attention and of the MLP."""
        return replace(
            super().decode_weights(), attn_out_norm=self.post_attention_layernorm,
            mlp_in_norm=self.pre_feedforward_layernorm,
            mlp_out_norm=self.post_feedforward_layernorm,
        )  # fmt: skip


class Gemma3Model(LlamaModel):
    norm_unit_offset = True

    def __init__(self, config, layer_cls):
        super().__init__(config, layer_cls)
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        # HF rounds the scale to the weight dtype before multiplying.
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma3Model
    layer_cls = Gemma3DecoderLayer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
