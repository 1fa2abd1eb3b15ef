"""The prefix cache's disk tier under tensor parallelism (gloo, a real rank-1 subprocess): each
rank writes and reads its own shard of every block in its own directory, a restarted TP=2 engine
serves a known prefix from disk token for token as computed afresh, and a block is a hit only
when every rank has its shard."""

from __future__ import annotations

from pathlib import Path

import pytest

from axon import LLM, SamplingParams
from axon.cache.block_manager import chain_hash
from tests.model.tiny_models import get_tiny_model, random_prompts

BLOCK_SIZE = 4
ENGINE_ARGS = dict(
    dtype="float32",
    block_size=BLOCK_SIZE,
    max_model_len=128,
    kv_cache_memory=1 << 20,
    max_num_batched_tokens=16,
    tensor_parallel_size=2,
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return get_tiny_model("qwen3", tiny_model_root)


def _run(tiny, directory: Path, prompts) -> tuple[list[list[int]], dict, str]:
    """Greedy answers, stats and rank 0's store directory of a fresh TP=2 engine on `directory`,
    closed after (its ranks' queues written)."""
    llm = LLM(str(tiny.path), prefix_cache_dir=str(directory), **ENGINE_ARGS)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        stats, store_dir = llm.get_stats(), llm.engine.prefix_tiers.store.dir
    finally:
        llm.engine.close()
    return [list(o.outputs[0].token_ids) for o in outputs], stats, store_dir


def _block_name(prompt: list[int], index: int) -> str:
    parent = None
    for i in range(index + 1):
        parent = chain_hash(parent, tuple(prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
    return f"{parent.hex()}.kv"


def test_a_tp2_restart_serves_the_prefix_only_where_every_rank_has_it(tiny, tmp_path):
    prompts = random_prompts((41, 29), 31)  # ten and seven full prompt blocks
    fresh, stats, _ = _run(tiny, tmp_path, prompts)
    assert stats["prefix_disk_hits"] == 0

    directories = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(directories) == 2  # one per rank: the fingerprint names the rank
    names = [{f.name for f in d.glob("*.kv")} for d in directories]
    assert names[0] == names[1]
    assert {_block_name(prompts[0], i) for i in range(10)} <= names[0]

    restored, stats, rank0_dir = _run(tiny, tmp_path, prompts)
    assert restored == fresh
    assert stats["prefix_disk_hits"] == 40 + 28

    (rank1_dir,) = [d for d in directories if str(d) != rank0_dir]
    (rank1_dir / _block_name(prompts[0], 5)).unlink()  # rank 1 lacks block 5's shard
    restored, stats, _ = _run(tiny, tmp_path, prompts[:1])
    assert restored == fresh[:1]
    assert stats["prefix_disk_hits"] == 5 * BLOCK_SIZE


def test_a_tp2_engine_serves_an_evicted_prefix_from_every_ranks_host_memory(tiny):
    """Each rank keeps its shard of every block in its own memory; the prefix the KV cache
    evicted comes back from there, token for token as computed afresh."""
    prompt, *others = random_prompts((41, 41, 41), 33)
    small = dict(ENGINE_ARGS, max_model_len=64, max_num_seqs=1)
    small["kv_cache_memory"] = 16 * BLOCK_SIZE * tiny.kv_bytes_per_token() // 2  # 16 blocks
    llm = LLM(str(tiny.path), prefix_cache_host_size=16 << 20, **small)
    try:
        fresh = llm.generate([{"prompt_token_ids": prompt}], GREEDY)
        llm.generate([{"prompt_token_ids": p} for p in others], GREEDY)  # evict its blocks
        again = llm.generate([{"prompt_token_ids": prompt}], GREEDY)
        stats = llm.get_stats()
    finally:
        llm.engine.close()
    assert again[0].outputs[0].token_ids == fresh[0].outputs[0].token_ids
    assert stats["prefix_host_hits"] == 40
