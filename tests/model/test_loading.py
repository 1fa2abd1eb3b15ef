"""Checkpoint loading: sharded safetensors, and the errors a bad checkpoint must give."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from axon import LLM

from .tiny_models import (
    ARCHS,
    engine_kwargs,
    get_tiny_model,
    random_prompts,
    write_checkpoint,
)

SHARD_SIZE = "150KB"  # the tiny models are 0.5-1 MB: several shards each
PROMPT_LENGTHS = (5, 17, 33)


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_checkpoint_loads_identically(arch, tiny_model_root, tmp_path):
    tiny = get_tiny_model(arch, tiny_model_root)
    sharded_path = write_checkpoint(tiny.hf_model, tmp_path / arch, max_shard_size=SHARD_SIZE)
    index = json.loads((sharded_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "test setup: checkpoint is not sharded"
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)

    single = LLM(**engine_kwargs(tiny)).compute_logits(prompts)
    sharded_kwargs = engine_kwargs(tiny)
    sharded_kwargs["model"] = str(sharded_path)
    sharded = LLM(**sharded_kwargs).compute_logits(prompts)

    for prompt, from_single, from_shards in zip(prompts, single, sharded):
        assert torch.equal(from_single, from_shards), f"{arch}: sharded load differs"
        diff = float((from_shards - tiny.last_logits(prompt)).abs().max())
        assert diff <= 1e-4, f"{arch}: sharded logits vs transformers: {diff:.3e}"


def _copy_checkpoint(tiny_model_root, tmp_path, arch="llama"):
    source = get_tiny_model(arch, tiny_model_root)
    return source, shutil.copytree(source.path, tmp_path / f"{arch}-copy")


def _rewrite_weights(path, edit) -> None:
    weights_file = path / "model.safetensors"
    tensors = load_file(weights_file)
    edit(tensors)
    save_file(tensors, weights_file, metadata={"format": "pt"})


def test_unsupported_model_type_lists_supported_types(tiny_model_root, tmp_path):
    source, path = _copy_checkpoint(tiny_model_root, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))
    kwargs = engine_kwargs(source)
    kwargs["model"] = str(path)

    with pytest.raises(ValueError) as excinfo:
        LLM(**kwargs)

    message = str(excinfo.value)
    assert "mamba" in message
    missing = [arch for arch in ARCHS if arch not in message]
    assert not missing, f"supported types {missing} not listed in: {message}"


def test_missing_weights_are_named(tiny_model_root, tmp_path):
    source, path = _copy_checkpoint(tiny_model_root, tmp_path)
    dropped = ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"]

    def drop(tensors):
        for name in dropped:
            del tensors[name]

    _rewrite_weights(path, drop)
    kwargs = engine_kwargs(source)
    kwargs["model"] = str(path)

    with pytest.raises(ValueError) as excinfo:
        LLM(**kwargs)

    for name in dropped:
        assert re.search(re.escape(name), str(excinfo.value)), f"{name} not named: {excinfo.value}"


def test_unexpected_weights_are_named(tiny_model_root, tmp_path):
    source, path = _copy_checkpoint(tiny_model_root, tmp_path)
    extra = "model.layers.0.mlp.extra_proj.weight"

    def add(tensors):
        tensors[extra] = torch.zeros(4, 4)

    _rewrite_weights(path, add)
    kwargs = engine_kwargs(source)
    kwargs["model"] = str(path)

    with pytest.raises(ValueError, match=re.escape(extra)):
        LLM(**kwargs)
