"""The prefix cache's tiers past the KV cache, in the engine loop: host memory
(`--prefix-cache-host-size`, cache/host_prefix.py) and disk (`--prefix-cache-dir`,
cache/disk_prefix.py), either or both (memory in front). They hold full KV blocks, and a hybrid
model's state snapshots, saved as they are computed and brought back on a later admission: after
the KV cache evicted them, or, from disk, after a restart. The bytes are runner/kv_blocks.py's.

Around each step:

- `prefetch`, before scheduling: for the waiting sequences the step may admit, walk the chain
  hashes of their prompt's full blocks past what the KV cache holds, read the blocks the store
  has into free KV blocks and register them as cached (`BlockManager.adopt`), as if a finished
  sequence had left them. The scheduler's own prefix match then finds them and counts them as
  cached tokens: nothing else in the scheduler knows the tiers exist. A hybrid model resumes only
  from a state snapshot, so the walk stops at the last block whose snapshot the KV cache's pool
  or the store holds, and that snapshot is read into the snapshot pool. The reads are
  synchronous (the step needs them); a block costs a memcpy (and a file read from disk), far less
  than its prefill.
- `mark`, after scheduling: the blocks each scheduled sequence fills this step, with their
  hashes (a sequence that finishes this step hands its block table back in `update`).
- `save`, after the step: copy those blocks' bytes (and the snapshots stored this step) out of
  the cache into the store: kept in memory, queued for the disk's writer thread; a block a tier
  has already is skipped there, one the disk's queue has no room for dropped.

Under tensor parallelism (ranks on this host) every rank keeps its own shard of each block in its
own store (runner/disk_shard.py); rank 0 asks the other ranks over their pipes, between steps, to
read, place and save their shards, and a block read is a hit only when every rank read it whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import islice

import torch

from axon.batch import SchedulerOutput
from axon.cache.block_manager import BlockManager, chain_hash
from axon.cache.disk_prefix import DiskPrefixStore
from axon.cache.host_prefix import HostPrefixStore
from axon.cache.state_slots import StateSlotManager
from axon.config import EngineConfig
from axon.runner.disk_shard import open_store
from axon.runner.kv_blocks import BlockCopier
from axon.runner.memory import available_memory
from axon.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class _Filled:
    """A block a step fills: where it is and what it is keyed by."""

    block_id: int
    block_hash: bytes
    state_slot: int | None  # the sequence's (hybrid models)
    index: int  # the block's index in its sequence


class PrefixTiers:
    def __init__(self, store: DiskPrefixStore | HostPrefixStore, copier: BlockCopier,
                 block_manager: BlockManager, state_slots: StateSlotManager | None,
                 max_num_seqs: int, ranks=None):  # fmt: skip
        self.store = store
        self.ranks = ranks  # the other tensor-parallel ranks' workers (None: one rank)
        self.copier = copier
        self.block_manager = block_manager
        # Hybrid models: resume only from snapshots, which only exist with a snapshot pool.
        self.state_slots = state_slots if copier.has_states else None
        self.max_num_seqs = max_num_seqs
        self._looked: set[tuple[int, int]] = set()  # (seq_id, preemptions) prefetched for
        self.num_loaded_blocks = dict.fromkeys(store.tiers, 0)  # per tier read from
        self.num_loaded_snapshots = dict.fromkeys(store.tiers, 0)

    @classmethod
    def open(cls, config: EngineConfig, runner, block_manager, state_slots) -> PrefixTiers | None:
        """The tiers `config` asks for, or None (none asked, or not possible here: said once in
        the log)."""
        asked = [
            *(["--prefix-cache-host-size"] if config.prefix_cache_host_size else []),
            *([f"--prefix-cache-dir {config.prefix_cache_dir}"] if config.prefix_cache_dir else []),
        ]
        if not asked:
            return None
        why = None
        if not block_manager.enable_prefix_caching:
            why = "prefix caching is off"
        elif config.nnodes > 1:
            why = "ranks on other hosts are not asked for their shards of a block"
        elif config.tensor_parallel_size > 1 and runner.plan.num_state_slots:
            why = "a hybrid model's state snapshots are not kept under tensor parallelism"
        elif runner.plan.num_state_slots and not runner.plan.num_state_snapshots:
            why = "this hybrid model has no state snapshot pool"
        if why is None:
            try:
                copier = BlockCopier(runner)
            except RuntimeError as exc:  # a cache tensor whose rows are not contiguous bytes
                why = f"the KV cache's layout is not copied by rows ({exc})"
        if why is not None:
            logger.warning("%s unused: %s", " and ".join(asked), why)
            return None
        if config.prefix_cache_host_size:
            _check_host_size(config.prefix_cache_host_size, runner.device)
        store = open_store(config, runner, copier, rank=0)
        args = (store, copier, block_manager, state_slots, config.max_num_seqs, runner.workers)
        return cls(*args)

    # ---- before scheduling: bring known prefixes in from the store ---------------------------

    def prefetch(self, waiting, num_running: int) -> None:
        """Load from the store the blocks of the prefixes of the sequences the next step may
        admit. A sequence whose whole prompt (and one more token) fits in the blocks not yet
        spoken for may have every prefix block loaded: the scheduler takes that many blocks for
        it anyway. Else it gets up to half of them (the rest for its new tokens), as a prompt
        longer than half the cache does."""
        budget = self.block_manager.num_free_blocks
        block_size = self.block_manager.block_size
        room = max(0, self.max_num_seqs - num_running)
        for seq in islice(waiting, room):
            if budget <= 0:
                break
            key = (seq.seq_id, seq.num_preemptions)
            if seq.block_table or key in self._looked:
                continue
            if seq.pooling == "mean" or seq.wants_prompt_logprobs:
                continue  # every prompt row computed: no prefix hits for them
            need = seq.num_tokens // block_size + 1  # its blocks, the next token's included
            allowed = need if need <= budget else budget // 2
            taken = self._prefetch(seq, allowed)
            budget -= need if need <= budget else taken
            if taken < allowed:  # else the store may have more: looked at again next step
                self._looked.add(key)
        if len(self._looked) > 4 * self.max_num_seqs:
            waiting_keys = {(s.seq_id, s.num_preemptions) for s in waiting}
            self._looked &= waiting_keys

    def _prefetch(self, seq: Sequence, budget: int) -> int:
        """Bring in `seq`'s prefix blocks that the store has and the KV cache not; blocks taken."""
        chain = self._walk(seq, budget)
        if self.state_slots is not None:
            chain = self._to_last_snapshot(chain)
        stored = [(i, h) for i, (h, where) in enumerate(chain) if where == "stored"]
        data, tiers = self._read(stored)
        if len(tiers) < len(stored):  # the chain is broken there
            chain, stored = chain[: stored[len(tiers)][0]], stored[: len(tiers)]
        asked = self.ranks is not None and bool(stored)
        if asked:
            counts = self.ranks.ask("disk", "read", [h for _, h in stored])
            row = min(len(stored), *counts)  # a hit only where every rank has its shard
            if row < len(stored):
                chain, stored, data = chain[: stored[row][0]], stored[:row], data[:row]
        if self.state_slots is not None:
            chain = self._to_last_snapshot(chain)
            if not chain or not self._load_snapshot(chain[-1][0]):
                return 0
            keep = sum(1 for index, _ in stored if index < len(chain))
            stored, data = stored[:keep], data[:keep]
        if not stored:
            if asked:
                self.ranks.ask("disk", "place", [])  # drop what they hold
            return 0
        block_size = self.block_manager.block_size
        ids = [
            self.block_manager.adopt(h, tuple(seq.block_token_ids(i, block_size)))
            for i, h in stored
        ]
        self.copier.write_blocks(ids, data)
        if asked:
            self.ranks.ask("disk", "place", ids)
        for tier in tiers[: len(ids)]:
            self.num_loaded_blocks[tier] += 1
        return len(ids)

    def _read(self, stored: list[tuple[int, bytes]]) -> tuple[torch.Tensor, list[str]]:
        """The bytes of the `stored` (index, hash) blocks, in order, up to the first the store
        cannot give whole, and the tier each came from."""
        data = torch.empty((len(stored), self.copier.block_bytes), dtype=torch.uint8)
        tiers = []
        for row, (_, block_hash) in enumerate(stored):
            tier = self.store.read_into("kv", block_hash, data[row].numpy())
            if tier is None:
                break
            tiers.append(tier)
        return data[: len(tiers)], tiers

    def _walk(self, seq: Sequence, budget: int) -> list[tuple[bytes, str]]:
        """(hash, "cached" or "stored") of `seq`'s prefix blocks, up to the first block in
        neither the KV cache nor the store, or the `budget`-th in the store only. Blocks found
        in the KV cache become the most recently used, so the blocks taken for the store's do
        not evict them."""
        bm = self.block_manager
        block_size = bm.block_size
        chain: list[tuple[bytes, str]] = []
        parent = None
        num_stored = 0
        for index in range((seq.num_tokens - 1) // block_size):
            token_ids = tuple(seq.block_token_ids(index, block_size))
            parent = chain_hash(parent, token_ids, seq.block_extra_key(index, block_size))
            block_id = bm.hash_to_block.get(parent)
            if block_id is not None and bm.blocks[block_id].token_ids == token_ids:
                if block_id in bm.cached_free:
                    bm.cached_free.move_to_end(block_id)
                chain.append((parent, "cached"))
            elif num_stored < budget and self.store.contains("kv", parent):
                chain.append((parent, "stored"))
                num_stored += 1
            else:
                break
        return chain

    def _to_last_snapshot(self, chain: list) -> list:
        """`chain` cut after its last block a state snapshot (in the pool or the store) ends
        at."""
        for end in range(len(chain), 0, -1):
            block_hash = chain[end - 1][0]
            if self.state_slots.has_snapshot(block_hash) or self.store.contains(
                "state", block_hash
            ):
                return chain[:end]
        return []

    def _load_snapshot(self, block_hash: bytes) -> bool:
        """Make the snapshot at `block_hash` one of the pool's (read from the store when the
        pool has none). False when it cannot be had."""
        slots = self.state_slots
        if slots.has_snapshot(block_hash):
            return True
        index = slots.take_snapshot()
        if index is None:
            return False
        data = torch.empty((1, self.copier.state_bytes), dtype=torch.uint8)
        tier = self.store.read_into("state", block_hash, data[0].numpy())
        if tier is None:
            slots.release_snapshot(index)
            return False
        self.copier.write_snapshots([index], data)
        slots.store_snapshot(block_hash, index)
        self.num_loaded_snapshots[tier] += 1
        return True

    # ---- around the step: save what it computes ----------------------------------------------

    def mark(self, out: SchedulerOutput) -> list[_Filled]:
        """The blocks the scheduled sequences fill this step, taken now: a sequence that
        finishes gives its block table (and state slot) back in the scheduler's update."""
        block_size = self.block_manager.block_size
        filled = []
        for seq, num_new in out.scheduled:
            first = seq.num_computed_tokens // block_size
            last = (seq.num_computed_tokens + num_new) // block_size
            parent = seq.block_hashes[first - 1] if first else None
            for index in range(first, last):
                token_ids = tuple(seq.block_token_ids(index, block_size))
                parent = chain_hash(parent, token_ids, seq.block_extra_key(index, block_size))
                filled.append(_Filled(seq.block_table[index], parent, seq.state_slot, index))
        return filled

    def save(self, filled: list[_Filled], out: SchedulerOutput) -> None:
        """After the step: store the filled blocks and the snapshots stored, where a tier lacks
        them."""
        if self.ranks is not None and filled:
            self.ranks.ask("disk", "save", [(f.block_id, f.block_hash) for f in filled])
        blocks = [f for f in filled if self.store.needs("kv", f.block_hash)]
        if blocks and self.store.accepting:
            data = self.copier.read_blocks([f.block_id for f in blocks])
            for row, f in enumerate(blocks):
                self.store.put("kv", f.block_hash, data[row].numpy())
        if self.state_slots is not None and out.state_saves:
            self._save_snapshots(filled, out)

    def _save_snapshots(self, filled: list[_Filled], out: SchedulerOutput) -> None:
        """Queue the snapshots this step stored: the state at the end of a filled block."""
        ends = {(f.state_slot, f.index): f.block_hash for f in filled}
        block_size = self.block_manager.block_size
        for slot, computed, index in out.state_saves:
            block_hash = ends.get((slot, computed // block_size - 1))
            if block_hash is None or self.state_slots.snapshots.get(block_hash) != index:
                continue  # not kept: the pool held that state already
            if not self.store.needs("state", block_hash) or not self.store.accepting:
                continue
            data = self.copier.read_snapshots([index])
            self.store.put("state", block_hash, data[0].numpy())

    # ---- the engine's other commands ----------------------------------------------------------

    def reset(self) -> None:
        """Forget the blocks in host memory, every rank's (a reset of the prefix cache: what
        follows is computed afresh, or read from disk, which outlives the process anyway)."""
        if self.ranks is not None:
            self.ranks.ask("disk", "reset")
        self.store.reset()

    def flush(self) -> None:
        """Wait until every queued file is written (tests; a shutdown closes instead)."""
        if self.ranks is not None:
            self.ranks.ask("disk", "flush")
        self.store.flush()

    def close(self) -> None:
        """Write what every rank has queued (before the ranks are stopped)."""
        if self.ranks is not None:
            try:
                self.ranks.ask("disk", "close")
            except RuntimeError as exc:  # a rank that is gone keeps what it wrote
                logger.warning("prefix cache: the ranks' files not all written: %s", exc)
            self.ranks = None
        self.store.close()

    def stats(self) -> dict:
        block_size = self.block_manager.block_size
        return {
            **{f"prefix_{t}_hits": n * block_size for t, n in self.num_loaded_blocks.items()},
            **{f"prefix_{t}_snapshots_loaded": n for t, n in self.num_loaded_snapshots.items()},
            **self.store.stats(),
        }


def _check_host_size(size: int, device: torch.device) -> None:
    """Refuse a host tier the host cannot hold (it fills as blocks come: fail now, not when the
    host runs out); on the CPU, say what does the same job without copies."""
    free = available_memory(torch.device("cpu"))
    if size > free:
        raise ValueError(
            f"prefix_cache_host_size {size} B is more than the host's available memory ({free} B)"
        )
    if device.type == "cpu":
        logger.info(
            "--prefix-cache-host-size on the CPU: the KV cache is host memory already, so a "
            "larger --kv-cache-memory keeps as many blocks without copying them"
        )
