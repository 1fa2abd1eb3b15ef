"""Qwen3 dense: the Llama layout with per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from axon.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    use_qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
