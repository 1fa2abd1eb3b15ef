"""Llama-family decoder (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms)."""

from __future__ import annotations

import torch
from torch import nn

from axon.distributed.parallel_state import get_tp_size
from axon.layers import fused_decode
from axon.layers.activation import get_act_and_mul
from axon.layers.attention import Attention
from axon.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from axon.layers.fused_decode import AttentionWeights, DecodeWeights
from axon.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from axon.layers.norm import RMSNorm
from axon.layers.rotary import RotaryEmbedding
from axon.models.utils import head_dim_of, layer_type_of, rope_params_of


class LlamaAttention(nn.Module):
    qkv_bias_default = False
    use_qk_norm = False
    norm_unit_offset = False

    def __init__(self, config, layer_idx: int):
        super().__init__()
        tp_size = get_tp_size()
        self.head_dim = head_dim_of(config)
        total_kv_heads = config.num_key_value_heads
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, total_kv_heads // tp_size)
        qkv_bias = getattr(config, "attention_bias", self.qkv_bias_default)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, total_kv_heads, qkv_bias
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            getattr(config, "attention_bias", False),
        )
        if self.use_qk_norm:
            eps, offset = config.rms_norm_eps, self.norm_unit_offset
            self.q_norm = RMSNorm(self.head_dim, eps, offset)
            self.k_norm = RMSNorm(self.head_dim, eps, offset)
        layer_type = layer_type_of(config, layer_idx)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            self.head_dim,
            config.max_position_embeddings,
            rope_params_of(config, layer_type),
        )
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.attention_scale(config),
            sliding_window=window,
            logit_softcap=getattr(config, "attn_logit_softcapping", None),
        )

    def attention_scale(self, config) -> float:
        return self.head_dim**-0.5

    def decode_weights(self) -> AttentionWeights:
        """Its modules for the one-call C decode layer (layers/fused_decode.py)."""
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.use_qk_norm else (None, None)
        return AttentionWeights(
            self.qkv_proj, self.o_proj, self.rotary_emb, self.attn, q_norm=q_norm, k_norm=k_norm
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias)
        self.act_fn = get_act_and_mul(
            getattr(config, "hidden_activation", None) or config.hidden_act
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        fused = fused_decode.run(self, positions, hidden)  # the whole layer in one kernel
        if fused is not None:
            return fused
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def decode_weights(self) -> DecodeWeights:
        """Its modules for the one-call C decode layer (layers/fused_decode.py)."""
        mlp = self.mlp
        return DecodeWeights(
            self.self_attn.decode_weights(), self.input_layernorm, self.post_attention_layernorm,
            gate_up=mlp.gate_up_proj, down=mlp.down_proj, act_fn=mlp.act_fn,
        )  # fmt: skip


class LlamaModel(nn.Module):
    def __init__(self, config, layer_cls: type[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.norm_unit_offset)

    norm_unit_offset = False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # [T, hidden]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden]; `inputs_embeds` [T, hidden] (token embeddings with
        image rows written over them) replaces the embedding lookup."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        return self.layers_and_norm(positions, hidden)

    def layers_and_norm(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    layer_cls = LlamaDecoderLayer
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, self.layer_cls)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [B, V]


class Qwen2Attention(LlamaAttention):
    qkv_bias_default = True  # Qwen2 always has q/k/v biases and no o_proj bias


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer
