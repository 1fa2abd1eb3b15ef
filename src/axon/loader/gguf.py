"""GGUF checkpoints (memory-mapped with `gguf.GGUFReader`): config from metadata, and
`(hf_name, tensor)` pairs under the HF names the models use.

Quantized matrices (and F16 / BF16 ones) come out as `QuantizedTensor`s, which the layers keep in
that form; F32 tensors and every 1-D tensor come out as float32 tensors. llama.cpp's converter
changes two things that are undone here: for the `llama` architecture it permutes the rows of
q/k for its interleaved RoPE (we use the neox layout), and for Gemma it stores RMSNorm weights as
`w + 1` (our Gemma norms compute `(1 + w)`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from axon.layers.quantized import QuantizedTensor

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_F32_TYPES = (GGMLQuantizationType.F32,)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma3 has a norm on either side of attention and MLP.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


@functools.lru_cache(maxsize=1)
def open_gguf(path: str) -> GGUFReader:
    """The reader of `path`, kept for the next call: parsing the metadata of a 262k-token vocab
    takes gguf-py seconds, and a load reads the config and then the weights. The weights'
    iterator drops it, so the file's pages are no longer mapped once the model is loaded."""
    return GGUFReader(path, "r")


def iterate_gguf_file(path: str) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """`iterate_gguf` of the file at `path`; forgets the cached reader when done."""
    try:
        yield from iterate_gguf(open_gguf(str(path)))
    finally:
        open_gguf.cache_clear()
        release_freed_memory()


def release_freed_memory() -> None:
    """Hand the heap that parsing freed back to the OS. gguf-py's reader makes millions of small
    numpy objects for a large vocab (about 700 MiB for gemma-3's 262k tokens); once freed, glibc
    keeps most of that heap resident unless asked to trim it."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(libc_name).malloc_trim(0)


def field_value(reader: GGUFReader, key: str, default=None):
    """A metadata value (scalar, string or list), or `default` when the key is absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader: GGUFReader) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in _MODEL_TYPES:
        supported = ", ".join(sorted(_MODEL_TYPES))
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")
    return arch


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The HF name of a GGUF tensor, or None for one the models do not use."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _LAYER_RE.match(gguf_name)
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    if match is None or match.group(2) not in names:
        return None
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{names[part]}.{suffix}"


def _unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` on the rows (output features) of q or k."""
    shape = rows.shape
    per_head = shape[0] // num_heads
    return rows.reshape(num_heads, per_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _row_fix(reader: GGUFReader, arch: str, name: str):
    """The row permutation's head count for llama q/k tensors, else None."""
    if arch != "llama":
        return None
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return int(field_value(reader, "llama.attention.head_count"))
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        heads = field_value(reader, "llama.attention.head_count")
        return int(field_value(reader, "llama.attention.head_count_kv", heads))
    return None


def _to_torch(tensor, arch: str, heads: int | None):
    """One reader tensor -> a float32 tensor or a QuantizedTensor (HF shape, rows unpermuted)."""
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest-first
    data = tensor.data
    if heads is not None:
        data = _unpermute_rows(data, heads)
    if tensor.tensor_type in _F32_TYPES or len(shape) == 1:
        if tensor.tensor_type not in _F32_TYPES:
            qt = QuantizedTensor(tensor.tensor_type, _raw(data, 1), (1, shape[0]))
            return qt.dequantize().reshape(shape)
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
    rows = shape[0]
    return QuantizedTensor(int(tensor.tensor_type), _raw(data, rows), shape)


def _raw(data: np.ndarray, rows: int) -> torch.Tensor:
    """Copy the mmapped bytes into a uint8 tensor [rows, row_bytes]."""
    return torch.from_numpy(np.array(data).view(np.uint8).reshape(rows, -1).copy())


def iterate_gguf(reader: GGUFReader) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (hf_name, tensor) for every tensor of the text model. Raises ValueError naming a
    tensor that maps to no HF name."""
    arch = architecture(reader)
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no HF counterpart for {arch}")
        value = _to_torch(tensor, arch, _row_fix(reader, arch, tensor.name))
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value - 1.0  # stored as w + 1 (see the module docstring)
        yield name, value
