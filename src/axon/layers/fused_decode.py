"""A whole decoder layer of a decode step in one C call (kernels/cpu_layer.c), for the Llama
family (Llama, Qwen2, Qwen3, Gemma 3) on the CPU in float32.

`run(layer, positions, hidden)` is what a layer's forward tries first: it returns the layer's
output, computed in place in `hidden`, when the step is decode-only and every piece of the layer
has its C kernel (GGML or float32 weights, no biases besides q/k/v), else None, and the layer's
own PyTorch forward (its reference twin, which calls the same kernels one at a time) runs. The
C function strings together the very kernels that forward calls, in the same order, so the two
agree to the bit; what it saves is the Python between them, most of a small model's layer.
With activation_precision="int8" a projection whose GGMLWeights has `int8` set runs on the 8-bit
kernel (ggml_q8.c) here too, as it does in that forward.

A layer says what the C layer reads through its `decode_weights()`, a `DecodeWeights` of the
modules by their role; nothing here knows where a model keeps them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from axon.kernels import cpu_ops, ggml_cpu
from axon.kernels.abi import Layer, Projection, library
from axon.layers.activation import GeluAndMul, SiluAndMul
from axon.layers.forward_context import get_forward_context

if TYPE_CHECKING:
    from axon.layers.attention import Attention
    from axon.layers.fused_moe import SparseMoeBlock

MAX_TOKENS = 32  # the float32 matmuls leave the C kernel above this (see SmallBatchLinear)


@dataclass(frozen=True)
class AttentionWeights:
    """An attention block's modules as the C layer reads them."""

    qkv: nn.Module  # q, k and v in one projection (its bias, where it has one, added)
    o: nn.Module  # the output projection
    rotary: nn.Module  # RotaryEmbedding: inv_freq, rotary_dim
    attn: Attention  # the geometry (heads, head_dim, scale, window, softcap) and the KV cache
    q_norm: nn.Module | None = None  # RMSNorms per head of q and k (Qwen3, Gemma 3)
    k_norm: nn.Module | None = None


@dataclass(frozen=True)
class DecodeWeights:
    """What a decoder layer's `decode_weights()` returns: its attention, its norms by where they
    apply, and either a dense gated MLP (gate_up, down, act_fn) or a sparse one (`moe`, which
    layers/fused_moe_decode.py runs). Norms are RMSNorms, projections the linear layers."""

    attention: AttentionWeights
    input_norm: nn.Module  # before attention
    mlp_in_norm: nn.Module  # before the MLP
    attn_out_norm: nn.Module | None = None  # on attention's output, before the residual add
    mlp_out_norm: nn.Module | None = None  # on the MLP's output, before the residual add
    gate_up: nn.Module | None = None
    down: nn.Module | None = None
    act_fn: nn.Module | None = None
    moe: SparseMoeBlock | None = None


def weights_of(layer: nn.Module) -> DecodeWeights:
    """The layer's `decode_weights()`, asked once: the modules it names stay the layer's."""
    weights = layer.__dict__.get("_decode_weights")
    if weights is None:
        weights = layer.__dict__["_decode_weights"] = layer.decode_weights()
    return weights


_UNSUPPORTED = object()  # a layer's cached verdict: no C path
_scratch = torch.empty(0)


