"""Opt-in 8-bit activations at batch-1 decode too: one token's matmul takes the 8-bit kernel, the
one-call decoder layer (kernels/cpu_layer.c) runs its projections on it and equals the layer's own
PyTorch forward to the bit, and through the engine a prompt's greedy tokens and log-probabilities
do not depend on the prompts decoded beside it, while staying close to the exact path."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from axon import LLM, SamplingParams
from axon.kernels import ggml_cpu, ggml_q8
from model.test_fused_decode import _assert_identical, _run_both
from model.tiny_models import ARCHS, random_prompts
from quant.gguf_files import build_gguf_model, write_gguf
from quant.test_dequant import COLS, ROWS
from quant.test_int8_activations import TYPES, _raw_tensor, _x

pytestmark = pytest.mark.skipif(not ggml_cpu.available(), reason="no C compiler")
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory=1 << 24)
PROMPTS = random_prompts((3, 11, 26, 7), seed=21)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_one_token_takes_the_8bit_kernel(qtype):
    raw = _raw_tensor(qtype)
    weights = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS, int8=True)
    token = _x(1, seed=31)
    got, want = weights.matmul(token), ggml_q8.matmul_ref(token, raw, int(qtype), COLS)
    assert got.shape == (1, ROWS)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 2e-6 * scale, qtype.name
    exact = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS).matmul(token)
    assert float((got - exact).abs().max()) > 1e-4 * scale  # not the float32 path
    in_batch = weights.matmul(torch.cat([_x(3, seed=4), token]))[3]
    assert torch.equal(got[0], in_batch)


def _gguf(arch: str, qtype: Q, tmp_path) -> str:
    path, _ = write_gguf(build_gguf_model(arch), arch, qtype, tmp_path / f"{arch}.gguf")
    return str(path)


@pytest.mark.parametrize(
    "arch,qtype",
    [*((arch, Q.Q4_K) for arch in ARCHS), ("qwen3", Q.Q8_0)],
    ids=lambda value: getattr(value, "name", value),
)
def test_fused_layer_equals_the_layers_forward_in_int8(arch, qtype, tmp_path, monkeypatch):
    """The int8 twin of test_fused_decode: decode steps of 1 to 4 streams in one C call per layer
    give the same tokens and log-probabilities, to the bit, as the layer's own forward."""
    llm = LLM(model=_gguf(arch, qtype, tmp_path), activation_precision="int8", **ENGINE_ARGS)
    layer = llm.engine.runner.model.model.layers[0]
    fused, unfused, fused_calls = _run_both(llm, monkeypatch)
    spec = layer._fused_decode_spec
    assert all(p.int8 for p in (spec.qkv, spec.o, spec.gate_up, spec.down))
    assert fused_calls >= len(llm.engine.runner.model.model.layers) * 11  # every decode step
    _assert_identical(fused, unfused)


@pytest.fixture(scope="module")
def qwen3_q4_k(tmp_path_factory) -> str:
    return _gguf("qwen3", Q.Q4_K, tmp_path_factory.mktemp("int8-decode"))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0] for o in outputs]


def test_greedy_output_does_not_depend_on_the_batch(qwen3_q4_k):
    """Each prompt alone (batch-1 decode) and all four together (decode batches of 4 down to
    1): the same tokens and the same log-probabilities, to the bit."""
    llm = LLM(model=qwen3_q4_k, activation_precision="int8", **ENGINE_ARGS)
    together = _greedy(llm, PROMPTS)
    for prompt, batched in zip(PROMPTS, together, strict=True):
        llm.engine.reset_prefix_cache()
        (alone,) = _greedy(llm, [prompt])
        assert alone.token_ids == batched.token_ids
        for step_alone, step_batched in zip(alone.logprobs, batched.logprobs, strict=True):
            assert {t: lp.logprob for t, lp in step_alone.items()} == {
                t: lp.logprob for t, lp in step_batched.items()
            }


def _decode_logits(llm: LLM, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """A lone prompt's first token (from its prefill) and the logits [V] of the batch-1 decode
    step that follows."""
    engine = llm.engine
    engine.reset_prefix_cache()
    engine._captured_logits = {}  # the hook forward_logits uses: each step's rows, by sequence
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        (seq,) = engine.add_request("decode-logits", prompt, params)
        engine.step()  # the prefill
        first = seq.output_token_ids[0]
        while not seq.is_finished:
            engine.step()
        return first, engine._captured_logits[seq.seq_id].cpu()
    finally:
        engine._captured_logits = None


def test_batch1_decode_logits_stay_close_to_the_exact_path(qwen3_q4_k):
    """A batch-1 decode step's logits move (8-bit activations all the way) but stay close: a tiny
    random model moves ~4 % of the largest logit, KL <= 0.03 nats (measured)."""
    exact = LLM(model=qwen3_q4_k, activation_precision="float32", **ENGINE_ARGS)
    int8 = LLM(model=qwen3_q4_k, activation_precision="int8", **ENGINE_ARGS)
    compared = 0
    for prompt in PROMPTS:
        (first_exact, want), (first_int8, got) = (_decode_logits(exact, prompt),
                                                  _decode_logits(int8, prompt))  # fmt: skip
        if first_exact != first_int8:
            continue  # the decode steps would read different tokens
        assert not torch.equal(want, got)
        assert float((want - got).abs().max()) <= 0.1 * float(want.abs().max())
        kl = torch.sum(want.softmax(-1) * (want.log_softmax(-1) - got.log_softmax(-1)))
        assert float(kl) <= 0.05
        compared += 1
    assert compared >= len(PROMPTS) - 1
