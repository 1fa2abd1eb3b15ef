"""`activation_precision` auto, the default, resolves per model once it is loaded: int8 for
quantized GGUF weights on a CPU where the 8-bit kernels have their SIMD path, float32 for float
weights; float32 and int8 asked for keep their meaning; engine_info (what /models shows) says
which precision is in effect."""

from __future__ import annotations

import platform

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from axon import LLM
from axon.engine.engine_proc import engine_info
from axon.kernels import build, ggml_cpu, ggml_q8
from model.tiny_models import engine_kwargs, get_tiny_model
from quant.gguf_files import qwen3_gguf

ENGINE_ARGS = dict(dtype="float32", block_size=4, max_model_len=64, kv_cache_memory=1 << 20)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _in_effect(llm: LLM) -> tuple[str, bool, torch.dtype]:
    """(engine_info's precision, whether a quantized matmul runs 8-bit, the KV cache's dtype)"""
    runner = llm.engine.runner
    down = runner.model.model.layers[0].mlp.down_proj.quantized
    int8 = down is not None and down.parts["None"].int8
    return engine_info(llm.engine)["activation_precision"], int8, runner.kv_cache.dtype


def test_a_quantized_gguf_defaults_to_int8_where_the_kernels_run(gguf_dir):
    llm = LLM(qwen3_gguf(gguf_dir, Q.Q4_K), **ENGINE_ARGS)

    fast = ggml_q8.simd()
    if fast:
        assert _in_effect(llm) == ("int8", True, torch.float16)  # llama.cpp's F16 cache too
    else:
        assert _in_effect(llm) == ("float32", False, torch.float32)
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if x86 and "avx2" in build.cpu_flags().split() and ggml_cpu.available():
        assert fast and _in_effect(llm)[0] == "int8"


def test_explicit_float32_stays_float32_on_a_quantizedqwen3_gguf(gguf_dir):
    llm = LLM(qwen3_gguf(gguf_dir, Q.Q4_K), activation_precision="float32", **ENGINE_ARGS)
    assert _in_effect(llm) == ("float32", False, torch.float32)


@pytest.mark.skipif(not ggml_q8.simd(), reason="no 8-bit SIMD kernels on this CPU")
def test_explicit_int8_and_auto_are_the_same_engine(gguf_dir):
    path = qwen3_gguf(gguf_dir, Q.Q8_0)
    prompts = [[5, 9, 13, 200, 7], [3, 4]]
    auto = LLM(path, **ENGINE_ARGS).engine.forward_logits(prompts)
    int8 = LLM(path, activation_precision="int8", **ENGINE_ARGS).engine.forward_logits(prompts)
    for a, b in zip(auto, int8, strict=True):
        assert torch.equal(a, b)


def test_float_weights_default_to_float32(gguf_dir, tiny_model_root):
    safetensors = LLM(**engine_kwargs(get_tiny_model("qwen3", tiny_model_root)))
    assert engine_info(safetensors.engine)["activation_precision"] == "float32"
    assert safetensors.engine.runner.kv_cache.dtype == torch.float32
    f16_gguf = LLM(qwen3_gguf(gguf_dir, Q.F16), **ENGINE_ARGS)  # float weights in a GGUF
    assert _in_effect(f16_gguf) == ("float32", False, torch.float32)
