"""`activation_precision` auto under tensor parallelism: rank 0 decides, before any rank
loads, and the other ranks load with its decision instead of resolving `auto` themselves
(a rank on another CPU could decide otherwise and run its shard in another precision)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from axon import LLM
from axon.config import EngineConfig
from axon.engine.engine_proc import engine_info
from axon.kernels import ggml_q8
from axon.loader import load_hf_config
from axon.runner import tensor_parallel
from quant.gguf_files import qwen3_gguf

ENGINE_ARGS = dict(dtype="float32", block_size=4, max_model_len=64, kv_cache_memory=1 << 20)


class Spawned(Exception):
    """Stands for the ranks' start: the test only reads what they would be given."""


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _ranks_config(path: str, monkeypatch, **kwargs) -> EngineConfig:
    """The EngineConfig that start_ranks hands the other ranks (their spawn intercepted)."""
    sent = []

    def spawn(local, target, args, timeout, rendezvous):
        sent.append(args[0])
        raise Spawned

    monkeypatch.setattr(tensor_parallel.TPWorkers, "spawn", spawn)
    config = EngineConfig(model=path, tensor_parallel_size=2, **ENGINE_ARGS, **kwargs)
    with pytest.raises(Spawned):
        tensor_parallel.start_ranks(config, load_hf_config(path), torch.device("cpu"))
    return sent[0]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.F16])
def test_the_decision_before_loading_is_the_one_loading_makes(gguf_dir, qtype):
    path = qwen3_gguf(gguf_dir, qtype)
    decided = tensor_parallel.auto_activation_precision(EngineConfig(model=path, **ENGINE_ARGS))
    loaded = LLM(path, **ENGINE_ARGS)
    assert decided == engine_info(loaded.engine)["activation_precision"]


@pytest.mark.parametrize("simd", [True, False])
def test_ranks_take_rank_0s_resolved_precision(gguf_dir, monkeypatch, simd):
    """Whatever rank 0's CPU decides is what the ranks get: a concrete value, never `auto`."""
    monkeypatch.setattr(ggml_q8, "simd", lambda: simd)
    sent = _ranks_config(qwen3_gguf(gguf_dir, Q.Q8_0), monkeypatch)
    assert sent.activation_precision == ("int8" if simd else "float32")


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_an_explicit_precision_reaches_the_ranks_as_given(gguf_dir, monkeypatch, precision):
    monkeypatch.setattr(ggml_q8, "simd", lambda: precision == "float32")  # the other way round
    sent = _ranks_config(qwen3_gguf(gguf_dir, Q.Q8_0), monkeypatch, activation_precision=precision)
    assert sent.activation_precision == precision


def test_float_weights_send_float32(gguf_dir, monkeypatch):
    monkeypatch.setattr(ggml_q8, "simd", lambda: True)
    assert _ranks_config(qwen3_gguf(gguf_dir, Q.F16), monkeypatch).activation_precision == "float32"


@pytest.mark.skipif(not ggml_q8.simd(), reason="no 8-bit SIMD kernels on this CPU")
def test_two_ranks_on_auto_run_int8_like_one(gguf_dir):
    """A real rank 1 given rank 0's `int8`: the pair's logits are the single rank's, up to the
    order of the all-reduce's sums."""
    path, prompts = qwen3_gguf(gguf_dir, Q.Q8_0), [[5, 9, 13, 200, 7], [3, 4]]
    want = LLM(path, **ENGINE_ARGS).engine.forward_logits(prompts)
    pair = LLM(path, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        assert engine_info(pair.engine)["activation_precision"] == "int8"
        got = pair.engine.forward_logits(prompts)
    finally:
        pair.engine.close()
    for have, expected in zip(got, want, strict=True):
        torch.testing.assert_close(have, expected, rtol=0, atol=1e-4)
