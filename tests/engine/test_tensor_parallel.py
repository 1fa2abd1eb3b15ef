"""Tensor parallelism on CPU (gloo, a real rank-1 subprocess): TP=2 computes what TP=1 does,
through the batched, paged, chunked engine, with each rank holding only its shard."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest
import torch

from axon import LLM, SamplingParams
from axon.loader.safetensors import iterate_safetensors
from tests.model.tiny_models import get_tiny_model, random_prompts

# A small token budget chunks the longer prompts; 4-token blocks page them.
ENGINE_ARGS = dict(
    dtype="float32",
    block_size=4,
    max_model_len=128,
    kv_cache_memory=1 << 20,
    max_num_batched_tokens=16,
)
PROMPT_LENGTHS = (9, 21, 30, 5)


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return get_tiny_model("qwen3", tiny_model_root)  # 4 heads over 2 KV heads, tied embeddings


@pytest.fixture(scope="module")
def single(tiny):
    return LLM(str(tiny.path), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def pair(tiny):
    llm = LLM(str(tiny.path), tensor_parallel_size=2, **ENGINE_ARGS)
    yield llm
    llm.engine.close()


def test_single_rank_spawns_nothing(tiny):
    before = set(multiprocessing.active_children())
    llm = LLM(str(tiny.path), **ENGINE_ARGS)
    assert llm.engine.runner.workers is None
    assert set(multiprocessing.active_children()) == before
    o_proj = llm.engine.runner.model.model.layers[0].self_attn.o_proj
    assert o_proj.tp_size == 1


def test_each_rank_holds_its_shard(pair, single):
    full = single.engine.runner.model.model.layers[0]
    half = pair.engine.runner.model.model.layers[0]
    assert half.self_attn.num_heads == 2 and half.self_attn.num_kv_heads == 1
    # Rank 0's rows of q, then k and v: the first head of each.
    q_rows, kv_rows = 2 * 32, 32
    full_qkv, half_qkv = full.self_attn.qkv_proj.weight, half.self_attn.qkv_proj.weight
    assert half_qkv.shape == (q_rows + 2 * kv_rows, 64)
    assert torch.equal(half_qkv[:q_rows], full_qkv[:q_rows])
    assert torch.equal(half_qkv[q_rows : q_rows + kv_rows], full_qkv[2 * q_rows : 2 * q_rows + 32])
    # The row-parallel down projection: rank 0 holds the first half of its input columns.
    assert torch.equal(half.mlp.down_proj.weight, full.mlp.down_proj.weight[:, :64])
    # The KV cache holds this rank's KV head only: the same per-rank budget holds twice the
    # tokens of the single rank's.
    assert pair.engine.runner.kv_cache.shape[-2] == 1
    assert pair.engine.runner.plan.bytes_per_token * 2 == single.engine.runner.plan.bytes_per_token


def test_logits_equal_single_rank(pair, single):
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    expected = single.engine.forward_logits(prompts)
    got = pair.engine.forward_logits(prompts)
    for want, have in zip(expected, got):
        assert want.shape == have.shape == (single.engine.runner.vocab_size,)
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5)


def test_greedy_tokens_equal_single_rank(pair, single):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(PROMPT_LENGTHS, seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in pair.generate(prompts, params)]
    assert got == expected
    assert all(len(tokens) == 16 for tokens in got)


def test_indivisible_heads_are_named(tiny):
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by "):
        LLM(str(tiny.path), tensor_parallel_size=3, **ENGINE_ARGS)


def test_checkpoint_slice_reads_its_part(tiny):
    sliced = dict(iterate_safetensors(tiny.path, sliced=True))
    name = "model.layers.0.mlp.down_proj.weight"
    whole = dict(iterate_safetensors(tiny.path))[name]
    part = sliced[name].narrow(1, 64, 64).narrow(0, 8, 16).to(torch.float64)
    assert part.shape == (16, 64)
    torch.testing.assert_close(part.materialize(), whole[8:24, 64:128].double(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside shape"):
        sliced[name].narrow(1, 100, 64)


def test_a_second_group_in_one_process_is_refused(pair, tiny):
    with pytest.raises(ValueError, match="one tensor-parallel engine per process"):
        LLM(str(tiny.path), tensor_parallel_size=2, **ENGINE_ARGS)


@pytest.mark.gpu
def test_tp_smoke_nccl_group_on_one_device():
    """A TP=1 NCCL group on the first GPU: spawn, init, all-reduce sanity, shut down."""
    result = subprocess.run(
        [sys.executable, "-m", "axon", "tp-smoke", "--tp-size", "1", "--devices", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "status=ok tp_size=1" in result.stdout