def run(layer, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
    """The layer's output for a decode-only step (in place in `hidden`), or None when the C
    path does not apply and the caller must run its own forward."""
    return _run(layer, positions, hidden, attention_only=False)


def run_attention(layer, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
    """`hidden + attention(input_norm(hidden))` for a decode-only step, in place in
    `hidden` (the MLP is not run, nor need it have C kernels: a mixture-of-experts layer's
    sparse MLP runs in kernels/cpu_moe.c), or None where the C path does not apply."""
    return _run(layer, positions, hidden, attention_only=True)


def usable_hidden(hidden: torch.Tensor, max_tokens: int = MAX_TOKENS) -> bool:
    """Whether a C decode layer takes these hidden states in place: float32 [T, hidden] on the
    CPU, contiguous, T <= max_tokens."""
    if hidden.dim() != 2 or hidden.shape[0] > max_tokens:
        return False
    return hidden.dtype == torch.float32 and hidden.device.type == "cpu" and hidden.is_contiguous()


# (forward context, positions, their C arguments) of the latest step: every layer of a step
# passes the same ones, so they are read once a step, not once a layer.
_step: tuple = (None, None, None)


def step_arguments(positions: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """This decode-only step's arguments to the C layers: the addresses of positions, slot
    mapping and key slots, the key slots' width, the address of the context lengths; None for
    a step with prefills (the C layers decode only)."""
    global _step
    meta = get_forward_context()
    if _step[0] is meta and _step[1] is positions:
        return _step[2]
    arguments = None
    if not meta.prefills and meta.decode_key_slots is not None:
        key_slots = meta.decode_key_slots
        arguments = (
            positions.data_ptr(), meta.slot_mapping.data_ptr(), key_slots.data_ptr(),
            key_slots.shape[1], meta.decode_context_lens.data_ptr(),
        )  # fmt: skip
    _step = (meta, positions, arguments)
    return arguments


def _run(layer, positions: torch.Tensor, hidden: torch.Tensor, attention_only: bool):
    if not usable_hidden(hidden):
        return None
    arguments = step_arguments(positions)
    if arguments is None:
        return None
    spec = _spec_of(layer, attention_only)
    if spec is None:
        return None
    tokens, threads = hidden.shape[0], torch.get_num_threads()
    lib = library()
    scratch = _scratch_for(lib.axon_decode_layer_scratch(spec, tokens, arguments[3], threads))
    decode = lib.axon_decode_attention if attention_only else lib.axon_decode_layer
    status = decode(spec, hidden.data_ptr(), tokens, *arguments, scratch.data_ptr(), threads)
    if status == -2:
        raise MemoryError(
            "axon_decode_layer: no memory for the 8-bit activations or the float16 cache's rows"
        )
    if status != 0:
        raise RuntimeError("axon_decode_layer rejected a layer's weights")
    return hidden


def _scratch_for(floats: int) -> torch.Tensor:
    global _scratch
    if _scratch.numel() < floats:
        _scratch = torch.empty(floats, dtype=torch.float32)
    return _scratch


def _spec_of(layer, attention_only: bool = False) -> Layer | None:
    """The layer's C description, built once (again if the KV cache moved); None if unsupported.
    With attention_only, the MLP half is left out (zero projections)."""
    key = "_fused_attention_spec" if attention_only else "_fused_decode_spec"
    cached = layer.__dict__.get(key)
    if cached is _UNSUPPORTED:
        return None
    if cached is not None and cached.k_cache == cached._attn.k_cache.data_ptr():
        return cached
    spec = _build_spec(weights_of(layer), attention_only)
    layer.__dict__[key] = _UNSUPPORTED if spec is None else spec
    return spec


def _build_spec(weights: DecodeWeights, attention_only: bool = False) -> Layer | None:
    if library() is None:
        return None
    attention = weights.attention
    projections = [attention.qkv, attention.o]
    if not attention_only:
        if weights.gate_up is None:  # a sparse MLP: fused_moe_decode's
            return None
        projections += [weights.gate_up, weights.down]
    if any(p.bias is not None for p in projections[1:]) or attention.o.tp_size != 1:
        return None
    prepared = [_weights_of(p) for p in projections]
    activation = 0 if attention_only else _activation_of(weights.act_fn)
    attn, rope, norm = attention.attn, attention.rotary, weights.input_norm
    if None in prepared or activation is None or not cpu_ops.cache_usable(attn.k_cache):
        return None
    if not (_is_f32(norm.weight) and _is_f32(rope.inv_freq)):
        return None
    spec = Layer(
        hidden=norm.weight.shape[0], heads=attn.num_heads, kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, rotary_dim=rope.rotary_dim,
        inter=0 if attention_only else prepared[3].cols,
        window=attn.sliding_window or 0, eps=norm.eps, scale=attn.scale,
        softcap=attn.logit_softcap or 0.0, unit_offset=int(norm.unit_offset),
        activation=activation, input_norm=norm.weight.data_ptr(),
        attn_out_norm=_ptr_of(weights.attn_out_norm), mlp_in_norm=_ptr_of(weights.mlp_in_norm),
        mlp_out_norm=_ptr_of(weights.mlp_out_norm), q_norm=_ptr_of(attention.q_norm),
        k_norm=_ptr_of(attention.k_norm), qkv_bias=_ptr_of(attention.qkv, "bias"),
        inv_freq=rope.inv_freq.data_ptr(), k_cache=attn.k_cache.data_ptr(),
        v_cache=attn.v_cache.data_ptr(), qkv=_projection(prepared[0]),
        o=_projection(prepared[1]), kv_type=cpu_ops.KV_TYPES[attn.k_cache.dtype],
    )  # fmt: skip
    if not attention_only:
        spec.gate_up, spec.down = _projection(prepared[2]), _projection(prepared[3])
    spec._keep = prepared  # the prepared weights (and their bytes) stay alive with the spec
    spec._attn = attn  # whose cache address it holds (see _spec_of)
    return spec


def _weights_of(linear) -> ggml_cpu.GGMLWeights | None:
    if linear.quantized is not None:
        return linear.quantized.ggml_weights()
    return ggml_cpu.dense_weights(linear.weight)


def _activation_of(act) -> int | None:
    if isinstance(act, SiluAndMul):
        return cpu_ops.ACTIVATIONS["silu"]
    if isinstance(act, GeluAndMul) and act.approximate == "tanh":
        return cpu_ops.ACTIVATIONS["gelu_tanh"]
    return None


def _is_f32(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.device.type == "cpu"


def _ptr_of(module, name: str = "weight") -> int | None:
    """The data pointer of `module.name` (a float32 tensor), or None (NULL) when absent."""
    tensor = None if module is None else getattr(module, name, None)
    return None if tensor is None else tensor.data_ptr()


def _projection(weights: ggml_cpu.GGMLWeights) -> Projection:
    count = len(weights.parts)  # the C call's arguments, as the weights prepared them
    types = list(weights._types) + [0] * (3 - count)
    pointers = list(weights._ptrs) + [None] * (3 - count)
    rows = list(weights._rows) + [0] * (3 - count)
    return Projection(count, int(weights.parallel), int(weights.int8), (ctypes.c_int32 * 3)(*types),
                      (ctypes.c_void_p * 3)(*pointers), (ctypes.c_int64 * 3)(*rows))  # fmt: skip
