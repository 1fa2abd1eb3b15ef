"""The prefix cache's host-memory tier (`prefix_cache_host_size`), in front of the disk tier or
alone: a prefix the KV cache evicted comes back from host memory, token for token as a cold
engine computes it; a block read from disk is kept in memory; memory keeps the most recently used
blocks under its cap; a reset forgets memory, not the files. The tier is meant for GPUs (the KV
cache in device memory); its logic is the device's copy aside the same on the CPU, tested here."""

from __future__ import annotations

import pytest

from axon import LLM, SamplingParams
from axon.cache.disk_prefix import DiskPrefixStore
from axon.cache.host_prefix import HostPrefixStore
from tests.model.qwen3_5_tiny import any_engine_kwargs
from tests.model.tiny_models import random_prompt, random_prompts

BLOCK_SIZE = 4
PROMPT_LENGTH = 41  # ten full blocks and one token: a hit covers 40
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# 16 blocks: one sequence (14 blocks with its answer) at a time, and the next one evicts it
SMALL = dict(kv_cache_blocks=16, max_model_len=64, max_num_seqs=1)
HOST_BYTES = 64 << 20


def _kwargs(tiny, **overrides) -> dict:
    # a hybrid model: a snapshot at every block, and a pool of 4 the evicting prompts take over
    return any_engine_kwargs(
        tiny, block_size=BLOCK_SIZE, num_state_snapshots=4, **SMALL, **overrides
    )


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _evict(llm: LLM, seed: int = 99) -> None:
    """Run new prompts that take every KV block (and snapshot) over from the earlier ones."""
    _generate(llm, random_prompts((PROMPT_LENGTH,) * 2, seed))


def test_an_evicted_prefix_comes_back_from_host_memory_exactly(any_tiny):
    prompt = random_prompt(PROMPT_LENGTH, 7)
    follow_up = prompt + random_prompt(9, 8)
    cold = _generate(LLM(**_kwargs(any_tiny, enable_prefix_caching=False)), [prompt, follow_up])
    llm = LLM(**_kwargs(any_tiny, prefix_cache_host_size=HOST_BYTES))
    assert _generate(llm, [prompt]) == cold[:1]
    _evict(llm)

    before = llm.get_stats()
    got = _generate(llm, [prompt])
    stats = llm.get_stats()
    got += _generate(llm, [follow_up])  # its prefix now in the KV cache: no host read

    assert got == cold
    assert before["prefix_host_hits"] == 0
    assert stats["prefix_host_hits"] == PROMPT_LENGTH - 1
    assert stats["prefix_cache_hits"] - before["prefix_cache_hits"] == PROMPT_LENGTH - 1
    assert llm.get_stats()["prefix_host_hits"] == PROMPT_LENGTH - 1
    assert "prefix_disk_hits" not in stats  # no disk tier asked for
    if any_tiny.arch.startswith("qwen3_5"):
        assert stats["prefix_host_snapshots_loaded"] >= 1


def test_host_memory_in_front_of_the_disk(qwen3, tmp_path):
    """Memory serves what it holds; after a restart the disk does, and what it read is then
    kept in memory; a reset forgets memory and leaves the files."""
    prompt = random_prompt(PROMPT_LENGTH, 17)
    cold = _generate(LLM(**_kwargs(qwen3, enable_prefix_caching=False)), [prompt])
    both = dict(prefix_cache_host_size=HOST_BYTES, prefix_cache_dir=str(tmp_path))
    first = LLM(**_kwargs(qwen3, **both))
    _generate(first, [prompt])
    _evict(first)
    assert _generate(first, [prompt]) == cold
    stats = first.get_stats()
    assert (stats["prefix_host_hits"], stats["prefix_disk_hits"]) == (PROMPT_LENGTH - 1, 0)
    first.engine.prefix_tiers.flush()
    first.engine.close()

    restarted = LLM(**_kwargs(qwen3, **both))
    assert _generate(restarted, [prompt]) == cold
    stats = restarted.get_stats()
    assert (stats["prefix_host_hits"], stats["prefix_disk_hits"]) == (0, PROMPT_LENGTH - 1)
    _evict(restarted, seed=98)  # prompts the disk does not know
    assert _generate(restarted, [prompt]) == cold
    stats = restarted.get_stats()
    assert (stats["prefix_host_hits"], stats["prefix_disk_hits"]) == (40, 40)

    restarted.engine.reset_prefix_cache()
    assert restarted.get_stats()["prefix_host_bytes"] == 0
    assert _generate(restarted, [prompt]) == cold
    stats = restarted.get_stats()
    assert (stats["prefix_host_hits"], stats["prefix_disk_hits"]) == (40, 80)


