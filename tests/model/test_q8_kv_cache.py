"""kv_cache_dtype="q8_0" through the real engine on tiny models (Qwen3, Gemma 3 with its sliding
layers, Qwen3.5's gated attention beside Gated DeltaNet, Qwen3-VL with images): the cache
holds uint8 q8_0 rows and about half float16's bytes a token, greedy output starts as the
float32 cache's with the next-token log-probabilities moved by the quantization only (a top-two
tie within that may break either way), the C kernels equal the PyTorch
twin (the layers' pure-PyTorch path), the fused decode layer equals the layer's forward to the
bit, and fp8_e4m3 on the CPU is a ValueError naming the setting."""

from __future__ import annotations

import pytest
import torch

from axon import LLM, SamplingParams
from axon.cli import build_parser, engine_args_from_namespace
from axon.config import EngineConfig
from axon.kernels import cpu_ops
from axon.layers import fused_decode
from axon.server.schemas.node_protocol import ModelSpec

from .qwen3_5_tiny import get_qwen3_5, qwen3_5_engine_kwargs
from .test_fused_decode import _assert_identical, _run_both
from .test_qwen3_vl import CASES, _llm, _request
from .test_qwen3_vl import tiny as tiny  # the Qwen3-VL fixture
from .tiny_models import engine_kwargs, get_tiny_model, random_prompts

pytestmark = pytest.mark.skipif(not cpu_ops.usable(), reason="no C compiler")
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts((1, 6, 19, 40, 70), seed=9)]
FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
# Next-token log-probabilities of a q8_0 cache vs a float32 one on these tiny models: measured
# up to 0.045 (qwen3, gemma3; 0.002 on qwen3.5), where a float16 cache moves them by up to 0.002:
# q8_0 keeps 8 bits a value against float16's 11. The bound leaves about 3x.
LOGPROB_ATOL = 0.15
ARCHS = ("qwen3", "gemma3_text", "qwen3_5")


def _kwargs(arch: str, root, **overrides) -> dict:
    if arch == "qwen3_5":
        return qwen3_5_engine_kwargs(get_qwen3_5(arch, root), **overrides)
    return engine_kwargs(get_tiny_model(arch, root), **overrides)


def _close_first_tokens(got, want, atol: float) -> None:
    """The same first token, unless the float cache's top two are within atol (a tie the
    quantization may break either way), and every shared log-probability within atol."""
    for a, b in zip(want, got, strict=True):
        expected, actual = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        top = sorted((logprob.logprob for logprob in expected.values()), reverse=True)
        if top[0] - top[1] > atol:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for token, logprob in expected.items():
            if token in actual:
                assert abs(actual[token].logprob - logprob.logprob) < atol


@pytest.mark.parametrize("arch", ARCHS)
def test_a_q8_cache_keeps_the_float32_caches_first_tokens(arch, tiny_model_root):
    results = {}
    for kv_dtype in ("float32", "q8_0"):
        llm = LLM(**_kwargs(arch, tiny_model_root, kv_cache_dtype=kv_dtype))
        results[kv_dtype] = (llm.generate(PROMPTS, FIRST), llm.engine.runner)
    (exact, runner32), (quantized, runner8) = results["float32"], results["q8_0"]
    assert runner8.kv_cache.dtype == torch.uint8 and runner32.kv_cache.dtype == torch.float32
    # tiny heads of 16 / 32 channels: one scale a head, head_dim + 2 bytes (4 * head_dim in f32)
    head_dim = runner32.kv_cache.shape[-1]
    assert runner8.kv_cache.shape[-1] == head_dim + 2
    assert runner8.plan.bytes_per_token * 4 * head_dim == runner32.plan.bytes_per_token * (
        head_dim + 2
    )
    _close_first_tokens(quantized, exact, LOGPROB_ATOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_c_kernels_equal_the_pytorch_twin_on_a_q8_cache(arch, tiny_model_root, monkeypatch):
    """Greedy continuations with the C kernels, then with every layer on its PyTorch path
    (cpu_ops unusable): the same q8_0 bytes written, the same attention up to float32 rounding."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    fast = LLM(**_kwargs(arch, tiny_model_root, kv_cache_dtype="q8_0")).generate(PROMPTS, params)
    monkeypatch.setattr(cpu_ops, "usable", lambda *tensors: False)
    monkeypatch.setattr(cpu_ops, "cache_usable", lambda cache: False)
    twin = LLM(**_kwargs(arch, tiny_model_root, kv_cache_dtype="q8_0")).generate(PROMPTS, params)
    for a, b in zip(fast, twin, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for token, logprob in step_b.items():
                assert abs(step_a[token].logprob - logprob.logprob) < 1e-3


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_fused_layer_equals_the_layers_forward_with_a_q8_cache(arch, tiny_model_root, monkeypatch):
    llm = LLM(**_kwargs(arch, tiny_model_root, kv_cache_dtype="q8_0"))
    fused, unfused, fused_calls = _run_both(llm, monkeypatch)
    assert fused_calls > 0 and fused_decode.run is not None
    _assert_identical(fused, unfused)


def test_fp8_on_the_cpu_is_an_error_naming_the_setting(tiny_model_root):
    kwargs = _kwargs("qwen3", tiny_model_root, kv_cache_dtype="fp8_e4m3", device="cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3 needs a GPU.*q8_0"):
        LLM(**kwargs)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3 needs a GPU"):
            LLM(**{**kwargs, "device": "auto"})


def test_q8_0_is_one_name_at_every_entry_point():
    config = EngineConfig(model="m.gguf", kv_cache_dtype="q8_0")
    assert config.kv_torch_dtype(torch.float32) == torch.uint8
    assert ModelSpec(model_id="m", kv_cache_dtype="q8_0").engine_args() == {
        "kv_cache_dtype": "q8_0"
    }
    argv = ["generate", "--model", "m.gguf", "--prompt", "hi", "--kv-cache-dtype", "q8_0"]
    assert engine_args_from_namespace(build_parser().parse_args(argv))["kv_cache_dtype"] == "q8_0"
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of .*'q8_0'"):
        EngineConfig(model="m.gguf", kv_cache_dtype="q4_0")


def test_qwen3_vl_with_a_q8_cache_keeps_the_first_tokens(tiny):
    """Qwen3-VL (M-RoPE, image rows in the prompt): the q8_0 cache as the float32 one."""
    requests = [_request(*CASES[name]) for name in ("one_image", "two_images", "text_only")]
    exact = _llm(tiny).generate(requests, FIRST)
    quantized = _llm(tiny, kv_cache_dtype="q8_0").generate(requests, FIRST)
    _close_first_tokens(quantized, exact, LOGPROB_ATOL)
