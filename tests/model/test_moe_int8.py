"""Opt-in 8-bit activations in a mixture-of-experts layer: use_int8_activations reaches the
quantized experts, whose one-call C path (kernels/cpu_moe.c) then multiplies every chosen expert
with 8-bit activations (ggml_q8.c), batch 1 and batched alike. Its reference twin quantizes each
token's activations per block and multiplies them with the dequantized weights
(`ggml_q8.matmul_ref`), gate/up, then down, one token and one choice at a time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import nn

from axon.kernels import ggml_q8
from axon.layers.fused_moe import FusedMoE, SparseMoeBlock, select_experts
from axon.layers.int8_activations import use_int8_activations
from axon.layers.norm import RMSNorm

from .test_moe import NUM_EXPERTS, TOP_K, _quantized_layer, _random_experts, needs_c_kernels
from .test_moe_decode import on_one_and_two_threads

pytestmark = needs_c_kernels
HIDDEN = INTER = 256  # whole Q8_K blocks


def _int8_layer(qtype: Q, tokens: int, seed: int = 3):
    """A quantized expert layer switched to int8 the way the engine does it, its inputs and
    routing."""
    x, w_gate_up, w_down, logits = _random_experts(seed, hidden=HIDDEN, inter=INTER, tokens=tokens)
    layer = _quantized_layer(w_gate_up, w_down, qtype)
    holder = nn.ModuleList([layer])
    assert use_int8_activations(holder) == 3 * layer.num_experts  # gate, up, down each
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    return layer, x, weights, ids


def _int8_ref(layer: FusedMoE, x, topk_weights, topk_ids) -> torch.Tensor:
    """sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), each product `ggml_q8.matmul_ref`
    (that token's activations quantized per block, float64 sums)."""
    experts = layer.quantized
    out = torch.zeros(x.shape, dtype=torch.float32)

    def product(expert: int, part: str, rows: torch.Tensor) -> torch.Tensor:
        qt = experts._part(expert, part)
        return ggml_q8.matmul_ref(rows, qt.data, qt.ggml_type, qt.shape[1])

    for token in range(x.shape[0]):
        row = x[token : token + 1]
        for weight, expert in zip(topk_weights[token].tolist(), topk_ids[token].tolist()):
            h = F.silu(product(expert, "gate", row)) * product(expert, "up", row)
            out[token] += weight * product(expert, "down", h)[0]
    return out


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 12])
def test_int8_c_experts_equal_the_reference_twin(qtype, tokens):
    layer, x, weights, ids = _int8_layer(qtype, tokens)
    c_experts = layer._c_path(x)
    assert c_experts is not None and c_experts.int8

    got = layer(x, weights, ids)

    want = _int8_ref(layer, x, weights, ids)
    scale = float(want.abs().max())
    # Measured ~2e-7: float32 vs float64 sums. The bound leaves room for one code of h a step
    # off (h sits on a rounding tie: ~1.5e-3), still well under the 8-bit effect (~1e-2).
    assert float((got - want).abs().max()) <= 2e-3 * scale
    layer.quantized.int8, layer._c_experts = False, False  # the exact path, prepared again
    exact = layer(x, weights, ids)
    assert not layer._c_path(x).int8
    assert float((got - exact).abs().max()) > 5e-3 * scale  # 8-bit activations did run


def test_int8_python_path_matches_the_c_experts():
    """Past cpu_moe.MAX_TOKENS (a prefill), fused_moe runs expert by expert on GGMLWeights
    built with int8: the same products as the C call, summed in another order."""
    layer, x, weights, ids = _int8_layer(Q.Q4_K, tokens=12)
    c_path = layer(x, weights, ids)
    layer._c_experts = None  # no C path: fused_moe from Python
    python_path = layer(x, weights, ids)
    assert all(kernel.int8 for kernel in layer.quantized._prepared.values())
    torch.testing.assert_close(
        python_path, c_path, rtol=1e-5, atol=1e-5 * float(c_path.abs().max())
    )


def test_a_tokens_int8_experts_do_not_depend_on_the_batch():
    layer, x, weights, ids = _int8_layer(Q.Q4_K, tokens=12)
    batched = layer(x, weights, ids)
    for token in (0, 7):
        alone = layer(x[token : token + 1], weights[token : token + 1], ids[token : token + 1])
        assert torch.equal(alone[0], batched[token])


def test_int8_c_experts_on_two_threads_equal_one_thread_to_the_bit():
    layer, x, weights, ids = _int8_layer(Q.Q4_K, tokens=3, seed=4)
    one, two = on_one_and_two_threads(layer, x, weights, ids)
    assert torch.equal(one, two)


@pytest.mark.parametrize("tokens", [1, 5])
def test_int8_sparse_block_in_place_equals_its_forward(tokens):
    """The one-call MLP half (norm, router, top-k, int8 experts, residual add in C) equals
    hidden + block(norm(hidden)) run op by op, whose experts take the same 8-bit products."""
    config = SimpleNamespace(
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, hidden_size=HIDDEN,
        moe_intermediate_size=INTER, hidden_act="silu",
    )  # fmt: skip
    block = SparseMoeBlock(config, renormalize=True)
    block.experts, x, _, _ = _int8_layer(Q.Q4_K, tokens, seed=6)
    block.gate.weight.data.normal_(generator=torch.Generator().manual_seed(6))
    norm = RMSNorm(HIDDEN, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(7))
    want = x + block(norm(x))

    got = block.add_in_place(x.clone(), norm)

    assert got is not None and block.experts._c_experts.int8
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