def test_a_cap_over_the_hosts_memory_is_refused(qwen3):
    with pytest.raises(ValueError, match="prefix_cache_host_size .* available memory"):
        LLM(**_kwargs(qwen3, prefix_cache_host_size=1 << 60))


@pytest.mark.gpu
def test_on_a_gpu_the_tiers_are_device_host_disk(qwen3, tmp_path):
    """The KV cache in device memory: evicted blocks come back from host memory, and after a
    restart from disk, token for token as computed afresh on the same device."""
    prompt = random_prompt(PROMPT_LENGTH, 27)
    cuda = dict(device="cuda", prefix_cache_host_size=HOST_BYTES, prefix_cache_dir=str(tmp_path))
    cold = _generate(LLM(**_kwargs(qwen3, device="cuda", enable_prefix_caching=False)), [prompt])
    first = LLM(**_kwargs(qwen3, **cuda))
    _generate(first, [prompt])
    _evict(first)
    assert _generate(first, [prompt]) == cold
    assert first.get_stats()["prefix_host_hits"] == PROMPT_LENGTH - 1
    first.engine.prefix_tiers.flush()
    first.engine.close()
    restarted = LLM(**_kwargs(qwen3, **cuda))
    assert _generate(restarted, [prompt]) == cold
    assert restarted.get_stats()["prefix_disk_hits"] == PROMPT_LENGTH - 1


def test_memory_keeps_the_most_recently_used_under_its_cap():
    store = HostPrefixStore(max_bytes=250)
    payloads = {name: bytes([i]) * 100 for i, name in enumerate((b"a", b"b", b"c"))}
    buffer = bytearray(100)
    store.put("kv", b"a", bytearray(payloads[b"a"]))
    store.put("kv", b"b", payloads[b"b"])
    assert store.read_into("kv", b"a", buffer) == "host"  # now the most recently used
    store.put("kv", b"c", payloads[b"c"])

    assert [store.contains("kv", h) for h in (b"a", b"b", b"c")] == [True, False, True]
    assert store.read_into("kv", b"b", buffer) is None
    assert not store.contains("state", b"a")  # kinds are kept apart
    assert store.read_into("kv", b"a", buffer) == "host" and bytes(buffer) == payloads[b"a"]
    assert store.stats()["prefix_host_bytes"] == 200
    assert store.stats()["prefix_host_blocks_evicted"] == 1
    assert store.read_into("kv", b"c", bytearray(99)) is None  # not the block's length

    store.put("kv", b"big", bytes(251))  # more than the whole cap: not kept, nothing evicted
    assert not store.contains("kv", b"big") and store.stats()["prefix_host_bytes"] == 200


def test_a_block_is_copied_in_and_queued_for_the_disk_where_it_lacks_it(tmp_path):
    first, second = b"a" * 32, b"b" * 32  # sha256-sized block hashes, as the files hold
    disk = DiskPrefixStore(str(tmp_path), bytes(32), max_bytes=1 << 20)
    store = HostPrefixStore(max_bytes=100, disk=disk)
    payload = bytearray(b"x" * 100)
    assert store.needs("kv", first)
    store.put("kv", first, payload)
    payload[:] = b"y" * 100  # the caller reuses its buffer: memory kept a copy
    store.flush()
    assert not store.needs("kv", first)  # in memory and on disk

    store.put("kv", second, b"z" * 100)  # evicts the first from memory, not from disk
    store.flush()
    assert store.needs("kv", second) is False and store.contains("kv", first)
    buffer = bytearray(100)
    assert store.read_into("kv", first, buffer) == "disk" and bytes(buffer) == b"x" * 100
    assert store.read_into("kv", first, buffer) == "host"  # kept in memory by the disk read
    assert store.stats()["prefix_disk_blocks_written"] == 2
    store.close()
