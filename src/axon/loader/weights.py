"""Route checkpoint (hf_name, tensor) pairs to model parameters through their weight loaders."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from axon.layers.linear import default_weight_loader
from axon.layers.quantized import QuantizedTensor

# Checkpoint entries that carry no weights of the text model.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every checkpoint tensor into `model`. Raises ValueError naming missing or
    unexpected weights.

    A model may declare `checkpoint_prefixes` (checkpoint prefix -> its own, e.g. a multimodal
    checkpoint's `model.language_model.` -> `model.`), `ignored_checkpoint_prefixes` (weights it
    does not hold, e.g. a vision tower) and `tie_word_embeddings` (else read from its config).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    prefixes = getattr(model, "checkpoint_prefixes", {})
    ignored = tuple(getattr(model, "ignored_checkpoint_prefixes", ()))
    tied = getattr(model, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if ignored and name.startswith(ignored):
            continue
        name = _rename(name, prefixes)
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target, shard_id = _route(name, packed)
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", None)
        if not isinstance(tensor, QuantizedTensor):  # those stay in their GGML form
            tensor = tensor.to(param.dtype)
        if shard_id is None:
            (loader or default_weight_loader)(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add(name)
    _check_complete(model, params, packed, loaded, unexpected, tied)


def _rename(name: str, prefixes: dict[str, str]) -> str:
    for checkpoint_prefix, model_prefix in prefixes.items():
        if name.startswith(checkpoint_prefix):
            return model_prefix + name[len(checkpoint_prefix) :]
    return name


def _route(name: str, packed: dict) -> tuple[str, object]:
    for checkpoint_name, (fused_name, shard_id) in packed.items():
        part = f".{checkpoint_name}."
        if part in name:
            return name.replace(part, f".{fused_name}."), shard_id
    return name, None


def _expected_names(params: dict, packed: dict) -> set[str]:
    """Checkpoint names the model's parameters account for (fused ones expanded)."""
    expected = set()
    for name in params:
        parts = [(c, f) for c, (f, _) in packed.items() if f".{f}." in name]
        if not parts:
            expected.add(name)
        for checkpoint_name, fused_name in parts:
            expected.add(name.replace(f".{fused_name}.", f".{checkpoint_name}."))
    return expected


def _check_complete(model, params, packed, loaded, unexpected, tied) -> None:
    if unexpected:
        raise ValueError(f"unexpected weights in checkpoint: {sorted(unexpected)[:20]}")
    expected = _expected_names(params, packed)
    if tied:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"weights missing from checkpoint: {missing[:20]}")
