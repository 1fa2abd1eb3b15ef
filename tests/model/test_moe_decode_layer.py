"""A decode step's MoE decoder layers in one C call (layers/fused_moe_decode.py:
`axon_decode_stack`, or `axon_sparse_decode_layer` per sparse layer, in kernels/cpu_moe.c)
through the real engine: it runs for every decode-only step, gives the same tokens and
log-probabilities to the bit as the same kernels called layer by layer and half by half, stays
within the tolerance of the pure-PyTorch layers where the router sends every token to the same
experts and none to the rest, and its parallel regions on 2 threads equal 1 thread to the bit."""

from __future__ import annotations

import pytest
import torch

from axon import LLM, SamplingParams
from axon.layers import fused_decode, fused_moe, fused_moe_decode
from axon.layers.fused_moe import FusedMoE, SparseMoeBlock

from .test_moe import ATOL, get_moe, needs_c_kernels
from .tiny_models import engine_kwargs, random_prompts

pytestmark = needs_c_kernels
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts((1, 6, 19, 33), seed=5)]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


def _generate(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    llm.engine.reset_prefix_cache()
    outputs = llm.generate(PROMPTS, PARAMS)
    return [
        (list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in
                                        o.outputs[0].logprobs])
        for o in outputs
    ]  # fmt: skip


def _sparse_layers(llm: LLM) -> list:
    return [layer for layer in llm.engine.runner.model.model.layers if layer.is_sparse]


@pytest.fixture
def llm(tiny_model_root) -> LLM:
    return LLM(**engine_kwargs(get_moe("qwen3_moe", tiny_model_root)))


def _counting(monkeypatch, name: str) -> list[bool]:
    """Replaces fused_moe_decode.<name> by itself, noting whether each call ran its C path."""
    calls, real = [], getattr(fused_moe_decode, name)

    def counting(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fused_moe_decode, name, counting)
    return calls


def _off(monkeypatch, name: str) -> None:
    monkeypatch.setattr(fused_moe_decode, name, lambda *args: None)


def test_stack_and_one_call_layers_equal_the_two_halves_to_the_bit(llm, monkeypatch):
    """The decode step's layers in one C call (sparse, dense, sparse), then one call per
    sparse layer, then each sparse layer's two halves: the same kernels in the same order."""
    stack_calls = _counting(monkeypatch, "run_stack")
    in_one_call = _generate(llm)
    _off(monkeypatch, "run_stack")
    layer_calls = _counting(monkeypatch, "run")
    layer_by_layer = _generate(llm)
    _off(monkeypatch, "run")
    two_halves = _generate(llm)

    assert in_one_call == layer_by_layer == two_halves
    # The 9 steps after the last prompt's prefill are decode-only.
    decode_steps = PARAMS.max_tokens - 1
    assert sum(stack_calls) >= decode_steps
    assert sum(layer_calls) >= len(_sparse_layers(llm)) * decode_steps
    for layer in _sparse_layers(llm):
        assert isinstance(layer._sparse_decode_plan, fused_moe_decode._Plan)


def _lowest_id_on_ties(logits: torch.Tensor, top_k: int, renormalize: bool):
    """select_experts with ties broken as cpu_moe.c does (the lower id; torch.topk does not
    promise an order)."""
    probs = torch.softmax(logits.float(), dim=-1)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def test_one_call_layer_where_two_experts_take_every_token(llm, monkeypatch):
    """A zero router ties every expert: experts 0 and 1 (top-2) take every token, the other
    six none. The one-call layer equals the pure-PyTorch layers (no C attention, experts run
    op by op) within the float32 tolerance."""
    for layer in _sparse_layers(llm):
        layer.mlp.gate.weight.data.zero_()
    monkeypatch.setattr(fused_moe, "select_experts", _lowest_id_on_ties)
    got = _generate(llm)
    # No C decode layer takes the step (the attention half's C path too): the layers' forward.
    monkeypatch.setattr(fused_decode, "usable_hidden", lambda hidden, max_tokens=0: False)
    monkeypatch.setattr(SparseMoeBlock, "add_in_place", lambda self, hidden, norm: None)
    monkeypatch.setattr(FusedMoE, "_c_path", lambda self, hidden: None)
    want = _generate(llm)

    for (got_ids, got_steps), (want_ids, want_steps) in zip(got, want, strict=True):
        assert got_ids == want_ids
        for got_step, want_step in zip(got_steps, want_steps, strict=True):
            assert got_step.keys() == want_step.keys()
            for token, logprob in got_step.items():
                assert abs(logprob - want_step[token]) <= ATOL


def test_one_call_layer_on_two_threads_equals_one_thread_to_the_bit(llm):
    _generate(llm)  # builds every layer's plan
    for layer in llm.engine.runner.model.model.layers:  # tiny weights: split them anyway
        if layer.is_sparse:
            layer._sparse_decode_plan.struct.parallel = 1
            spec = layer._fused_attention_spec
        else:
            spec = layer._fused_decode_spec
            spec.gate_up.parallel = spec.down.parallel = 1
        spec.qkv.parallel = spec.o.parallel = 1
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_generate(llm))
    finally:
        torch.set_num_threads(previous)
    assert results[0] == results[1]
