"""GGUF checkpoints (memory-mapped by gguf-py's reader; gguf_reader.py): config from metadata,
and `(hf_name, tensor)` pairs under the names the models use.

Quantized matrices (and F16 / BF16 ones) come out as `QuantizedTensor`s, which the layers keep in
that form; F32 tensors and every 1-D tensor come out as float32 tensors. llama.cpp's converter
changes some tensors, and what it changes is undone here: for the `llama` architecture it permutes
the rows of q/k for its interleaved RoPE (we use the neox layout); for Gemma and Qwen3.5 it stores
RMSNorm weights as `w + 1` (our norms compute `(1 + w)`; Qwen3.5's gated GDN norm is left as is);
for Qwen3.5 (`qwen35`) it squeezes the conv1d weight to [C, K]. Two Qwen3.5 changes are kept
instead, because the GDN layer runs on them directly: `ssm_a` holds `A = -exp(A_log)` (the
layer's `A`), and the value heads are in "tiled" order, which the config announces
(`linear_value_head_order`) so the layer expands its key heads to match. Multi-token-prediction
blocks (`nextn`) are skipped.
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
from axon.loader.gguf_reader import BulkGGUFReader

_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "qwen35": "qwen3_5_text",
}
_UNIT_OFFSET_NORM_ARCHS = ("gemma3", "qwen35")
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
# Qwen3.5: gated full attention (q_proj holds query and gate) and the Gated DeltaNet mixer.
_QWEN35_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_LAYER_NAMES_BY_ARCH = {"gemma3": _GEMMA3_LAYER_NAMES, "qwen35": _QWEN35_LAYER_NAMES}
# Layer tensors that are bare parameters, not a module's weight or bias.
_LAYER_PARAMS_BY_ARCH = {
    "qwen35": {"ssm_a": "linear_attn.A", "ssm_dt.bias": "linear_attn.dt_bias"},
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)$")


@functools.lru_cache(maxsize=1)
def open_gguf(path: str) -> GGUFReader:
    """The reader of `path`, kept for the next call: parsing the metadata of a 248k-token vocab
    takes a second even in bulk, and a load reads the config and then the weights. The weights'
    iterator drops it, so the file's pages are no longer mapped once the model is loaded."""
    return BulkGGUFReader(path, "r")


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
    if match is None:
        return None
    layer, rest = match.groups()
    params = _LAYER_PARAMS_BY_ARCH.get(arch, {})
    if rest in params:
        return f"model.layers.{layer}.{params[rest]}"
    part, _, suffix = rest.rpartition(".")
    names = _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES)
    if suffix not in ("weight", "bias") or part not in names:
        return None
    return f"model.layers.{layer}.{names[part]}.{suffix}"


def num_text_layers(reader: GGUFReader, arch: str) -> int:
    """Decoder layers of the text model: `block_count` less the multi-token-prediction blocks
    that llama.cpp appends (Qwen3.5's `nextn` layers)."""
    blocks = int(field_value(reader, f"{arch}.block_count"))
    return blocks - int(field_value(reader, f"{arch}.nextn_predict_layers", 0))


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
    num_layers = num_text_layers(reader, arch)
    for tensor in reader.tensors:
        if _layer_index(tensor.name) >= num_layers:
            continue  # a multi-token-prediction block
        name = hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no HF counterpart for {arch}")
        value = _to_torch(tensor, arch, _row_fix(reader, arch, tensor.name))
        yield name, _undo_converter(name, value, arch)


def _layer_index(gguf_name: str) -> int:
    """N of a `blk.N.*` tensor; -1 for a global one."""
    match = _LAYER_RE.match(gguf_name)
    return -1 if match is None else int(match.group(1))


def _undo_converter(name: str, value, arch: str):
    """The tensor as the model holds it (see the module docstring)."""
    gated_norm = name.endswith("linear_attn.norm.weight")  # the GDN's own norm: stored as is
    if arch in _UNIT_OFFSET_NORM_ARCHS and name.endswith("norm.weight") and not gated_norm:
        return value - 1.0  # stored as w + 1
    if arch == "qwen35" and name.endswith("conv1d.weight"):
        if isinstance(value, QuantizedTensor):  # a depthwise conv, never a matmul
            value = value.dequantize()
        return value.unsqueeze(1)  # stored squeezed: [C, K] -> [C, 1, K]
    return value
