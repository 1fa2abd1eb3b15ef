"""The Gated DeltaNet kernels: chunked == recurrent, state carried across splits, and both equal
transformers' reference functions."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from axon.layers.linear_attention import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    chunk_gated_delta_rule_ref,
    l2norm,
    recurrent_gated_delta_rule_ref,
)

TOL = 1e-5
AWKWARD_LENGTHS = (1, 3, 63, 64, 65, 130)


def _inputs(length: int, seed: int, batch: int = 2, heads: int = 3, k_dim: int = 8, v_dim: int = 5):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(batch, length, heads, k_dim, generator=gen))
    k = l2norm(torch.randn(batch, length, heads, k_dim, generator=gen))
    v = torch.randn(batch, length, heads, v_dim, generator=gen)
    g = -torch.rand(batch, length, heads, generator=gen) * 2  # log decay in (-2, 0]
    beta = torch.rand(batch, length, heads, generator=gen)
    state = torch.randn(batch, heads, k_dim, v_dim, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length", AWKWARD_LENGTHS)
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_chunked_equals_recurrent(length, with_state):
    q, k, v, g, beta, state = _inputs(length, seed=length)
    initial = state if with_state else None
    scale = q.shape[-1] ** -0.5

    out_c, state_c = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, initial, chunk_size=16)
    out_r, state_r = recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale, initial)

    assert out_c.shape == v.shape and state_c.shape == state.shape
    assert float((out_c - out_r).abs().max()) <= TOL
    assert float((state_c - state_r).abs().max()) <= TOL


def test_state_carried_across_splits_equals_one_pass():
    """Prefill in pieces (chunked prefill, then decode steps) == one pass over everything."""
    q, k, v, g, beta, _ = _inputs(50, seed=7)
    scale = q.shape[-1] ** -0.5
    full, full_state = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale)
    pieces, state = [], None
    for start, end in ((0, 13), (13, 47)):
        part = (x[:, start:end] for x in (q, k, v, g, beta))
        out, state = chunk_gated_delta_rule_ref(*part, scale, state)
        pieces.append(out)
    for t in range(47, 50):
        step = (x[:, t : t + 1] for x in (q, k, v, g, beta))
        out, state = recurrent_gated_delta_rule_ref(*step, scale, state)
        pieces.append(out)
    assert float((torch.cat(pieces, dim=1) - full).abs().max()) <= TOL
    assert float((state - full_state).abs().max()) <= TOL


@pytest.mark.parametrize("length", (1, 65))
def test_kernels_equal_transformers(length):
    q, k, v, g, beta, state = _inputs(length, seed=100 + length)
    scale = q.shape[-1] ** -0.5
    want_c, want_cs = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True
    )
    want_r, want_rs = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True
    )
    got_c, got_cs = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, state)
    got_r, got_rs = recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale, state)
    for got, want in ((got_c, want_c), (got_cs, want_cs), (got_r, want_r), (got_rs, want_rs)):
        assert float((got - want).abs().max()) <= TOL


def test_conv_with_carried_state_equals_one_pass():
    gen = torch.Generator().manual_seed(5)
    channels, kernel, length = 6, 4, 11
    x = torch.randn(length, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    full, full_state = causal_conv1d_ref(x, weight, None)
    want = hf.causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    assert float((full - want).abs().max()) <= TOL

    first, state = causal_conv1d_ref(x[:2], weight, None)  # shorter than the kernel
    second, state = causal_conv1d_ref(x[2:8], weight, state)
    steps = []
    for t in range(8, length):
        out, state_b = causal_conv1d_update_ref(x[t][None], state[None], weight)
        state = state_b[0]
        steps.append(out)
    got = torch.cat([first, second, *steps])
    assert float((got - full).abs().max()) <= TOL
    assert torch.equal(state, full_state)
