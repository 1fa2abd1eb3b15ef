"""GGUF checkpoints (memory-mapped by gguf-py's reader; gguf_reader.py): config from metadata,
and `(hf_name, tensor)` pairs under the names the models use.

Quantized matrices (and F16 / BF16 ones) come out as `QuantizedTensor`s, which the layers keep in
that form; F32 tensors and every 1-D tensor come out as float32 tensors. llama.cpp's converter
changes some tensors, and what it changes is undone here: for the `llama` architecture it permutes
the rows of q/k for its interleaved RoPE (we use the neox layout); for Gemma and Qwen3.5 it stores
RMSNorm weights as `w + 1` (our norms compute `(1 + w)`; Qwen3.5's gated GDN norm is left as is);
for Qwen3.5 (`qwen35`, and `qwen35moe` likewise) it squeezes the conv1d weight to [C, K]. Two
Qwen3.5 changes are kept instead, because the GDN layer runs on them directly: `ssm_a` holds
`A = -exp(A_log)` (the layer's `A`), and the value heads are in "tiled" order, which the config
announces (`linear_value_head_order`) so the layer expands its key heads to match.
Multi-token-prediction blocks (`nextn`, the blocks past the text model's) are skipped, or with
`with_mtp` yielded as Qwen3.5's `mtp.*` (`blk.L.nextn.eh_proj` is `mtp.fc`, `enorm` / `hnorm`
the pre-fc norms, `shared_head_norm` `mtp.norm`, block L's layer tensors `mtp.layers.0.*`; the
shared embedding and head are the target's). Mixture-of-experts files (`qwen3moe`,
`qwen35moe`) stack a layer's experts in 3-D `ffn_{gate,up,down}_exps` tensors, yielded one
expert at a time (quantized ones as views of the one copy of their blocks).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import math
import re
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from axon.layers.quantized import QuantizedTensor
from axon.loader.gguf_reader import BulkGGUFReader

_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "qwen35": "qwen3_5_text",
    "qwen3moe": "qwen3_moe",
    "qwen35moe": "qwen3_5_moe_text",
}
_UNIT_OFFSET_NORM_ARCHS = ("gemma3", "qwen35", "qwen35moe")
_QWEN35_ARCHS = ("qwen35", "qwen35moe")
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
# Mixture of experts: the router, and every expert of a layer stacked in one 3-D tensor, which
# `iterate_gguf` yields one expert at a time under the HF per-expert names.
_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Qwen3.5-MoE's shared expert and its sigmoid gate (`ffn_gate_inp_shexp`, [1, H]).
_SHARED_EXPERT_NAMES = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_LAYER_NAMES_BY_ARCH = {
    "gemma3": _GEMMA3_LAYER_NAMES,
    "qwen35": _QWEN35_LAYER_NAMES,
    "qwen3moe": {**_LAYER_NAMES, **_EXPERT_NAMES},
    "qwen35moe": {**_QWEN35_LAYER_NAMES, **_EXPERT_NAMES, **_SHARED_EXPERT_NAMES},
}
# Layer tensors that are bare parameters, not a module's weight or bias.
_QWEN35_LAYER_PARAMS = {"ssm_a": "linear_attn.A", "ssm_dt.bias": "linear_attn.dt_bias"}
_LAYER_PARAMS_BY_ARCH = {"qwen35": _QWEN35_LAYER_PARAMS, "qwen35moe": _QWEN35_LAYER_PARAMS}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)$")
# Qwen3.5's MTP block as llama.cpp's converter names it (its own embedding and head, which
# Qwen3.5 shares with the target, are not written).
_NEXTN_NAMES = {
    "nextn.eh_proj": "fc",
    "nextn.enorm": "pre_fc_norm_embedding",
    "nextn.hnorm": "pre_fc_norm_hidden",
    "nextn.shared_head_norm": "norm",
}


@functools.lru_cache(maxsize=1)
def open_gguf(path: str) -> GGUFReader:
    """The reader of `path`, kept for the next call: parsing the metadata of a 248k-token vocab
    takes a second even in bulk, and a load reads the config and then the weights. The weights'
    iterator drops it (and with it the parsed metadata); the quantized weights it yielded keep
    the file mapped, as long as they live."""
    return BulkGGUFReader(path, "r")


def iterate_gguf_file(
    path: str, mapped: bool = True, with_mtp: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """`iterate_gguf` of the file at `path` (quantized blocks as views of the mapped file
    unless `mapped` is False, see `_raw`); forgets the cached reader when done."""
    try:
        yield from iterate_gguf(open_gguf(str(path)), mapped, with_mtp)
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


def mtp_name(gguf_name: str, arch: str, num_layers: int) -> str | None:
    """The HF (`mtp.*`) name of a tensor of the MTP block that follows the `num_layers` text
    layers, or None."""
    layer, rest = _LAYER_RE.match(gguf_name).groups()
    index = int(layer) - num_layers
    base, _, suffix = rest.rpartition(".")
    if base in _NEXTN_NAMES:
        return f"mtp.{_NEXTN_NAMES[base]}.{suffix}" if index == 0 else None
    name = hf_name(f"blk.{index}.{rest}", arch)
    prefix = f"model.layers.{index}."
    return None if name is None else f"mtp.layers.{index}.{name[len(prefix) :]}"


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


def _to_torch(tensor, arch: str, heads: int | None, mapped: bool = False):
    """One reader tensor -> a float32 tensor or a QuantizedTensor (HF shape, rows unpermuted);
    `mapped`: quantized bytes as a view of the file (see `_raw`)."""
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest-first
    data = tensor.data
    if heads is not None:
        data = _unpermute_rows(data, heads)
    if tensor.tensor_type in _F32_TYPES or len(shape) == 1:
        if tensor.tensor_type not in _F32_TYPES:
            qt = QuantizedTensor(tensor.tensor_type, _raw(data, 1), (1, shape[0]))
            return qt.dequantize().reshape(shape)
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
    rows = math.prod(shape[:-1])  # 3-D experts [E, N, K]: E * N rows of K
    raw = _raw(data, rows, mapped)
    return QuantizedTensor(int(tensor.tensor_type), raw, (rows, shape[-1]))


def _raw(data: np.ndarray, rows: int, mapped: bool = False) -> torch.Tensor:
    """The mmapped bytes as a uint8 tensor [rows, row_bytes]: a copy, or with `mapped` a view
    of the file. A view costs nothing at load (a copy is a pass over the whole file) and keeps
    the weights in the page cache, shared by every process that maps the file (an engine and its
    recovery); the C kernels read the blocks in place, and the tensor holds the numpy memmap, so
    the file stays mapped while it lives. A tensor-parallel rank narrows the view to its shard
    and copies only that: no rank reads, let alone dequantizes, a whole tensor it does not own.
    The view is read-only (a write faults): nothing writes to GGUF weights, which the layers keep
    as loaded."""
    array = np.asarray(data).view(np.uint8).reshape(rows, -1)
    if not mapped:
        return torch.from_numpy(array.copy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only map; nothing writes to it
        return torch.from_numpy(array)


def iterate_gguf(
    reader: GGUFReader, mapped: bool = False, with_mtp: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (hf_name, tensor) for every tensor of the text model (`mapped`: quantized ones
    as views of the file, see `_raw`), and with `with_mtp` its MTP block's. Raises ValueError
    naming a tensor that maps to no HF name."""
    arch = architecture(reader)
    num_layers = num_text_layers(reader, arch)
    for tensor in reader.tensors:
        if _layer_index(tensor.name) >= num_layers:  # a multi-token-prediction block
            if not with_mtp:
                continue
            name = mtp_name(tensor.name, arch, num_layers)
        else:
            name = hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no HF counterpart for {arch}")
        value = _to_torch(tensor, arch, _row_fix(reader, arch, tensor.name), mapped)
        if len(tensor.shape) == 3:
            yield from _per_expert(name, value, int(tensor.shape[2]))
        else:
            yield name, _undo_converter(name, value, arch)


