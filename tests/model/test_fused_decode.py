"""The one-call decoder layer (layers/fused_decode.py, kernels/cpu_layer.c) against the layer's
own forward, its reference twin: through the real engine, for every Llama-family arch, from
float32 safetensors and from a K-quant GGUF, the fused path must run for the decode steps and
give the same tokens and the same log-probabilities to the bit (it strings together the very
kernels the unfused forward calls one at a time)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from axon import LLM, SamplingParams
from axon.kernels import cpu_ops
from axon.layers import fused_decode, fused_moe_decode
from quant.gguf_files import build_gguf_model, write_gguf

from .tiny_models import ARCHS, engine_kwargs, get_tiny_model, random_prompts

pytestmark = pytest.mark.skipif(not cpu_ops.usable(), reason="no C compiler")
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
PROMPTS = random_prompts((1, 6, 19, 33), seed=5)


def _run_both(llm: LLM, monkeypatch) -> tuple[list, list, int]:
    """Outputs with the fused layer, without it, and how many layer calls took it."""
    calls = []
    real_run = fused_decode.run

    def counting_run(layer, positions, hidden):
        out = real_run(layer, positions, hidden)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fused_decode, "run", counting_run)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    fused = llm.generate(prompts, PARAMS)
    monkeypatch.setattr(fused_decode, "run", lambda layer, positions, hidden: None)
    llm.engine.reset_prefix_cache()
    unfused = llm.generate(prompts, PARAMS)
    return fused, unfused, sum(calls)


def _assert_identical(fused, unfused) -> None:
    for a, b in zip(fused, unfused, strict=True):
        got, want = a.outputs[0], b.outputs[0]
        assert got.token_ids == want.token_ids
        for step_a, step_b in zip(got.logprobs, want.logprobs, strict=True):
            assert {t: lp.logprob for t, lp in step_a.items()} == {
                t: lp.logprob for t, lp in step_b.items()
            }


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_layer_equals_the_layers_forward_on_safetensors(arch, tiny_model_root, monkeypatch):
    tiny = get_tiny_model(arch, tiny_model_root)
    llm = LLM(**engine_kwargs(tiny))
    fused, unfused, fused_calls = _run_both(llm, monkeypatch)
    layers = tiny.config.num_hidden_layers
    assert fused_calls >= layers * (PARAMS.max_tokens - 1)  # every decode step, every layer
    _assert_identical(fused, unfused)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_layer_equals_the_layers_forward_on_gguf(arch, tmp_path, monkeypatch):
    model = build_gguf_model(arch)
    path, _ = write_gguf(model, arch, Q.Q4_K, tmp_path / f"{arch}.gguf")
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory=1 << 24,
              activation_precision="float32")  # fmt: skip
    fused, unfused, fused_calls = _run_both(llm, monkeypatch)
    assert fused_calls >= model.config.num_hidden_layers * (PARAMS.max_tokens - 1)
    _assert_identical(fused, unfused)


def test_fused_layer_equals_the_layers_forward_with_a_float16_cache(tmp_path, monkeypatch):
    """int8 activations keep K / V in float16 (kv_cache_dtype auto): the fused layer writes and
    reads that cache through the same kernels as the layer's forward, to the bit."""
    model = build_gguf_model("qwen3")
    path, _ = write_gguf(model, "qwen3", Q.Q4_K, tmp_path / "qwen3.gguf")
    llm = LLM(model=str(path), max_model_len=256, kv_cache_memory=1 << 24,
              activation_precision="int8")  # fmt: skip
    assert llm.engine.runner.kv_cache.dtype == torch.float16
    fused, unfused, fused_calls = _run_both(llm, monkeypatch)
    assert fused_calls >= model.config.num_hidden_layers * (PARAMS.max_tokens - 1)
    _assert_identical(fused, unfused)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_a_float16_cache_keeps_the_float32_caches_outputs(arch, tiny_model_root):
    """kv_cache_dtype="float16" on the exact path: the cache holds half the bytes a token and
    the next-token distribution moves by float16 rounding of K / V only."""
    tiny = get_tiny_model(arch, tiny_model_root)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    results = {}
    for kv_dtype in ("float32", "float16"):
        llm = LLM(**engine_kwargs(tiny), kv_cache_dtype=kv_dtype)
        results[kv_dtype] = (llm.generate(prompts, params), llm.engine.runner)
    (exact, runner32), (half, runner16) = results["float32"], results["float16"]
    assert runner16.kv_cache.dtype == torch.float16 and runner32.kv_cache.dtype == torch.float32
    assert 2 * runner16.plan.bytes_per_token == runner32.plan.bytes_per_token
    for a, b in zip(exact, half, strict=True):
        want, got = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for token, logprob in want.items():
            if token in got:
                assert abs(got[token].logprob - logprob.logprob) < 2e-2


def test_the_fused_paths_reach_weights_only_through_decode_weights():
    """They read a layer through its `decode_weights()`, never by the attribute names a model
    keeps its modules under."""
    internals = r"self_attn|layernorm|\.mlp\b|is_sparse|_proj\b|rotary_emb"
    for module in (fused_decode, fused_moe_decode):
        assert not re.findall(internals, Path(module.__file__).read_text()), module.__name__
