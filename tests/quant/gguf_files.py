"""GGUF files written from tiny random transformers models, the way llama.cpp's converter would
write them (its tensor names, q/k row permutation for `llama`, `w + 1` Gemma norms), plus the
oracle: the same transformers model running the dequantized weights."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from model.tiny_models import (
    _MODEL_CLASSES,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SEED,
    VOCAB_SIZE,
    _perturb,
    _spread_gemma3,
    make_config,
)
from quant.kquants import K_TYPES, quantize_k

GGUF_ARCH = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}
# Every in-features dimension a multiple of 256 (K-quant super-blocks); GGUF cannot express a
# Gemma3 query_pre_attn_scalar other than head_dim.
_SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4)
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def build_gguf_model(arch: str):
    """A tiny fp32 transformers model for `arch` sized for every GGML block type."""
    torch.manual_seed(SEED)
    config = make_config(arch)
    for key, value in _SIZES.items():
        setattr(config, key, value)
    if arch == "gemma3_text":
        config.query_pre_attn_scalar = config.head_dim
    config._attn_implementation = "eager"
    model = _MODEL_CLASSES[arch](config).to(torch.float32).eval()
    _perturb(model, torch.Generator().manual_seed(SEED + 1))
    if arch == "gemma3_text":
        _spread_gemma3(model)
    return model


def quantize(weight: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 [rows, cols] -> what GGUF stores (float array or raw uint8 blocks)."""
    if qtype in K_TYPES:
        return quantize_k(weight, qtype)
    return gguf.quants.quantize(weight, qtype)


def dequantize(stored: np.ndarray, qtype: Q, shape) -> np.ndarray:
    if qtype == Q.F32:
        return stored.astype(np.float32)
    return gguf.quants.dequantize(stored, qtype).reshape(shape).astype(np.float32)


def _permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (rows of q / k, for its interleaved RoPE)."""
    shape = rows.shape
    return (
        rows.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def _write_metadata(writer: gguf.GGUFWriter, config, arch: str) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim or config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    if arch == "gemma3_text":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    _write_vocab(writer)


def _write_vocab(writer: gguf.GGUFWriter) -> None:
    specials = ["<pad>", "<eos>", "<bos>"]
    tokens = specials + [f"\u2581w{i}" for i in range(len(specials), VOCAB_SIZE)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(specials) + [-float(i) for i in range(VOCAB_SIZE - 3)])
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_token_types([control] * len(specials) + [normal] * (VOCAB_SIZE - len(specials)))
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def _stored_tensors(model, arch: str, qtype: Q):
    """Yield (gguf_name, stored array, ggml type, HF name, dequantized HF-order float32)."""
    config = model.config
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[GGUF_ARCH[arch].upper()], config.num_hidden_layers)
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        data = param.detach().float().numpy()
        if data.ndim == 1:
            stored, kind = data + (1.0 if arch == "gemma3_text" and "norm" in base else 0.0), Q.F32
            oracle = data
        else:
            stored, kind = quantize(data, qtype), qtype
            oracle = dequantize(stored, qtype, data.shape)
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if "q_proj" in base else config.num_key_value_heads
            stored = _permute(stored, heads)
        yield f"{names.get_name(base)}.{suffix}", stored, kind, name, oracle


def write_gguf(model, arch: str, qtype: Q, path: Path):
    """Write `model` as a GGUF file with its matrices in `qtype`; return (path, oracle model)."""
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    _write_metadata(writer, model.config, arch)
    oracle_state = {}
    for gguf_name, stored, kind, hf_name, oracle in _stored_tensors(model, arch, qtype):
        raw_dtype = None if kind in (Q.F32, Q.F16) else kind
        writer.add_tensor(gguf_name, np.ascontiguousarray(stored), raw_dtype=raw_dtype)
        oracle_state[hf_name] = torch.from_numpy(np.array(oracle))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    oracle = copy.deepcopy(model)
    oracle.load_state_dict(oracle_state, strict=False)
    return path, oracle


def qwen3_gguf(directory: Path, qtype: Q) -> str:
    """A tiny Qwen3 GGUF file of `qtype` weights in `directory`, written once."""
    path = Path(directory) / f"qwen3-{qtype.name}.gguf"
    if not path.exists():
        write_gguf(build_gguf_model("qwen3"), "qwen3", qtype, path)
    return str(path)
