"""A model's config without transformers: config.json (or a GGUF file's metadata) read into the
attributes transformers' config class of the same `model_type` would hold.

Importing a transformers config class costs an engine process, a server's engine and every
tensor-parallel rank 0.5-1.5 s (the package, and for Llama `configuration_llama`'s validators
pull in torch.distributed.tensor). The text families axon runs are plain dataclasses: their
defaults and `__post_init__` rules (head_dim, KV heads, sliding windows, layer schedules, RoPE
parameters from `rope_theta` / `rope_scaling`) are restated here, and
`tests/unit/test_light_config.py` compares every attribute with transformers' on the suite's
configs. A `model_type` not in `TEXT_DEFAULTS` (the multimodal wrappers) still comes from
transformers' `AutoConfig`.
"""

from __future__ import annotations

import json
from pathlib import Path
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
}  # fmt: skip
# transformers' attribute_map: the checkpoint's name for a field, and the name axon reads.
_ALIASES = {"qwen3_moe": {"num_local_experts": "num_experts"}}
_BASE_DEFAULTS = dict(architectures=None, dtype=None, transformers_version=None)

# Keys PreTrainedConfig drops from config.json: generation settings belong to
# generation_config.json, and these name the loading rather than the model.
_DROPPED = frozenset(
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
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
_ORIGINAL_LENGTH_ROPE_TYPES = ("llama3", "yarn", "longrope")


class LightConfig:
    """A model config as plain attributes (transformers' names and values); mutable, as the
    model files set `tie_word_embeddings` on a text config, and picklable for the ranks."""

    def __init__(self, model_type: str, fields: dict[str, Any]):
        self.__dict__.update(fields)
        self.model_type = model_type

    def get_text_config(self) -> LightConfig:
        return self

    # transformers' older names for two fields, kept as its configs keep them.
    @property
    def rope_scaling(self) -> dict | None:
        return self.rope_parameters

    @property
    def torch_dtype(self):
        return self.dtype

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"LightConfig({self.model_type!r}, {self.__dict__!r})"


def read_config_json(model_dir: str | Path):
    """The config of the model directory `model_dir`: a LightConfig for the text families,
    transformers' AutoConfig for the rest."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type in TEXT_DEFAULTS:
        return build_config(model_type, raw)
    from transformers import AutoConfig  # lazy: multimodal wrappers only, 0.5-1.5 s

    return AutoConfig.from_pretrained(model_dir)


def generation_eos_token_id(model_dir: str | Path) -> int | list[int] | None:
    """generation_config.json's `eos_token_id`, as transformers' GenerationConfig reads it
    (None when the model has no such file, or `model_dir` is a GGUF file)."""
    try:
        raw = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw.get("eos_token_id")


def build_config(model_type: str, kwargs: dict[str, Any]) -> LightConfig:
    """What `ConfigClass(**kwargs)` holds, for `model_type` in TEXT_DEFAULTS."""
    extra = {key: value for key, value in kwargs.items() if key != "model_type"}
    aliases = _ALIASES.get(model_type, {})
    for alias, name in aliases.items():
        if alias in extra:
            extra[name] = extra.pop(alias)
    fields = dict(_BASE_DEFAULTS)
    for name, default in TEXT_DEFAULTS[model_type].items():
        fields[name] = extra.pop(name) if name in extra else _copy(default)
    for name in _BASE_DEFAULTS:
        if name in extra:
            fields[name] = extra.pop(name)
    _FAMILY_RULES.get(model_type, _no_rules)(fields, extra)
    torch_dtype = extra.pop("torch_dtype", None)
    if torch_dtype is not None and fields["dtype"] is None:
        fields["dtype"] = torch_dtype
    if model_type == "gemma3_text":
        _gemma3_rope(fields, extra)
    else:
        _convert_rope(fields, extra)
    fields.update({key: value for key, value in extra.items() if key not in _DROPPED})
    for key in ("layer_types", "mtp_layer_types"):
        if fields.get(key) is not None:
            fields[key] = [_LEGACY_LAYER_TYPES.get(kind, kind) for kind in fields[key]]
    fields.update({alias: fields[name] for alias, name in aliases.items()})
    return LightConfig(model_type, fields)


def _copy(value):
    return dict(value) if isinstance(value, dict) else value


def _no_rules(fields: dict, extra: dict) -> None:
    pass


def _llama_rules(fields: dict, extra: dict) -> None:
    if fields["head_dim"] is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]


def _qwen_rules(fields: dict, extra: dict) -> None:
    """Qwen2 / Qwen3: a window only when `use_sliding_window`, on the layers past
    `max_window_layers`."""
    fields["sliding_window"] = fields["sliding_window"] if fields["use_sliding_window"] else None
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if fields["layer_types"] is None:
        window, first = fields["sliding_window"], fields["max_window_layers"]
        fields["layer_types"] = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(fields["num_hidden_layers"])
        ]


def _qwen3_moe_rules(fields: dict, extra: dict) -> None:
    fields["sliding_window"] = fields["sliding_window"] if fields["use_sliding_window"] else None
    if fields["mlp_only_layers"] is None:
        fields["mlp_only_layers"] = []


def _gemma3_rules(fields: dict, extra: dict) -> None:
    """Every `sliding_window_pattern`-th layer (6 by default) is global, the rest slide."""
    if fields["use_bidirectional_attention"]:
        fields["sliding_window"] = fields["sliding_window"] // 2 + 1
    pattern = extra.get("sliding_window_pattern", 6)
    fields["_sliding_window_pattern"] = pattern
    if fields["layer_types"] is None:
        fields["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(fields["num_hidden_layers"])
        ]


def _gated_delta_rules(fields: dict, extra: dict) -> None:
    """Qwen3.5 (dense and MoE): every `full_attention_interval`-th layer (4) is full
    attention, the rest Gated DeltaNet; a quarter of each head rotates unless told."""
    extra.setdefault("partial_rotary_factor", 0.25)
    if fields["layer_types"] is None:
        interval = extra.pop("full_attention_interval", 4)
        fields["layer_types"] = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(fields["num_hidden_layers"])
        ]


_FAMILY_RULES = {
    "llama": _llama_rules,
    "qwen2": _qwen_rules,
    "qwen3": _qwen_rules,
    "gemma3_text": _gemma3_rules,
    "qwen3_moe": _qwen3_moe_rules,
    "qwen3_5_text": _gated_delta_rules,
    "qwen3_5_moe_text": _gated_delta_rules,
}


def _convert_rope(fields: dict, extra: dict) -> None:
    """`rope_parameters` from config.json's newer dict or its older `rope_theta` /
    `rope_scaling` / `partial_rotary_factor` keys (PreTrainedConfig's rules)."""
    rope_scaling = extra.pop("rope_scaling", None)
    params = rope_scaling or fields["rope_parameters"] or {}
    theta = extra.pop("rope_theta", 10_000.0)
    partial = extra.pop("partial_rotary_factor", None)
    nested = _nested_keys(fields, params)
    for entry in [params[key] for key in nested] or [params]:
        if entry is None:
            continue
        entry.setdefault("rope_theta", theta)
        if partial is not None:
            entry.setdefault("partial_rotary_factor", partial)
    fields["rope_parameters"] = params
    _standardize_rope(fields)


def _gemma3_rope(fields: dict, extra: dict) -> None:
    """Gemma 3: a global and a local rotary, by layer type (1e6 and 1e4 by default)."""
    rope_scaling = extra.pop("rope_scaling", None)
    params = fields["rope_parameters"]
    if params is None:
        params = {
            "sliding_attention": {"rope_type": "default"},
            "full_attention": {"rope_type": "default"},
        }
    if rope_scaling is not None:
        params["full_attention"].update(rope_scaling)
    if params.get("full_attention") is None:
        params["full_attention"] = {"rope_type": "default"}
    params["full_attention"].setdefault("rope_theta", extra.pop("rope_theta", 1_000_000.0))
    if params.get("sliding_attention") is None:
        params["sliding_attention"] = {"rope_type": "default"}
    local = extra.pop("rope_local_base_freq", 10_000.0)
    params["sliding_attention"].setdefault("rope_theta", local)
    fields["rope_parameters"] = params
    _standardize_rope(fields)


def _nested_keys(fields: dict, params: dict) -> list[str]:
    labels = fields.get("layer_types") or ()
    return [key for key in params if key in labels]


def _standardize_rope(fields: dict) -> None:
    """Each rotary dict gets its `rope_type` (an older `type` key names it) and, for the types
    that scale from a pretraining length, `original_max_position_embeddings`."""
    params = fields["rope_parameters"] or {}
    if not params:
        return
    nested = _nested_keys(fields, params)
    entries = [params[key] for key in nested if params[key] is not None] if nested else [params]
    for entry in entries:
        entry.setdefault("rope_type", entry.get("type", "default"))
        entry.setdefault("rope_theta", None)
        if entry["rope_type"] in _ORIGINAL_LENGTH_ROPE_TYPES:
            entry.setdefault("original_max_position_embeddings", fields["max_position_embeddings"])
    fields["rope_parameters"] = params
