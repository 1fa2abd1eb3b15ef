"""Per-sequence recurrent-state slots and prefix snapshots for hybrid models. No torch.

A Gated DeltaNet layer keeps a fixed-size state per sequence (conv state + recurrent state), not
a growing KV cache. Each running sequence owns one *slot* (an index into the runner's state
tensors), taken at admission and given back on finish, abort or preemption.

Prefix caching cannot revive a recurrent state from KV blocks, so the state is *snapshotted* when
a sequence's computed tokens reach a snapshot boundary: the state there is copied into a bounded
pool, keyed by the chain hash of the block ending there. A later request whose cached prefix ends
on that block restores the snapshot into its own slot and resumes from it. The pool evicts least
recently used snapshots.

A boundary may lie inside a step's prompt chunk, so a snapshot is taken in two halves: before the
step the scheduler takes an index (`take_snapshot`) for the runner to copy the state into during
the forward, and after it, once the block's hash is known and the state written, keys it
(`store_snapshot`). An index taken but not yet stored is neither free nor found by a lookup, so
no request restores a state that is still being computed.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlotManager:
    """Free list of `num_slots` state slots and an LRU pool of `num_snapshots` snapshots."""

    def __init__(self, num_slots: int, num_snapshots: int = 0):
        if num_slots <= 0 or num_snapshots < 0:
            raise ValueError(
                f"num_slots must be > 0 and num_snapshots >= 0, got {num_slots}, {num_snapshots}"
            )
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() -> lowest id
        self.free_snapshots: list[int] = list(range(num_snapshots - 1, -1, -1))
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # block hash -> index, LRU first
        self.unstored: set[int] = set()  # indices taken for the step in progress, not yet stored
        self.num_restores = 0

    # ---- slots ------------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        """Take the lowest free slot. Raises RuntimeError when none is free (the scheduler
        admits no sequence without checking `num_free_slots`)."""
        if not self.free_slots:
            raise RuntimeError("no free state slot")
        return self.free_slots.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self.free_slots:
            raise ValueError(f"state slot {slot} is not allocated")
        self.free_slots.append(slot)
        self.free_slots.sort(reverse=True)

    # ---- snapshots --------------------------------------------------------------------------

    def has_snapshot(self, block_hash: int) -> bool:
        return block_hash in self.snapshots

    def lookup(self, block_hash: int) -> int | None:
        """The snapshot index stored for `block_hash` (marked most recently used), or None."""
        index = self.snapshots.get(block_hash)
        if index is not None:
            self.snapshots.move_to_end(block_hash)
            self.num_restores += 1
        return index

    def take_snapshot(self) -> int | None:
        """An index for the runner to copy a state into during the coming step: a free one, else
        the least recently used snapshot's (forgotten now); None when the pool is empty or every
        index awaits its state. The caller hands it to `store_snapshot` or `release_snapshot`."""
        if self.free_snapshots:
            index = self.free_snapshots.pop()
        elif self.snapshots:
            _, index = self.snapshots.popitem(last=False)
        else:
            return None
        self.unstored.add(index)
        return index

    def store_snapshot(self, block_hash: int, index: int) -> None:
        """Key the state written into `index` by `block_hash`, most recently used. When the pool
        already holds that hash (the same chain hash means the same prefix, hence the same
        state) the held one is refreshed and `index` freed."""
        self.unstored.discard(index)
        if block_hash in self.snapshots:
            self.snapshots.move_to_end(block_hash)
            self.release_snapshot(index)
            return
        self.snapshots[block_hash] = index

    def release_snapshot(self, index: int) -> None:
        """Give back an index taken by `take_snapshot` and never stored."""
        self.unstored.discard(index)
        self.free_snapshots.append(index)
        self.free_snapshots.sort(reverse=True)

    def release_unstored(self) -> None:
        """Give back every index taken and never stored (a step that failed before its update)."""
        for index in list(self.unstored):
            self.release_snapshot(index)

    def reset_snapshots(self) -> None:
        """Forget every snapshot."""
        self.snapshots.clear()
        self.unstored.clear()
        self.free_snapshots = list(range(self.num_snapshots - 1, -1, -1))
