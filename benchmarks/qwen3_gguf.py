"""The random Qwen3 model of benchmarks/offline_throughput.py as an F16 GGUF file, written with
gguf-py the way llama.cpp's converter names things, with a placeholder vocabulary (the benchmarks
feed token ids). llama.cpp's quantizer turns it into Q8_0 / Q4_K_M (gguf_vs_llamacpp.py)."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np


def _metadata(writer: gguf.GGUFWriter, config) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = config.vocab_size
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, vocab)])
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, vocab)])
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab - 3)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_qwen3_f16(target: Path) -> Path:
    """Write (once) the offline-throughput Qwen3 model as an F16 GGUF at `target`."""
    if target.exists():
        return target
    from safetensors.numpy import load_file

    from offline_throughput import DEFAULT_MODEL_DIR, ensure_model

    model_dir = ensure_model(DEFAULT_MODEL_DIR, seed=0)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3, config.num_hidden_layers)
    tmp = target.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "qwen3")
    _metadata(writer, config)
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, value in load_file(path).items():
            base, suffix = name.rsplit(".", 1)
            data = value.astype(np.float16 if value.ndim == 2 else np.float32)
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, target)
    return target
