"""The defaults of transformers 5's config classes for the model types axon runs: each class's
declared fields and values, which loader/light_config.py fills in where config.json (or a GGUF
file) is silent. tests/unit/test_light_config.py checks them against transformers."""

from __future__ import annotations

from typing import Any

_LLAMA_LIKE = dict(
    initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
    tie_word_embeddings=False, rope_parameters=None, attention_dropout=0.0,
    pad_token_id=None, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
_QWEN_WINDOW = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)
_GATED_DELTA = dict(
    head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, layer_types=None, attention_bias=False,
)  # fmt: skip
_MOE = dict(num_experts_per_tok=8, output_router_logits=False, router_aux_loss_coef=0.001)

# Each class's declared fields and their defaults (transformers 5's dataclass configs).
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        _LLAMA_LIKE, hidden_act="silu", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pretraining_tp=1,
        attention_bias=False, mlp_bias=False, head_dim=None,
    ),
    "qwen2": dict(
        _LLAMA_LIKE, hidden_act="silu", **_QWEN_WINDOW, vocab_size=151936, hidden_size=4096,
        intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=32768, layer_types=None,
    ),
    "qwen3": dict(
        _LLAMA_LIKE, hidden_act="silu", **_QWEN_WINDOW, vocab_size=151936, hidden_size=4096,
        intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
        attention_bias=False, layer_types=None,
    ),
    "gemma3_text": dict(
        _LLAMA_LIKE, vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
        attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
        layer_types=None, final_logit_softcapping=None, attn_logit_softcapping=None,
        use_bidirectional_attention=False,
    ),
    "qwen3_moe": dict(
        _LLAMA_LIKE, hidden_act="silu", **_MOE, vocab_size=151936, hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
        max_position_embeddings=32768, attention_bias=False, use_sliding_window=False,
        sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768,
        num_experts=128, norm_topk_prob=False, mlp_only_layers=None,
    ),
    "qwen3_5_text": dict(
        _LLAMA_LIKE, hidden_act="silu", **_GATED_DELTA, vocab_size=248320, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=32768,
    ),
    "qwen3_5_moe_text": dict(
        _LLAMA_LIKE, hidden_act="silu", **_GATED_DELTA, **_MOE, vocab_size=248320, hidden_size=2048,
        num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        max_position_embeddings=32768, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=256,
    ),
    "qwen3_vl_text": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
        max_position_embeddings=128000, initializer_range=0.02, rms_norm_eps=1e-6,
        use_cache=True, rope_parameters=None, attention_bias=False, attention_dropout=0.0,
        pad_token_id=None,
    ),
}  # fmt: skip

# The vision towers' configs (no text fields; their rotary is "axial" unless told).
_TOWER = dict(
    depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
    num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
    out_hidden_size=3584, num_position_embeddings=2304, initializer_range=0.02,
    rope_parameters=None,
)  # fmt: skip
VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5_vision": _TOWER,
    "qwen3_5_moe_vision": _TOWER,
    "qwen3_vl_vision": dict(_TOWER, deepstack_visual_indexes=(8, 16, 24)),
}
_QWEN3_5_IDS = dict(
    image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
    vision_end_token_id=248054, tie_word_embeddings=False,
)  # fmt: skip
_QWEN3_VL_IDS = dict(
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
    vision_end_token_id=151653, tie_word_embeddings=False,
)  # fmt: skip
# The multimodal wrappers: (text config's type, vision config's type, the wrapper's own fields).
COMPOSITES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_5": ("qwen3_5_text", "qwen3_5_vision", _QWEN3_5_IDS),
    "qwen3_5_moe": ("qwen3_5_moe_text", "qwen3_5_moe_vision", _QWEN3_5_IDS),
    "qwen3_vl": ("qwen3_vl_text", "qwen3_vl_vision", _QWEN3_VL_IDS),
}
DEFAULT_ROPE_THETA = {"qwen3_vl_text": 500_000.0}

# transformers' attribute_map: the checkpoint's name for a field, and the name axon reads.
_VISION_ALIASES = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}
ALIASES = {
    "qwen3_moe": {"num_local_experts": "num_experts"},
    **{model_type: _VISION_ALIASES for model_type in VISION_DEFAULTS},
}
BASE_DEFAULTS = dict(architectures=None, dtype=None, transformers_version=None)

# Keys PreTrainedConfig drops from config.json: generation settings belong to
# generation_config.json, and these name the loading rather than the model.
DROPPED = frozenset(
    (
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "temperature",
        "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
        "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
        "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
        "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
        "suppress_tokens", "begin_suppress_tokens", "epsilon_cutoff", "eta_cutoff",
        "encoder_repetition_penalty", "num_assistant_tokens", "num_assistant_tokens_schedule",
        "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
        "num_beam_groups", "diversity_penalty", "_commit_hash", "name_or_path", "output_attentions",
        "attn_implementation", "experts_implementation", "per_layer_config", "_attn_implementation",
        "_attn_implementation_internal", "_experts_implementation",
        "_experts_implementation_internal"
    )
)  # fmt: skip
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
ORIGINAL_LENGTH_ROPE_TYPES = ("llama3", "yarn", "longrope")
