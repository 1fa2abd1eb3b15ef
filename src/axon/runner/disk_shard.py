"""A rank's store of the prefix cache's tiers past the KV cache (host memory, disk), what its
files are named by, and the side of the tiers that ranks 1..N-1 of a tensor-parallel engine run
(rank 0's is engine/prefix_tiers.py).

Under tensor parallelism each rank holds its own shard of every KV block, so each writes and
reads its own files, in its own directory: the fingerprint names the rank and the world size
(and the shard's shapes, through the copier's layout). Rank 0 decides what is a hit: a block
counts only when every rank read its shard of it, so it asks the ranks over their pipes
(`RankShard.handle`) between steps, when no forward runs.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from axon.cache.disk_prefix import DiskPrefixStore
from axon.cache.host_prefix import HostPrefixStore
from axon.config import EngineConfig
from axon.runner.kv_blocks import BlockCopier

_QUEUE_BYTES = 256 << 20  # the writer's queue holds about this much: a burst of long prompts


def model_identity(path: str) -> list:
    """The model's files as (name, size, mtime): a file replaced or rewritten is another model.
    A directory: its checkpoint, config and tokenizer files."""
    path = os.path.realpath(path)
    if os.path.isfile(path):
        stat = os.stat(path)
        return [path, stat.st_size, stat.st_mtime_ns]
    entries = []
    if os.path.isdir(path):
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_file() and entry.name.endswith((".safetensors", ".gguf", ".json", ".bin")):
                stat = entry.stat()
                entries.append([entry.name, stat.st_size, stat.st_mtime_ns])
    return [path, entries]


def fingerprint(config: EngineConfig, runner, copier: BlockCopier, rank: int = 0) -> bytes:
    """What a block's bytes depend on besides its tokens: the model's files, the compute and
    cache dtypes and layout, the block size, the device kind and the parallel layout."""
    described = {
        "model": model_identity(config.model),
        "config": runner.hf_config.to_dict(),
        "dtype": str(runner.dtype),
        "activation_precision": runner.config.activation_precision,
        "kv_cache_dtype": config.kv_cache_dtype,
        "layout": copier.layout(),
        "block_size": config.block_size,
        "device": runner.device.type,
        "tensor_parallel": [config.tensor_parallel_size, config.nnodes, rank],
        "images": [config.image_profile, config.max_image_pixels],
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def open_store(
    config: EngineConfig, runner, copier: BlockCopier, rank: int
) -> DiskPrefixStore | HostPrefixStore:
    """Rank `rank`'s store: host memory (`prefix_cache_host_size`) in front of its files under
    `prefix_cache_dir`, or either alone."""
    disk = None
    if config.prefix_cache_dir is not None:
        queue_size = max(4, _QUEUE_BYTES // max(1, copier.block_bytes))
        disk = DiskPrefixStore(
            config.prefix_cache_dir,
            fingerprint(config, runner, copier, rank),
            config.prefix_cache_disk_size,
            queue_size,
        )
    if config.prefix_cache_host_size:
        return HostPrefixStore(config.prefix_cache_host_size, disk)
    return disk


class RankShard:
    """A rank's (1..N-1) store and its cache's block bytes, driven by rank 0's requests:

    - `read(hashes)`: read these prefix blocks from the store, in order, into a held buffer; the
      number read whole (a missing or bad one ends the run);
    - `place(block_ids)`: copy the first len(block_ids) held blocks into those cache blocks;
    - `save(blocks)`: store the (block id, hash) blocks a tier lacks;
    - `reset()`: forget the blocks in host memory;
    - `flush()`, `close()`: as the store's.
    """

    def __init__(self, config: EngineConfig, runner, rank: int) -> None:
        self.copier = BlockCopier(runner)
        self.store = open_store(config, runner, self.copier, rank)
        self._held: torch.Tensor | None = None

    def handle(self, operation: str, *args):
        if operation not in ("read", "place", "save", "reset", "flush", "close"):
            raise ValueError(f"unknown disk tier operation {operation!r}")
        return getattr(self, operation)(*args)

    def read(self, hashes: list[bytes]) -> int:
        data = torch.empty((len(hashes), self.copier.block_bytes), dtype=torch.uint8)
        count = 0
        for row, block_hash in enumerate(hashes):
            if self.store.read_into("kv", block_hash, data[row].numpy()) is None:
                break
            count += 1
        self._held = data[:count]
        return count

    def place(self, block_ids: list[int]) -> None:
        held, self._held = self._held, None
        if block_ids:
            self.copier.write_blocks(block_ids, held[: len(block_ids)])

    def save(self, blocks: list[tuple[int, bytes]]) -> None:
        blocks = [(i, h) for i, h in blocks if self.store.needs("kv", h)]
        if blocks and self.store.accepting:
            data = self.copier.read_blocks([i for i, _ in blocks])
            for row, (_, block_hash) in enumerate(blocks):
                self.store.put("kv", block_hash, data[row].numpy())

    def reset(self) -> None:
        self.store.reset()

    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.store.close()


class DiskShards:
    """A rank's answers to rank 0's disk tier requests: its RankShard, opened at the first
    request (rank 0 sends none unless its tier is on), or the error as its reply."""

    def __init__(self, config: EngineConfig, runner, rank: int) -> None:
        self.config, self.runner, self.rank = config, runner, rank
        self.shard: RankShard | None = None

    def answer(self, request: tuple) -> tuple:
        try:
            if self.shard is None:
                self.shard = RankShard(self.config, self.runner, self.rank)
            return ("disk", self.shard.handle(*request))
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises RankFailed
            return ("error", f"disk tier: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Write what is queued (the rank exits without running atexit hooks)."""
        if self.shard is not None:
            self.shard.close()
