"""A Qwen3-MoE GGUF (llama.cpp's converter, Q8_0) through the engine with 8-bit activations: the
switch reaches every layer's experts and their one-call C path, the logits stay close to the exact
path, and a prompt's greedy tokens and log-probabilities are the same alone (batch-1 decode) and
batched with others."""

from __future__ import annotations

import pytest
import torch

from axon.config import EngineConfig
from axon.engine.engine_core import EngineCore
from axon.kernels import cpu_moe, ggml_cpu
from axon.layers import fused_moe_decode
from axon.sampling_params import SamplingParams
from model.tiny_models import engine_kwargs
from quant.test_gguf_moe import (  # noqa: F401  (module fixtures)
    GREEDY_PROMPTS,
    PROMPTS,
    _quantized_experts,
    checkpoint,
    converter,
    gguf_files,
)

pytestmark = [
    pytest.mark.skipif(not ggml_cpu.available(), reason="no C compiler"),
    pytest.mark.slow,  # engines on a real-vocabulary GGUF
]
STEPS = 8


def _engine(checkpoint, gguf_files, precision: str) -> EngineCore:  # noqa: F811
    # One step holds every greedy prompt (56 tokens <= cpu_moe.MAX_TOKENS): the experts always
    # take the C call, alone and batched alike.
    kwargs = engine_kwargs(checkpoint, block_size=4, max_num_batched_tokens=64)
    kwargs.pop("model")
    config = EngineConfig.from_kwargs(
        str(gguf_files["q8_0"]), activation_precision=precision, **kwargs
    )
    return EngineCore(config)


def test_int8_reaches_the_experts_and_stays_close(checkpoint, gguf_files):  # noqa: F811
    exact = _engine(checkpoint, gguf_files, "float32")
    int8 = _engine(checkpoint, gguf_files, "int8")
    want, got = exact.forward_logits(PROMPTS), int8.forward_logits(PROMPTS)
    for w, g in zip(want, got, strict=True):
        assert not torch.equal(w, g)
        assert float((w - g).abs().max()) <= 0.1 * float(w.abs().max())
    layers = [m for m in int8.runner.model.modules() if hasattr(m, "_c_experts")]
    assert layers and all(m.int8 for m in _quantized_experts(int8))
    for layer in layers:  # prepared by the steps above, with 8-bit activations
        assert isinstance(layer._c_experts, cpu_moe.ExpertWeights) and layer._c_experts.int8
    assert not any(
        m._c_experts.int8 for m in exact.runner.model.modules() if hasattr(m, "_c_experts")
    )


def _greedy(engine: EngineCore, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    seqs = [engine.add_request(f"g-{i}", p, params)[0] for i, p in enumerate(prompts)]
    logprobs: dict[str, list] = {f"g-{i}": [] for i in range(len(prompts))}
    while not all(seq.is_finished for seq in seqs):
        for update in engine.step():
            if update.logprobs is not None:
                lp = update.logprobs
                logprobs[update.request_id].append((lp.token_id, lp.logprob, lp.rank, lp.top))
    return [(seq.output_token_ids, logprobs[f"g-{i}"]) for i, seq in enumerate(seqs)]


def test_int8_greedy_does_not_depend_on_the_batch(checkpoint, gguf_files):  # noqa: F811
    engine = _engine(checkpoint, gguf_files, "int8")
    together = _greedy(engine, GREEDY_PROMPTS)
    for prompt, batched in zip(GREEDY_PROMPTS, together, strict=True):
        engine.reset_prefix_cache()
        (alone,) = _greedy(engine, [prompt])
        assert alone[0] == batched[0], f"prompt of {len(prompt)}"
        # A prompt alone and in a batch differ by ~1e-6 in log-probability on the exact path as
        # well as here (measured), so they are compared to rounding, not to the bit.
        for got, want in zip(alone[1], batched[1], strict=True):
            assert got[0] == want[0] and got[2] == want[2]
            assert got[1] == pytest.approx(want[1], abs=1e-4)
            assert [t for t, _ in got[3]] == [t for t, _ in want[3]]
            assert [v for _, v in got[3]] == pytest.approx([v for _, v in want[3]], abs=1e-4)


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_one_call_sparse_layer_equals_its_two_halves(
    checkpoint,  # noqa: F811
    gguf_files,  # noqa: F811
    precision,
    monkeypatch,
):
    """Quantized experts, exact or with 8-bit activations: the decode step's layers in one C
    call (layers/fused_moe_decode.py) give the tokens and log-probabilities of each layer's
    attention half and MLP half called one after the other, to the bit."""
    engine = _engine(checkpoint, gguf_files, precision)
    one_call = _greedy(engine, GREEDY_PROMPTS)
    layers = [layer for layer in engine.runner.model.model.layers if layer.is_sparse]
    assert layers and all(
        isinstance(layer._sparse_decode_plan, fused_moe_decode._Plan) for layer in layers
    )
    assert all(layer._sparse_decode_plan.experts.int8 == (precision == "int8") for layer in layers)
    assert isinstance(engine.runner.model.model.layers._decode_stack, fused_moe_decode._Stack)
    for name in ("run_stack", "run"):  # each layer's halves, one C call each
        monkeypatch.setattr(fused_moe_decode, name, lambda *args: None)
    engine.reset_prefix_cache()
    assert _greedy(engine, GREEDY_PROMPTS) == one_call
