"""The prefix cache's disk tier (`prefix_cache_dir`) through real engines: a second `LLM` on the
same directory (a restart) serves a known prefix from disk, token for token as a cold engine
computes it; damaged, partial and foreign files are removed, never loaded; a directory that
cannot be written costs caching, not requests; engines sharing a directory leave valid files."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import axon
from axon import LLM, SamplingParams
from axon.cache import disk_prefix
from axon.cache.disk_prefix import HEADER_SIZE, DiskPrefixStore
from tests.model.qwen3_5_tiny import any_engine_kwargs
from tests.model.tiny_models import random_prompt, random_prompts

BLOCK_SIZE = 4
PROMPT_LENGTH = 41  # ten full blocks and one token: the hit covers 40
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _kwargs(tiny, **overrides) -> dict:
    # a hybrid model: a state snapshot at every block (stride 1), so a hit may end at any block
    return any_engine_kwargs(tiny, block_size=BLOCK_SIZE, num_state_snapshots=64, **overrides)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _written(tiny, directory: Path, prompts) -> LLM:
    """An engine that computed `prompts` and wrote their blocks to `directory`."""
    llm = LLM(**_kwargs(tiny, prefix_cache_dir=str(directory)))
    _generate(llm, prompts)
    llm.engine.prefix_tiers.flush()
    return llm


def _files(directory: Path, suffix: str = ".kv") -> list[Path]:
    return sorted(directory.glob(f"*/*{suffix}"))


def _block_file(llm: LLM, prompt: list[int], index: int) -> Path:
    """The file of block `index` of `prompt` in `llm`'s store."""
    from axon.cache.block_manager import chain_hash

    parent = None
    for i in range(index + 1):
        parent = chain_hash(parent, tuple(prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
    return Path(llm.engine.prefix_tiers.store.path("kv", parent))


def test_restart_serves_the_prefix_from_disk_exactly(any_tiny, tmp_path):
    prompt = random_prompt(PROMPT_LENGTH, 7)
    follow_up = prompt + random_prompt(9, 8)  # a longer prompt with the same prefix
    cold = _generate(LLM(**_kwargs(any_tiny, enable_prefix_caching=False)), [prompt, follow_up])
    first = _written(any_tiny, tmp_path, [prompt])
    assert _files(tmp_path)
    if any_tiny.arch.startswith("qwen3_5"):
        assert _files(tmp_path, ".state"), "no state snapshot saved"
    del first

    restarted = LLM(**_kwargs(any_tiny, prefix_cache_dir=str(tmp_path)))
    got = _generate(restarted, [prompt])
    stats = restarted.get_stats()
    got += _generate(restarted, [follow_up])

    assert got == cold
    assert stats["prefix_disk_hits"] == PROMPT_LENGTH - 1
    assert stats["prefix_cache_hits"] == PROMPT_LENGTH - 1
    assert stats["num_prompt_tokens"] == 1  # only the last prompt token computed
    if any_tiny.arch.startswith("qwen3_5"):
        assert stats["prefix_disk_snapshots_loaded"] >= 1
        assert stats["state_snapshot_restores"] >= 1


def test_a_prefix_part_in_memory_part_on_disk(any_tiny, tmp_path):
    """The blocks memory holds are used, the ones after them read from disk."""
    prompt = random_prompt(PROMPT_LENGTH, 14)
    head = prompt[:21] + random_prompt(6, 15)  # shares five blocks with `prompt`
    cold = _generate(LLM(**_kwargs(any_tiny, enable_prefix_caching=False)), [head, prompt])
    _written(any_tiny, tmp_path, [prompt])
    llm = LLM(**_kwargs(any_tiny, prefix_cache_dir=str(tmp_path)))

    got = _generate(llm, [head])
    loaded = llm.get_stats()["prefix_disk_hits"]
    got += _generate(llm, [prompt])

    assert got == cold
    assert loaded == 20
    stats = llm.get_stats()
    assert stats["prefix_disk_hits"] - loaded == PROMPT_LENGTH - 1 - 20
    assert stats["prefix_cache_hits"] == 20 + PROMPT_LENGTH - 1


def test_a_prompt_longer_than_half_the_cache_is_restored_whole(qwen3, tmp_path):
    """A restarted session's whole history comes from disk: its prefix blocks are blocks its
    prompt takes anyway, not a share of the cache kept for new tokens."""
    prompt = random_prompt(PROMPT_LENGTH, 16)  # 11 of the 16 blocks, 12 with its answer
    small = dict(kv_cache_blocks=16, max_model_len=64, max_num_seqs=1)
    cold = _generate(LLM(**_kwargs(qwen3, enable_prefix_caching=False, **small)), [prompt])
    _written(qwen3, tmp_path, [prompt])
    restarted = LLM(**_kwargs(qwen3, prefix_cache_dir=str(tmp_path), **small))
    assert _generate(restarted, [prompt]) == cold
    assert restarted.get_stats()["prefix_disk_hits"] == PROMPT_LENGTH - 1


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated", "foreign-fingerprint"])
def test_a_bad_file_is_removed_and_not_loaded(qwen3, tmp_path, damage):
    prompt = random_prompt(PROMPT_LENGTH, 9)
    cold = _generate(LLM(**_kwargs(qwen3, enable_prefix_caching=False)), [prompt])
    writer = _written(qwen3, tmp_path, [prompt])
    bad = _block_file(writer, prompt, 3)
    data = bytearray(bad.read_bytes())
    if damage == "flipped-byte":
        data[HEADER_SIZE + 5] ^= 0x01
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:  # a whole, checksummed file, written for another model under the same name
        data[12:44] = hashlib.sha256(b"another model").digest()
    bad.write_bytes(bytes(data))

    reader = LLM(**_kwargs(qwen3, prefix_cache_dir=str(tmp_path)))
    got = _generate(reader, [prompt])

    assert got == cold
    reader.engine.prefix_tiers.flush()  # the block, computed again, written again: whole
    store = reader.engine.prefix_tiers.store
    assert bad.read_bytes() != bytes(data)
    width = reader.engine.prefix_tiers.copier.block_bytes
    assert store.read_into("kv", bytes.fromhex(bad.stem), bytearray(width))
    stats = reader.get_stats()
    assert stats["prefix_disk_files_rejected"] == 1
    assert stats["prefix_disk_hits"] == 3 * BLOCK_SIZE  # the blocks before the bad one


def test_another_dtype_is_another_fingerprint(qwen3, tmp_path):
    prompt = random_prompt(PROMPT_LENGTH, 10)
    _written(qwen3, tmp_path, [prompt])
    half = LLM(**_kwargs(qwen3, prefix_cache_dir=str(tmp_path), kv_cache_dtype="float16"))
    cold = _generate(LLM(**_kwargs(qwen3, kv_cache_dtype="float16")), [prompt])
    assert _generate(half, [prompt]) == cold
    half.engine.prefix_tiers.flush()
    assert half.get_stats()["prefix_disk_hits"] == 0  # the float32 blocks are not its own
    assert len({path.parent for path in _files(tmp_path)}) == 2


def test_a_q8_0_cache_restores_exactly(qwen3, tmp_path):
    """The 8-bit cache's blocks (int8 values and their scales in one byte row) go to disk and
    come back as they were: greedy output equals a cold q8_0 engine's."""
    prompt = random_prompt(PROMPT_LENGTH, 11)
    q8 = {"kv_cache_dtype": "q8_0"}
    cold = _generate(LLM(**_kwargs(qwen3, enable_prefix_caching=False, **q8)), [prompt])
    first = LLM(**_kwargs(qwen3, prefix_cache_dir=str(tmp_path), **q8))
    _generate(first, [prompt])
    first.engine.prefix_tiers.flush()
    restarted = LLM(**_kwargs(qwen3, prefix_cache_dir=str(tmp_path), **q8))
    assert _generate(restarted, [prompt]) == cold
    assert restarted.get_stats()["prefix_disk_hits"] == PROMPT_LENGTH - 1


def _not_writable(caplog, directory: Path) -> list:
    """The warnings that the store under `directory` stopped writing."""
    return [
        r for r in caplog.records
        if "not writable" in r.getMessage() and str(directory) in r.getMessage()
    ]  # fmt: skip


def test_a_full_disk_turns_writing_off_with_one_warning(qwen3, tmp_path, monkeypatch, caplog):
    def full(path, header, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_prefix, "_write_file", full)
    prompts = random_prompts((PROMPT_LENGTH, 30), 11)
    cold = _generate(LLM(**_kwargs(qwen3, enable_prefix_caching=False)), prompts)
    llm = LLM(**_kwargs(qwen3, prefix_cache_dir=str(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="axon.cache.disk_prefix"):
        got = [_generate(llm, [p])[0] for p in prompts]
        llm.engine.prefix_tiers.flush()
    assert got == cold
    assert len(_not_writable(caplog, tmp_path)) == 1
    assert not _files(tmp_path)
    assert not list(tmp_path.glob("*/.tmp-*"))  # the failed write's temporary is gone
    assert llm.get_stats()["prefix_disk_blocks_written"] == 0


def test_an_unwritable_directory_degrades_with_a_warning(qwen3, tmp_path, caplog):
    # A path under a plain file cannot be created by anyone, root included (a read-only mode
    # would not stop root, whom CI runs as).
    (tmp_path / "file").write_text("")
    directory = tmp_path / "file" / "cache"
    prompt = random_prompt(PROMPT_LENGTH, 12)
    cold = _generate(LLM(**_kwargs(qwen3, enable_prefix_caching=False)), [prompt])
    with caplog.at_level(logging.WARNING, logger="axon.cache.disk_prefix"):
        llm = LLM(**_kwargs(qwen3, prefix_cache_dir=str(directory)))
        assert _generate(llm, [prompt]) == cold
        llm.engine.prefix_tiers.flush()
    assert len(_not_writable(caplog, tmp_path)) == 1
    assert llm.get_stats()["prefix_disk_blocks_written"] == 0


def _writable_again(caplog, directory: Path) -> list:
    return [r for r in caplog.records if "writable again" in r.getMessage()
            and str(directory) in r.getMessage()]  # fmt: skip


def test_writing_resumes_once_the_directory_is_writable_again(qwen3, tmp_path, caplog):
    prompts = random_prompts((PROMPT_LENGTH,) * 3, 15)
    cold = _generate(LLM(**_kwargs(qwen3, enable_prefix_caching=False)), prompts)
    llm = LLM(**_kwargs(qwen3, prefix_cache_dir=str(tmp_path)))
    tier = llm.engine.prefix_tiers
    tier.store.retry_min_s = 0.0  # try again at every block offered
    # A plain file where the directory was: nobody, root included, writes under it.
    shutil.rmtree(tier.store.dir)
    Path(tier.store.dir).write_text("")
    with caplog.at_level(logging.WARNING, logger="axon.cache.disk_prefix"):
        assert _generate(llm, prompts[:1]) == cold[:1]
        tier.flush()
        assert not tier.store.writable
        os.remove(tier.store.dir)
        # While one block probes the directory, the others are dropped: the next prompt is
        # offered only once the probe has found it writable.
        assert _generate(llm, prompts[1:2]) == cold[1:2]
        tier.flush()
        assert tier.store.writable
        assert _generate(llm, prompts[2:]) == cold[2:]
        tier.flush()
    assert len(_not_writable(caplog, tmp_path)) == 1
    assert len(_writable_again(caplog, tmp_path)) == 1
    assert all(_block_file(llm, prompts[2], index).exists() for index in range(10))
    restarted = LLM(**_kwargs(qwen3, prefix_cache_dir=str(tmp_path)))
    assert _generate(restarted, prompts[2:]) == cold[2:]
    assert restarted.get_stats()["prefix_disk_hits"] == PROMPT_LENGTH - 1


@pytest.fixture
def small_filesystem(tmp_path):
    """A 64 KiB tmpfs (root only: skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]
    if os.geteuid() != 0 or subprocess.run(command, capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_filesystem_stops_writing_and_space_back_resumes_it(small_filesystem, caplog):
    store = DiskPrefixStore(str(small_filesystem), bytes(32), max_bytes=1 << 30)
    store.retry_min_s = 0.0
    payload = bytes(range(256)) * 48  # 12 KiB: five fit in 64 KiB, not six
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="axon.cache.disk_prefix"):
        for block_hash in hashes[:7]:
            store.put("kv", block_hash, payload)
            store.flush()
        assert not store.writable
        assert not list(small_filesystem.glob("*/.tmp-*"))  # the torn write is gone
        written = [h for h in hashes[:7] if os.path.exists(store.path("kv", h))]
        assert 0 < len(written) < 7
        for block_hash in written:
            os.remove(store.path("kv", block_hash))
        assert store.put("kv", hashes[7], payload)
        store.flush()
    assert store.writable
    assert store.read_into("kv", hashes[7], bytearray(len(payload)))
    assert len(_not_writable(caplog, small_filesystem)) == 1
    assert len(_writable_again(caplog, small_filesystem)) == 1
    store.close()


_WRITER = """
import json, sys
import axon
from axon import LLM, SamplingParams
kwargs, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = LLM(**kwargs)
llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4))
llm.engine.close()  # writes what is queued
"""


def test_two_processes_writing_one_directory_leave_valid_files(qwen3, tmp_path):
    shared = random_prompt(24, 13)
    prompts = [shared + p for p in random_prompts((20, 17, 25, 9, 30, 14), 13)]
    kwargs = json.dumps(_kwargs(qwen3, prefix_cache_dir=str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": str(Path(axon.__file__).parents[1])}
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, kwargs, json.dumps(order)], env=env)
        for order in (prompts, prompts[::-1])
    ]
    assert [writer.wait(timeout=300) for writer in writers] == [0, 0]

    files = _files(tmp_path)
    assert len(files) > 20
    assert not list(tmp_path.glob("*/.tmp-*"))
    reader = LLM(**_kwargs(qwen3, prefix_cache_dir=str(tmp_path)))
    store, width = reader.engine.prefix_tiers.store, reader.engine.prefix_tiers.copier.block_bytes
    for path in files:
        assert store.read_into("kv", bytes.fromhex(path.stem), bytearray(width)), path
    cold = _generate(LLM(**_kwargs(qwen3, enable_prefix_caching=False)), prompts)
    assert _generate(reader, prompts) == cold
    assert reader.get_stats()["prefix_disk_hits"] > 0


def test_the_size_cap_evicts_the_least_recently_used(tmp_path):
    payload = bytes(1000)
    size = HEADER_SIZE + len(payload)
    store = DiskPrefixStore(str(tmp_path), bytes(32), max_bytes=5 * size)
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(6)]
    for block_hash in hashes[:4]:
        store.put("kv", block_hash, payload)
    store.flush()
    for age, block_hash in enumerate(hashes[:4]):  # written in order, a second apart
        os.utime(store.path("kv", block_hash), (1e9 + age, 1e9 + age))
    assert store.read_into("kv", hashes[0], bytearray(len(payload)))  # used: the newest now
    for block_hash in hashes[4:]:
        store.put("kv", block_hash, payload)
    store.flush()

    kept = [h for h in hashes if store.contains("kv", h)]
    assert kept == [hashes[0], hashes[3], hashes[4], hashes[5]]
    assert store.stats()["prefix_disk_files_evicted"] == 2
    store.close()


def test_files_of_other_directories_are_left_alone(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.kv").write_bytes(bytes(5000))
    store = DiskPrefixStore(str(tmp_path), bytes(32), max_bytes=100)
    store.put("kv", bytes(32), bytes(1000))
    store.close()
    assert (tmp_path / "notes" / "a.kv").exists()
    shutil.rmtree(tmp_path / "notes")
