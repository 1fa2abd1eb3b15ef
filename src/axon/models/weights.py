"""Route checkpoint (hf_name, tensor) pairs to model parameters through their weight loaders."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from axon.layers.linear import default_weight_loader
from axon.layers.quantized import QuantizedTensor

logger = logging.getLogger(__name__)

# Checkpoint entries that carry no weights of the text model.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every checkpoint tensor into `model`. Raises ValueError naming missing or
    unexpected weights.

    A model may declare `packed_modules_mapping` (checkpoint module or parameter name ->
    (its parameter's name, shard id): `q_proj` -> (`qkv_proj`, "q"), or `A_log` -> (`A`, "A_log")
    for a parameter held in another form), `checkpoint_prefixes` (checkpoint prefix -> its own,
    e.g. a multimodal checkpoint's `model.language_model.` -> `model.`),
    `ignored_checkpoint_prefixes` (weights it does not hold, e.g. a vision tower),
    `optional_weights` (parameters a checkpoint may leave out) and `tie_word_embeddings` (else
    read from its config). A base-model checkpoint's bare names (`layers.0...`) load into the
    causal LM's `model.` parameters. A parameter is complete when loaded whole
    (under its own name) or from every one of its shards.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    routes = sorted(packed.items(), key=lambda item: -len(item[0]))
    prefixes = getattr(model, "checkpoint_prefixes", {})
    ignored = tuple(getattr(model, "ignored_checkpoint_prefixes", ()))
    tied = getattr(model, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: dict[str, set] = {}  # parameter name -> shard ids loaded (None: the whole)
    unexpected: list[str] = []
    for name, tensor in weights:
        if ignored and name.startswith(ignored):
            continue
        name = _rename(name, prefixes)
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target, shard_id = _route(name, routes)
        param = params.get(target)
        if param is None and f"model.{target}" in params:
            # A bare base-model checkpoint (`layers.0...`, as Qwen3-Embedding ships): its names
            # are the causal LM's `model.` ones.
            target = f"model.{target}"
            param = params[target]
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
        loaded.setdefault(target, set()).add(shard_id)
    optional = set(getattr(model, "optional_weights", ()))
    _check_complete(params, packed, loaded, unexpected, tied, optional)
    sizes = parameter_bytes(model)
    logger.info(
        "weights: %.1f MiB, %.1f MiB active per token",
        sizes["total"] / 2**20,
        sizes["active"] / 2**20,
    )


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """{"total": bytes of the model's weights (parameters and buffers, shared memory counted
    once), "active": the bytes one token reads, i.e. the total less the routed experts it does
    not choose (a module's `inactive_bytes()`)}."""
    seen, total = set(), 0
    for tensor in (*model.parameters(), *model.buffers()):
        key = (tensor.data_ptr(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    inactive = sum(m.inactive_bytes() for m in model.modules() if hasattr(m, "inactive_bytes"))
    return {"total": total, "active": total - inactive}


def _rename(name: str, prefixes: dict[str, str]) -> str:
    for checkpoint_prefix, model_prefix in prefixes.items():
        if name.startswith(checkpoint_prefix):
            return model_prefix + name[len(checkpoint_prefix) :]
    return name


def _route(name: str, routes: list) -> tuple[str, object]:
    """(parameter name, shard id) of a checkpoint name; shard id None when unpacked. `routes`
    are the packed items, most specific (longest) first: `experts.3.gate_proj.weight` wins over
    `gate_proj`."""
    dotted = name + "."  # a packed name may be a module (`.q_proj.`) or a parameter (`.A_log`)
    for checkpoint_name, (fused_name, shard_id) in routes:
        part = f".{checkpoint_name}."
        if part in dotted:
            return dotted.replace(part, f".{fused_name}.")[:-1], shard_id
    return name, None


def _shards(name: str, packed: dict) -> list[tuple[str, object]]:
    """(checkpoint name, shard id) of each packed part of parameter `name`; [] when unpacked.
    Only the most specific fused name counts: `experts.gate_up_proj`, not `gate_up_proj`."""
    dotted = name + "."
    matches = [(c, f, s) for c, (f, s) in packed.items() if f".{f}." in dotted]
    longest = max((len(fused) for _, fused, _ in matches), default=0)
    return [
        (dotted.replace(f".{fused}.", f".{checkpoint}.")[:-1], shard_id)
        for checkpoint, fused, shard_id in matches
        if len(fused) == longest
    ]


def _check_complete(params, packed, loaded, unexpected, tied, optional=frozenset()) -> None:
    """Raises ValueError naming unexpected or missing weights; `optional` parameters (an
    embedder's unused LM head) may be missing."""
    if unexpected:
        raise ValueError(f"unexpected weights in checkpoint: {sorted(unexpected)[:20]}")
    missing = []
    for name in params:
        got = loaded.get(name, set())
        if None in got or (tied and name == "lm_head.weight") or (name in optional and not got):
            continue
        shards = _shards(name, packed)
        if not shards and not got:
            missing.append(name)
        missing += [checkpoint for checkpoint, shard_id in shards if shard_id not in got]
    if missing:
        why = ""
        if any(name.startswith("mtp.") for name in missing):  # only speculative_config loads them
            why = "; speculative_config method mtp needs the checkpoint's MTP block (mtp.*)"
        raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:20]}{why}")
