"""Config readers shared by the model files."""

from __future__ import annotations


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_params_of(config, layer_type: str | None = None) -> dict:
    """The HF rope parameters dict ({"rope_type", "rope_theta", ...}) for one layer type.

    Reads transformers 5's `rope_parameters` (per layer type for Gemma3) and falls back to the
    older `rope_theta` + `rope_scaling` attributes.
    """
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if not params or "rope_theta" not in params:
        legacy = dict(getattr(config, "rope_scaling", None) or {})
        legacy.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        params = {**legacy, **(params or {})}
    return dict(params)


def layer_type_of(config, layer_idx: int) -> str:
    """ "sliding_attention" or "full_attention" (HF's `layer_types`; full when absent)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and getattr(config, "sliding_window", None):
        return layer_types[layer_idx]
    return "full_attention"
