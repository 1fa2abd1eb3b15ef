"""Tiny random Qwen3.5 checkpoints (text-only and multimodal) written by transformers.

Four layers on the real schedule (linear, linear, linear, full), GQA in the full-attention
layer, more GDN value heads than key heads (the repeat), partial rotary, and norms, `dt_bias`
and `A_log` perturbed so that `(1 + w)` vs `w` or a wrong decay cannot pass unnoticed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

from tiny_configs import QWEN3_5_TEXT, QWEN3_5_VISION

from .tiny_models import TinyModel, build_tokenizer, engine_kwargs, get_tiny_model

QWEN3_5_ARCHS = ("qwen3_5_text", "qwen3_5")
SEED = 4321


def build_qwen3_5(arch: str, seed: int = SEED, **text_overrides):
    """An fp32 eval model; the multimodal one carries the text one's weights (plus a random
    vision tower), so both archs share the greedy references' logit margins. `text_overrides`
    replace entries of the text config (text arch only)."""
    torch.manual_seed(seed)
    text_config = {**QWEN3_5_TEXT, "tie_word_embeddings": False, **text_overrides}
    config = Qwen3_5TextConfig(**text_config)
    config._attn_implementation = "eager"
    text = Qwen3_5ForCausalLM(config).to(torch.float32).eval()
    _perturb(text, torch.Generator().manual_seed(seed + 1))
    if arch == "qwen3_5_text":
        return text
    if arch != "qwen3_5" or text_overrides:
        raise ValueError(f"unknown qwen3_5 test arch {arch!r} (or overrides for it)")
    config = Qwen3_5Config(
        text_config=QWEN3_5_TEXT, vision_config=QWEN3_5_VISION, tie_word_embeddings=False
    )
    config._attn_implementation = "eager"
    model = Qwen3_5ForConditionalGeneration(config).to(torch.float32).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    return model


@torch.no_grad()
def _perturb(model, generator: torch.Generator) -> None:
    for name, param in model.named_parameters():
        if name.endswith(("norm.weight", "dt_bias")):
            param.add_(torch.randn(param.shape, generator=generator) * 0.2)
        elif name.endswith("A_log"):
            param.copy_(torch.rand(param.shape, generator=generator) * 2 - 1.5)


def swap_value_heads(
    tensor: torch.Tensor, dim: int, outer: int, inner: int, head_dim: int
) -> torch.Tensor:
    """Reorder GDN value heads along `dim`, read as [outer, inner, head_dim], to [inner, outer,
    head_dim]. HF's grouped order is [key heads, value heads per key head], llama.cpp's tiled one
    [value heads per key head, key heads]: grouped -> tiled is `outer=Hk, inner=Hv/Hk`, tiled ->
    grouped `outer=Hv/Hk, inner=Hk`."""
    shape = tensor.shape
    split = (*shape[:dim], outer, inner, head_dim, *shape[dim + 1 :])
    return tensor.reshape(split).transpose(dim, dim + 1).reshape(shape)


def write_qwen3_5(model, path: Path) -> Path:
    """Save `model` and a tokenizer; a multimodal checkpoint also gets an `mtp.*` tensor, as
    released Qwen3.5 checkpoints have, which a text load must skip."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    if model.config.model_type == "qwen3_5":
        file = path / "model.safetensors"
        tensors = load_file(str(file))
        tensors["mtp.fc.weight"] = torch.zeros(4, 4)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return path


_CACHE: dict[tuple[str, Path], TinyModel] = {}


def get_qwen3_5(arch: str, root: Path) -> TinyModel:
    key = (arch, root)
    if key not in _CACHE:
        model = build_qwen3_5(arch)
        _CACHE[key] = TinyModel(arch=arch, path=write_qwen3_5(model, root / arch), hf_model=model)
    return _CACHE[key]


def cache_bytes(tiny: TinyModel, blocks: int, block_size: int, rows: int) -> int:
    """Cache budget for `blocks` KV blocks plus `rows` state rows (slots + snapshots), fp32."""
    config = tiny.config.get_text_config()
    num_full = config.layer_types.count("full_attention")
    kv_per_token = 2 * num_full * config.num_key_value_heads * config.head_dim * 4
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    conv_dim += config.linear_num_value_heads * config.linear_value_head_dim
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim
    recurrent *= config.linear_value_head_dim
    per_slot = (conv_dim * (config.linear_conv_kernel_dim - 1) + recurrent) * 4
    per_slot *= config.layer_types.count("linear_attention")
    return blocks * block_size * kv_per_token + rows * per_slot


def qwen3_5_engine_kwargs(
    tiny: TinyModel, *, block_size: int = 16, kv_cache_blocks: int = 256, **overrides
) -> dict:
    max_num_seqs = overrides.get("max_num_seqs", 8)
    snapshots = overrides.get("num_state_snapshots", max_num_seqs)
    kwargs = dict(
        model=str(tiny.path),
        dtype="float32",
        block_size=block_size,
        max_model_len=512,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=True,
        state_snapshot_stride=1,
        kv_cache_memory=cache_bytes(tiny, kv_cache_blocks, block_size, max_num_seqs + snapshots),
    )
    kwargs.update(overrides)
    return kwargs


def get_any_tiny(arch: str, root: Path) -> TinyModel:
    """A tiny model of any architecture: Qwen3.5's from get_qwen3_5, the others' from
    get_tiny_model."""
    return get_qwen3_5(arch, root) if arch.startswith("qwen3_5") else get_tiny_model(arch, root)


def any_engine_kwargs(tiny: TinyModel, **overrides) -> dict:
    """qwen3_5_engine_kwargs for a hybrid model, engine_kwargs for the others; a hybrid
    model's `num_state_snapshots` is taken from `overrides` only for it."""
    if tiny.arch.startswith("qwen3_5"):
        return qwen3_5_engine_kwargs(tiny, **overrides)
    overrides.pop("num_state_snapshots", None)
    return engine_kwargs(tiny, **overrides)
