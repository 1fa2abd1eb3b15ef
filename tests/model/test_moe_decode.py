"""The decode path of a sparse layer on the CPU: the chosen experts split across threads in one
parallel region equal one thread to the bit, and the one-call MLP half (norm, float32 router,
top-k, experts, residual add in kernels/cpu_moe.c) equals the block's op-by-op forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType

from axon import LLM
from axon.kernels import abi
from axon.layers.fused_moe import SparseMoeBlock, select_experts
from axon.layers.norm import RMSNorm

from .test_moe import (
    GREEDY,
    GREEDY_LENGTHS,
    GREEDY_SEED,
    MAX_TOKENS,
    NUM_EXPERTS,
    TOP_K,
    _quantized_layer,
    _random_experts,
    get_moe,
    needs_c_kernels,
)
from .tiny_models import engine_kwargs, random_prompts


@needs_c_kernels
def test_c_experts_on_two_threads_equal_one_thread_to_the_bit():
    """One parallel region splits the chosen experts' row quads across threads: a row's
    product is the same whichever thread computes it."""
    x, w_gate_up, w_down, logits = _random_experts(4, hidden=256, inter=256, tokens=3)
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    layer = _quantized_layer(w_gate_up, w_down, GGMLQuantizationType.Q4_K)
    one, two = on_one_and_two_threads(layer, x, weights, ids)
    assert torch.equal(one, two)


@needs_c_kernels
@pytest.mark.parametrize("tokens", [1, 5])
def test_sparse_block_in_place_equals_its_forward(tokens):
    """The one-call MLP half (norm, float32 router, top-k, experts, residual add in C) equals
    hidden + block(norm(hidden)) run op by op."""
    config = SimpleNamespace(
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, hidden_size=64,
        moe_intermediate_size=32, hidden_act="silu",
    )  # fmt: skip
    x, w_gate_up, w_down, _ = _random_experts(5, hidden=64, inter=32, tokens=tokens)
    block = SparseMoeBlock(config, renormalize=True)
    block.experts.weight_loader(block.experts.gate_up_proj, w_gate_up)
    block.experts.weight_loader(block.experts.down_proj, w_down)
    block.gate.weight.data.normal_(generator=torch.Generator().manual_seed(6))
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(7))
    want = x + block(norm(x))

    got = block.add_in_place(x.clone(), norm)

    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_c_kernels
def test_sparse_layers_decode_in_c_and_match_transformers(tiny_model_root):
    """Greedy decode of concurrent prompts with the sparse layers' attention on the dense
    layers' fused C path and their MLP half in one C call: the tokens equal transformers'."""
    tiny = get_moe("qwen3_moe", tiny_model_root)
    prompts = random_prompts(GREEDY_LENGTHS, GREEDY_SEED)
    llm = LLM(**engine_kwargs(tiny, max_num_batched_tokens=32))

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)

    for prompt, output in zip(prompts, outputs):
        got = list(output.outputs[0].token_ids)
        assert got == tiny.greedy(prompt, MAX_TOKENS).token_ids, f"prompt of {len(prompt)}"
    sparse = [layer for layer in llm.engine.runner.model.model.layers if layer.is_sparse]
    assert sparse
    for layer in sparse:  # both C calls were prepared, so decode steps took them
        assert isinstance(layer._fused_attention_spec, abi.Layer)
        assert layer.mlp._c_router[1] is not None


def on_one_and_two_threads(layer, x, weights, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's C experts run serially, then with their parallel region on 2 threads."""
    experts = layer._c_path(x)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        results = []
        for parallel in (False, True):
            experts.parallel = parallel
            results.append(layer(x, weights, ids))
    finally:
        torch.set_num_threads(previous)
    return results[0], results[1]
