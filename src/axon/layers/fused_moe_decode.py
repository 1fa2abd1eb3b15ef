"""A decode step of a mixture-of-experts model's decoder layers in one C call (kernels/cpu_moe.c),
on the CPU in float32.

`run_stack(layers, positions, hidden, norm)` is what the model's forward tries first: every
layer in turn (`axon_decode_stack`), then the final norm. A sparse layer is the attention half
of layers/fused_decode.py, then norm, float32 router, top-k and the chosen experts of
kernels/cpu_moe.py; a dense one (`mlp_only_layers`) is fused_decode's whole layer. Where a
layer has no C path it returns None and the layers run one by one, a sparse one trying `run`
(`axon_sparse_decode_layer`, the same layer in one call) before its two halves. Each path calls
the same kernels in the same order, so all of them agree to the bit; the reference twin is the
layers' own forward. What it saves is the Python between layers, dearer at batch 1 than in a
warm loop because it runs with the caches just flushed by the weights.
"""

from __future__ import annotations

import ctypes

import torch

from axon.kernels import cpu_moe
from axon.kernels.abi import FinalNorm, SparseLayer, library
from axon.layers import fused_decode

_UNSUPPORTED = object()  # a layer's cached verdict: no one-call path


class _Plan:
    """A layer's C description and what it points into (kept alive with it). It is stale when
    the KV cache moved or the experts were reloaded (FusedMoE drops its `_c_experts`)."""

    def __init__(self, spec, moe, experts: cpu_moe.ExpertWeights, router: cpu_moe.MoeRouter):
        self.k_cache, self.experts = spec.k_cache, experts
        # Held to check staleness without nn.Module's attribute lookups on every step.
        self._attention, self._moe = spec._attn, moe.experts
        self._keep = (spec, router)
        self.struct = SparseLayer(
            ctypes.addressof(spec), experts.address, router.address, int(experts.parallel)
        )
        self.address = ctypes.addressof(self.struct)

    def current(self) -> bool:
        """Whether the addresses it holds are still the layer's."""
        if self.experts is not self._moe._c_experts:
            return False
        return self.k_cache == self._attention.k_cache.data_ptr()


class _Stack:
    """A model's decoder layers as axon_decode_stack takes them: sparse ones by their _Plan,
    dense ones by fused_decode's layer spec (kept alive here), and the final norm."""

    def __init__(self, plans: list, norm):
        self.plans, self.norm_weight = plans, norm.weight
        sparse = [isinstance(plan, _Plan) for plan in plans]
        addresses = [p.address if s else ctypes.addressof(p) for p, s in zip(plans, sparse)]
        self.layers = (ctypes.c_void_p * len(plans))(*addresses)
        self.sparse = (ctypes.c_int32 * len(plans))(*sparse)
        weight = norm.weight
        self.norm = FinalNorm(weight.data_ptr(), weight.shape[0], norm.eps, int(norm.unit_offset))

    def current(self, plans: list, norm) -> bool:
        """Whether it still describes these layers and this norm."""
        if norm.weight is not self.norm_weight or self.norm.weight != norm.weight.data_ptr():
            return False
        return all(a is b for a, b in zip(self.plans, plans, strict=True))


_scratch = torch.empty(0)


def run_stack(layers, positions: torch.Tensor, hidden: torch.Tensor, norm) -> torch.Tensor | None:
    """norm(the output of a decode-only step's whole stack of decoder `layers`): an
    nn.ModuleList of sparse layers and dense ones with fused_decode's C path, then the final
    RMSNorm `norm`, in one C call, in place in `hidden`; or None (hidden untouched) when a layer
    or the norm has no C path, and the caller runs the layers one by one (each trying `run` or
    fused_decode.run: the same calls, to the bit) and the norm."""
    if not fused_decode.usable_hidden(hidden) or not fused_decode._is_f32(norm.weight):
        return None
    arguments = fused_decode.step_arguments(positions)
    if arguments is None:
        return None
    plans = [
        _plan_of(layer, hidden)
        if fused_decode.weights_of(layer).moe is not None
        else fused_decode._spec_of(layer)
        for layer in layers
    ]
    if any(plan is None for plan in plans):
        return None
    stack = layers.__dict__.get("_decode_stack")
    if stack is None or not stack.current(plans, norm):
        stack = layers.__dict__["_decode_stack"] = _Stack(plans, norm)
    lib, tokens, threads = library(), hidden.shape[0], torch.get_num_threads()
    count, width = len(plans), arguments[3]

    def floats() -> int:
        return lib.axon_decode_stack_scratch(
            stack.layers, stack.sparse, count, tokens, width, threads
        )

    norm_address = ctypes.addressof(stack.norm)
    call = (stack.layers, stack.sparse, count, norm_address, hidden.data_ptr(), tokens, *arguments)
    return _call(lib.axon_decode_stack, call, floats, threads, hidden)


def run(layer, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
    """The sparse layer's output for a decode-only step (in place in `hidden`), or None when
    the one-call path does not apply and the caller runs the layer's halves itself."""
    if not fused_decode.usable_hidden(hidden):  # the attention half's limit, below the MLP's
        return None
    arguments = fused_decode.step_arguments(positions)
    if arguments is None:
        return None
    plan = _plan_of(layer, hidden)
    if plan is None:
        return None
    lib, tokens, threads = library(), hidden.shape[0], torch.get_num_threads()

    def floats() -> int:
        return lib.axon_sparse_layer_scratch(plan.address, tokens, arguments[3], threads)

    call = (plan.address, hidden.data_ptr(), tokens, *arguments)
    return _call(lib.axon_sparse_decode_layer, call, floats, threads, hidden)


def _call(function, call: tuple, floats, threads: int, hidden: torch.Tensor) -> torch.Tensor:
    """function(*call, scratch, its size, threads); on -3 the scratch grows to floats() and
    the call runs again (the first step, or a longer context)."""
    status = function(*call, _scratch.data_ptr(), _scratch.numel(), threads)
    if status == -3:
        _grow_scratch(floats())
        status = function(*call, _scratch.data_ptr(), _scratch.numel(), threads)
    if status == -2:
        raise MemoryError("MoE decode layers: no memory for the 8-bit activations")
    if status != 0:
        raise RuntimeError("MoE decode layers: a layer's weights or expert ids were rejected")
    return hidden


def _plan_of(layer, hidden: torch.Tensor) -> _Plan | None:
    """The layer's plan (built once, again when stale), or None where a half has no C path
    (tensor parallelism included: its partial sums are all-reduced before the residual)."""
    cached = layer.__dict__.get("_sparse_decode_plan")
    if cached is _UNSUPPORTED:
        return None
    if cached is not None and cached.current():
        return cached
    weights = fused_decode.weights_of(layer)
    spec = fused_decode._spec_of(layer, attention_only=True)
    c_block = weights.moe.c_block(hidden, weights.mlp_in_norm)
    if spec is None or c_block is None or library() is None:
        layer.__dict__["_sparse_decode_plan"] = _UNSUPPORTED
        return None
    plan = _Plan(spec, weights.moe, *c_block)
    layer.__dict__["_sparse_decode_plan"] = plan
    return plan


def _grow_scratch(floats: int) -> None:
    global _scratch
    if _scratch.numel() < floats:
        _scratch = torch.empty(floats, dtype=torch.float32)
