"""Qwen3.5 text stack (`qwen3_5`, `qwen3_5_text`): a hybrid of Gated DeltaNet layers and gated
full attention, per the config's `layer_types` (three linear layers to one full by default).

Full-attention layers: `q_proj` yields per head a query and an output gate (interleaved per
head), q/k RMSNorms, partial rotary, `attn * sigmoid(gate)` before `o_proj`; only these layers
hold paged KV. Every RMSNorm outside the GDN mixer is zero-centred, `x̂ * (1 + w)`. The MLP is a
dense SwiGLU. A config's `linear_value_head_order` ("tiled" for llama.cpp's `qwen35` GGUF files,
else "grouped") says how the GDN weights order their value heads. A
`Qwen3_5ForConditionalGeneration` checkpoint's `model.language_model.*` weights are the text
model and `model.visual.*` the vision tower (skipped, with its memory, when vision is disabled);
`mtp.*` (the multi-token-prediction block, qwen3_5_mtp.py) is loaded as `mtp` only with
`enable_mtp` (speculative decoding's mtp method), else skipped. Rotary is M-RoPE when the
config has an `mrope_section`: positions [3, T] for steps with image tokens, [T] (plain RoPE,
the fast path) otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from axon.layers.attention import Attention
from axon.layers.linear import QKVParallelLinear, RowParallelLinear
from axon.layers.linear_attention import GatedDeltaNet
from axon.layers.norm import RMSNorm
from axon.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from axon.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from axon.models.qwen3_5_mtp import Qwen3_5MultiTokenPredictor
from axon.models.qwen3_5_vision import Qwen3_5VisionTower
from axon.models.utils import head_dim_of, rope_params_of


def rotary_dim_of(config, head_dim: int) -> int:
    """Rotated channels per head: `head_dim * partial_rotary_factor` (0.25 for Qwen3.5)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def rotary_of(config, head_dim: int) -> RotaryEmbedding:
    """M-RoPE when the rope parameters carry an `mrope_section` (every released Qwen3.5), else
    plain RoPE; both take 1-D positions the same way."""
    params = rope_params_of(config)
    args = (head_dim, rotary_dim_of(config, head_dim), config.max_position_embeddings, params)
    if params.get("mrope_section") is None:
        return RotaryEmbedding(*args)
    return MRotaryEmbedding(
        *args, params["mrope_section"], bool(params.get("mrope_interleaved", True))
    )


class Qwen3_5Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = head_dim_of(config)
        total_heads = config.num_attention_heads
        bias = getattr(config, "attention_bias", False)
        # q_proj is [query_h | gate_h] per head: as 2H "heads" it fuses (and splits across
        # ranks, a head's query and gate together) like any q projection.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, 2 * total_heads, config.num_key_value_heads, bias
        )
        self.num_heads = self.qkv_proj.num_heads // 2  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.rotary_emb = rotary_of(config, self.head_dim)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_size, kv_size = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_gate, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)  # [T, H, D]
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.contiguous(), k, v)  # [T, H * D]
        return self.o_proj(out * torch.sigmoid(gate.reshape(num_tokens, -1)))


class Qwen3_5DecoderLayer(nn.Module):
    mlp_cls: type[nn.Module] = LlamaMLP  # Qwen3.5-MoE: routed experts plus a shared one

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            order = getattr(config, "linear_value_head_order", "grouped")
            self.linear_attn = GatedDeltaNet(config, value_head_order=order)
        elif self.layer_type == "full_attention":
            self.self_attn = Qwen3_5Attention(config)
        else:
            raise ValueError(f"unsupported qwen3_5 layer type {self.layer_type!r}")
        self.mlp = self.mlp_cls(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(size, eps, unit_offset=True)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.layer_type == "linear_attention":
            hidden = hidden + self.linear_attn(normed)
        else:
            hidden = hidden + self.self_attn(positions, normed)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3_5TextModel(LlamaModel):
    norm_unit_offset = True


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Text-only Qwen3.5 for a `qwen3_5_text` config or a multimodal `qwen3_5` one."""

    model_cls = Qwen3_5TextModel
    layer_cls = Qwen3_5DecoderLayer
    # GDN layers hold the decay rate as A = -exp(A_log) (as GGUF stores it).
    packed_modules_mapping = {**LlamaForCausalLM.packed_modules_mapping, "A_log": ("A", "A_log")}
    checkpoint_prefixes = {"model.language_model.": "model."}
    ignored_checkpoint_prefixes = ("model.visual.", "mtp.")
    supports_mtp = True

    def __init__(self, config, enable_mtp: bool = False):
        # A multimodal config decides tying at its top level, as transformers does.
        tied = bool(getattr(config, "tie_word_embeddings", False))
        text_config = config.get_text_config()
        text_config.tie_word_embeddings = tied
        super().__init__(text_config)
        self.tie_word_embeddings = tied
        self.mtp = None
        if enable_mtp:
            name = getattr(config, "name_or_path", None) or "this model"
            self.mtp = Qwen3_5MultiTokenPredictor(text_config, self.layer_cls, name)
            self.ignored_checkpoint_prefixes = tuple(
                p for p in self.ignored_checkpoint_prefixes if p != "mtp."
            )


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """Qwen3.5 with its vision tower (`visual`, from `model.visual.*`) when the config has a
    `vision_config` and `enable_vision`; otherwise exactly the text-only model."""

    supports_vision = True

    def __init__(self, config, enable_vision: bool = True, enable_mtp: bool = False):
        super().__init__(config, enable_mtp)
        self.visual = None
        vision_config = getattr(config, "vision_config", None)
        if enable_vision and vision_config is not None:
            self.visual = Qwen3_5VisionTower(vision_config)
            self.checkpoint_prefixes = {**self.checkpoint_prefixes, "model.visual.": "visual."}
            self.ignored_checkpoint_prefixes = () if enable_mtp else ("mtp.",)
            self.image_token_id = int(config.image_token_id)
            self.vision_start_token_id = int(config.vision_start_token_id)
            self.spatial_merge_size = int(vision_config.spatial_merge_size)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        """The tower's LM-width embeddings [num_merged_tokens, hidden] of images in `grid_thw`
        order (Qwen3.5 has no DeepStack features). Raises ValueError without a tower."""
        if self.visual is None:
            raise ValueError("this model has no vision tower loaded (text-only)")
        embeds, _ = self.visual(pixel_values, grid_thw)
        return embeds