def _per_expert(name: str, value, num_experts: int):
    """`<mlp>.experts.gate_proj.weight` stacked [E, N, K] -> (`<mlp>.experts.e.gate_proj.weight`,
    [N, K]) for each expert e; quantized slices are views of the one copy of the bytes."""
    mlp, proj = name.rsplit(".experts.", 1)
    for expert in range(num_experts):
        if isinstance(value, QuantizedTensor):
            rows = value.shape[0] // num_experts
            part = value.data[expert * rows : (expert + 1) * rows]
            part = QuantizedTensor(value.ggml_type, part, (rows, value.shape[1]))
        else:
            part = value[expert]
        yield f"{mlp}.experts.{expert}.{proj}", part


def _layer_index(gguf_name: str) -> int:
    """N of a `blk.N.*` tensor; -1 for a global one."""
    match = _LAYER_RE.match(gguf_name)
    return -1 if match is None else int(match.group(1))


def _undo_converter(name: str, value, arch: str):
    """The tensor as the model holds it (see the module docstring)."""
    gated_norm = name.endswith("linear_attn.norm.weight")  # the GDN's own norm: stored as is
    norm = name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_")
    if arch in _UNIT_OFFSET_NORM_ARCHS and norm and not gated_norm:
        return value - 1.0  # stored as w + 1
    if arch in _QWEN35_ARCHS and name.endswith("conv1d.weight"):
        if isinstance(value, QuantizedTensor):  # a depthwise conv, never a matmul
            value = value.dequantize()
        return value.unsqueeze(1)  # stored squeezed: [C, K] -> [C, 1, K]
    return value


# Tensors split by input columns under tensor parallelism (RowParallelLinear, and the routed
# experts' stacked down projections, each cut along its intermediate columns).
_ROW_PARALLEL = (
    "attn_output.weight",
    "ffn_down.weight",
    "ssm_out.weight",
    "ffn_down_shexp.weight",
    "ffn_down_exps.weight",
)


def tp_split_problem(path: str, tp_size: int) -> str | None:
    """Why the GGUF file at `path` cannot be split over `tp_size` ranks, or None when it can.
    Column-parallel tensors split by whole rows, which always fall on quant blocks; a
    row-parallel one splits every row, so its per-rank input width must be whole blocks."""
    for tensor in open_gguf(str(path)).tensors:
        if not tensor.name.endswith(_ROW_PARALLEL) or len(tensor.shape) not in (2, 3):
            continue
        columns = int(tensor.shape[0])  # GGUF lists dims fastest-first: [K, N] or [K, N, E]
        rows = "x".join(str(int(n)) for n in reversed(tensor.shape[1:]))
        block = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.tensor_type)][0]
        if columns % tp_size or (columns // tp_size) % block:
            kind = GGMLQuantizationType(tensor.tensor_type).name
            return (
                f"GGUF tensor {tensor.name} ({kind}, {rows}x{columns}) is split by input "
                f"columns under tensor parallelism: {columns} / tensor_parallel_size "
                f"{tp_size} = {columns / tp_size:g} columns per rank, not a multiple of its "
                f"{block}-column quant block"
            )
    return None
