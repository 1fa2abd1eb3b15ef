"""A model's config without transformers: config.json (or a GGUF file's metadata) read into the
attributes transformers' config class of the same `model_type` would hold.

Importing transformers' config classes costs every engine process, server engine and
tensor-parallel rank 0.5-1.5 s (the package; for Llama, `configuration_llama`'s validators pull
in torch.distributed.tensor). The config classes of the model types axon runs are dataclasses:
their defaults (loader/config_defaults.py) and `__post_init__` rules (head_dim, KV heads,
sliding windows, layer schedules, RoPE parameters from `rope_theta` / `rope_scaling`, the
multimodal wrappers' text and vision configs) are restated here, and
tests/unit/test_light_config.py compares every attribute with transformers' on the suite's
configs. A `model_type` axon does not run still comes from transformers' `AutoConfig`, so that
the model registry names it in its error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from axon.loader.config_defaults import (
    ALIASES,
    BASE_DEFAULTS,
    COMPOSITES,
    DEFAULT_ROPE_THETA,
    DROPPED,
    LEGACY_LAYER_TYPES,
    ORIGINAL_LENGTH_ROPE_TYPES,
    TEXT_DEFAULTS,
    VISION_DEFAULTS,
)


class LightConfig:
    """A model config as plain attributes (transformers' names and values); mutable, as the
    model files set `tie_word_embeddings` on a text config, and picklable for the ranks."""

    def __init__(self, model_type: str, fields: dict[str, Any]):
        self.__dict__.update(fields)
        self.model_type = model_type

    def get_text_config(self) -> LightConfig:
        """The text model's config: a wrapper's `text_config`, else this one."""
        return self.__dict__.get("text_config") or self

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
    """The config of the model directory `model_dir` (a LightConfig for every model type
    axon runs)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type in TEXT_DEFAULTS or model_type in COMPOSITES:
        return build_config(model_type, raw)
    from transformers import AutoConfig  # lazy: a model type axon does not run (an error next)

    return AutoConfig.from_pretrained(model_dir)


def generation_eos_token_id(model_dir: str | Path) -> int | list[int] | None:
    """generation_config.json's `eos_token_id`, as transformers' GenerationConfig reads it
    (None when the model has no such file, or `model_dir` is a GGUF file)."""
    try:
        raw = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw.get("eos_token_id")


def eos_token_ids(model_dir: str | Path, hf_config) -> frozenset[int]:
    """EOS ids from generation_config.json (which may list several) and config.json."""
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), generation_eos_token_id(model_dir)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def build_config(model_type: str, kwargs: dict[str, Any]) -> LightConfig:
    """What `ConfigClass(**kwargs)` holds, for `model_type` one of TEXT_DEFAULTS,
    VISION_DEFAULTS or COMPOSITES."""
    if model_type in COMPOSITES:
        return _build_composite(model_type, kwargs)
    extra = dict(kwargs)
    shown_type = extra.pop("model_type", model_type)  # an instance attribute in transformers
    aliases = ALIASES.get(model_type, {})
    for alias, name in aliases.items():
        if alias in extra:
            extra[name] = extra.pop(alias)
    defaults = TEXT_DEFAULTS.get(model_type) or VISION_DEFAULTS[model_type]
    fields = _declared(defaults, extra)
    _FAMILY_RULES.get(model_type, _no_rules)(fields, extra)
    _dtype(fields, extra)
    if model_type == "gemma3_text":
        _gemma3_rope(fields, extra)
    else:
        _convert_rope(fields, extra, model_type)
    _finish(fields, extra)
    fields.update({alias: fields[name] for alias, name in aliases.items()})
    return LightConfig(shown_type, fields)


def _build_composite(model_type: str, kwargs: dict[str, Any]) -> LightConfig:
    """A multimodal wrapper: its text and vision configs built by their own classes' rules
    (from their defaults where config.json has none), its own fields around them."""
    text_type, vision_type, own = COMPOSITES[model_type]
    extra = dict(kwargs)
    extra.pop("model_type", None)
    fields = _declared({"text_config": None, "vision_config": None, **own}, extra)
    vision = fields["vision_config"]
    if isinstance(vision, dict) and vision.get("model_type") == model_type:
        vision["model_type"] = vision_type
    fields["vision_config"] = build_config(vision_type, dict(vision or {}))
    fields["text_config"] = build_config(text_type, dict(fields["text_config"] or {}))
    _dtype(fields, extra)
    _finish(fields, extra)
    return LightConfig(model_type, fields)


def _declared(defaults: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A class's declared fields (and PreTrainedConfig's): from `extra`, which loses them, or
    their defaults."""
    fields = {}
    for name, default in {**BASE_DEFAULTS, **defaults}.items():
        fields[name] = extra.pop(name) if name in extra else _copy(default)
    return fields


def _dtype(fields: dict, extra: dict) -> None:
    torch_dtype = extra.pop("torch_dtype", None)
    if torch_dtype is not None and fields["dtype"] is None:
        fields["dtype"] = torch_dtype


def _finish(fields: dict, extra: dict) -> None:
    """config.json's other keys become attributes, as transformers sets them; older layer-type
    names get their current ones."""
    fields.update({key: value for key, value in extra.items() if key not in DROPPED})
    for key in ("layer_types", "mtp_layer_types"):
        if fields.get(key) is not None:
            fields[key] = [LEGACY_LAYER_TYPES.get(kind, kind) for kind in fields[key]]


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


def _convert_rope(fields: dict, extra: dict, model_type: str) -> None:
    """`rope_parameters` from config.json's newer dict or its older `rope_theta` /
    `rope_scaling` / `partial_rotary_factor` keys (PreTrainedConfig's rules)."""
    rope_scaling = extra.pop("rope_scaling", None)
    params = rope_scaling or fields["rope_parameters"] or {}
    theta = extra.pop("rope_theta", DEFAULT_ROPE_THETA.get(model_type, 10_000.0))
    partial = extra.pop("partial_rotary_factor", None)
    nested = _nested_keys(fields, params)
    for entry in [params[key] for key in nested] or [params]:
        if entry is None:
            continue
        entry.setdefault("rope_theta", theta)
        if partial is not None:
            entry.setdefault("partial_rotary_factor", partial)
    fields["rope_parameters"] = params
    _standardize_rope(fields, "axial" if model_type in VISION_DEFAULTS else "default")


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


def _standardize_rope(fields: dict, default_type: str = "default") -> None:
    """Each rotary dict gets its `rope_type` (an older `type` key names it; a vision tower's
    "default" is "axial") and, for the types that scale from a pretraining length,
    `original_max_position_embeddings`."""
    params = fields["rope_parameters"] or {}
    if not params:
        return
    nested = _nested_keys(fields, params)
    entries = [params[key] for key in nested if params[key] is not None] if nested else [params]
    for entry in entries:
        entry.setdefault("rope_type", entry.get("type", "default"))
        entry.setdefault("rope_theta", None)
        if entry["rope_type"] == "default":
            entry["rope_type"] = default_type
        if entry["rope_type"] in ORIGINAL_LENGTH_ROPE_TYPES:
            entry.setdefault("original_max_position_embeddings", fields["max_position_embeddings"])
    fields["rope_parameters"] = params
