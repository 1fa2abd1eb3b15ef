"""State slots and prefix snapshots for hybrid models, to the exact slot and snapshot index.

Pure Python, no torch: the allocator on its own, then the scheduler driving it (admission waits
for a slot; finish, abort and preemption free it; snapshots are due at boundaries inside a chunk
as well as at its end; a prefix hit resumes only where a snapshot exists).
"""

from __future__ import annotations

import itertools

import pytest

from axon.cache.block_manager import BlockManager
from axon.cache.state_slots import StateSlotManager
from axon.engine.scheduler import Scheduler, SchedulerOutput
from axon.sampling_params import SamplingParams
from axon.sequence import Sequence, SequenceStatus

BLOCK = 4
TOKEN = 7
_fresh = itertools.count(10_000)


def make(
    num_slots: int = 4,
    num_snapshots: int = 8,
    interval: int = BLOCK,
    num_blocks: int = 64,
    budget: int = 64,
    prefix_caching: bool = True,
):
    slots = StateSlotManager(num_slots, num_snapshots)
    bm = BlockManager(num_blocks, BLOCK, prefix_caching)
    sched = Scheduler(bm, 8, budget, 256, slots, interval if prefix_caching else 0)
    return sched, bm, slots


def seq_of(prompt: list[int] | int, max_tokens: int = 100) -> Sequence:
    if isinstance(prompt, int):
        prompt = list(itertools.islice(_fresh, prompt))
    return Sequence("r", prompt, SamplingParams(max_tokens=max_tokens))


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {
        seq.seq_id: TOKEN
        for seq, num_new in out.scheduled
        if seq.num_computed_tokens + num_new == seq.num_tokens
    }
    sched.update(out, sampled)
    return out


# ---- the allocator --------------------------------------------------------------------------


def test_slots_lowest_first_and_reused():
    slots = StateSlotManager(3)
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(1)
    slots.free(0)
    assert slots.allocate() == 0
    with pytest.raises(ValueError):
        slots.free(2) or slots.free(2)


def test_snapshot_pool_is_lru():
    slots = StateSlotManager(1, 2)
    assert slots.take_snapshot() == 0
    slots.store_snapshot(111, 0)
    assert slots.take_snapshot() == 1
    slots.store_snapshot(222, 1)
    assert slots.take_snapshot() == 0  # evicts 111, the least recently used
    assert not slots.has_snapshot(111)
    slots.store_snapshot(333, 0)
    assert slots.lookup(222) == 1 and slots.lookup(333) == 0
    slots.reset_snapshots()
    assert not slots.has_snapshot(222)
    assert StateSlotManager(1, 0).take_snapshot() is None


def test_a_snapshot_is_found_only_once_stored():
    """Between take (before the step) and store (after it) the state is still being computed:
    no lookup may find it, and its index is neither free nor evictable."""
    slots = StateSlotManager(1, 2)
    first, second = slots.take_snapshot(), slots.take_snapshot()
    assert slots.take_snapshot() is None  # both indices await their states
    assert not slots.snapshots
    slots.store_snapshot(111, first)
    assert slots.has_snapshot(111) and slots.lookup(111) == first
    slots.store_snapshot(111, second)  # the same prefix again: the held one stays, this is freed
    assert slots.lookup(111) == first
    assert slots.take_snapshot() == second
    slots.release_snapshot(second)
    assert slots.free_snapshots == [second]


# ---- the scheduler --------------------------------------------------------------------------


def test_admission_needs_a_free_slot_and_finish_frees_it():
    sched, _, slots = make(num_slots=2)
    seqs = [seq_of(3, max_tokens=2) for _ in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = step(sched)
    assert [s.state_slot for s, _ in out.scheduled] == [0, 1]
    assert seqs[2].status == SequenceStatus.WAITING
    step(sched)  # both finish (2 tokens each)
    assert slots.num_free_slots == 2
    out = step(sched)
    assert [(s.seq_id, s.state_slot) for s, _ in out.scheduled] == [(seqs[2].seq_id, 0)]


def test_abort_and_preemption_free_slots():
    sched, _, slots = make(num_slots=2, num_blocks=4, prefix_caching=False)
    a, b = seq_of(6), seq_of(6)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert (a.state_slot, b.state_slot) == (0, 1)
    sched.abort({"r"})
    assert slots.num_free_slots == 2 and a.state_slot is None and b.state_slot is None

    sched, _, slots = make(num_slots=2, num_blocks=4, prefix_caching=False)
    a, b = seq_of(8), seq_of(8)
    sched.add(a)
    sched.add(b)
    step(sched)  # 2 blocks each; the next decode needs a third for one of them
    out = step(sched)
    assert out.preempted == [b] and b.state_slot is None and slots.num_free_slots == 1


def test_snapshots_are_due_inside_prefill_chunks_and_are_saved():
    sched, bm, slots = make(interval=2 * BLOCK, budget=6)
    seq = seq_of(19)
    sched.add(seq)
    sizes, saves = [], []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        out = step(sched)
        sizes.append(out.scheduled[0][1])
        saves.append(out.state_saves)
    assert sizes == [6, 6, 6, 1]  # the full budget, not cut at 8 and 16
    # (slot, computed tokens, snapshot index): after 8 tokens (2 into [6, 12)), after 16.
    assert saves == [[], [(0, 8, 0)], [(0, 16, 1)], []]
    assert slots.snapshots == {seq.block_hashes[1]: 0, seq.block_hashes[3]: 1}


def test_snapshot_indices_of_a_step_that_never_updated_are_reused():
    sched, bm, slots = make(num_snapshots=2, interval=2 * BLOCK, budget=8)
    seq = seq_of(15)
    sched.add(seq)
    assert sched.schedule().state_saves == [(0, 8, 0)]
    sched.abort({"r"})  # the step failed: its requests are ended, update never runs
    assert slots.unstored == {0}
    again = seq_of(15)
    sched.add(again)
    assert sched.schedule().state_saves == [(0, 8, 0)]  # index 0 again, not 1
    assert slots.free_snapshots == [1]


def test_a_snapshot_at_the_end_of_a_chunk_or_a_decode():
    sched, bm, slots = make(interval=2 * BLOCK, budget=8)
    seq = seq_of(15)
    sched.add(seq)
    assert step(sched).state_saves == [(0, 8, 0)]  # [0, 8): due at the chunk's end
    assert step(sched).state_saves == []  # [8, 15)
    assert step(sched).state_saves == [(0, 16, 1)]  # the decode of token 15
    assert slots.snapshots == {seq.block_hashes[1]: 0, seq.block_hashes[3]: 1}


def test_prefix_hit_resumes_only_at_a_snapshot():
    sched, bm, slots = make(interval=2 * BLOCK)
    prompt = list(range(100, 120))
    first = seq_of(prompt, max_tokens=1)
    sched.add(first)
    while not first.is_finished:
        step(sched)
    # Blocks 0-4 are cached; snapshots exist after blocks 1 and 3 (tokens 8 and 16), taken
    # inside one chunk, the latest first: indices 1 and 0 (stored in order, 8 then 16).
    assert list(slots.snapshots.values()) == [1, 0]
    second = seq_of(prompt[:14] + [1, 2, 3])
    sched.add(second)
    out = sched.schedule()
    assert second.num_computed_tokens == 8  # 3 cached blocks, but the snapshot is at 2
    # Cached block 2 is recomputed into a fresh block: the state after it was never saved.
    assert second.block_table == [0, 1, 5, 6, 7] and out.scheduled == [(second, 9)]
    assert out.state_restores == [(second.state_slot, 1)]
    assert out.state_saves == [(second.state_slot, 16, 2)]  # its own block 3 differs


def test_fork_children_of_a_hybrid_go_through_the_prefix_cache():
    sched, bm, slots = make(interval=BLOCK)
    params = SamplingParams(n=2, max_tokens=3)
    parent = Sequence("n", list(range(50, 60)), params, index=0)
    child = Sequence("n", list(range(50, 60)), params, index=1)
    child.fork_parent = parent
    sched.add(parent)
    sched.add(child)
    while parent.num_output_tokens == 0:
        step(sched)
    assert child.fork_parent is None and child.block_table == []
    out = step(sched)
    restored = [r for r in out.state_restores if r[0] == child.state_slot]
    assert child.num_cached_tokens == 8 and len(restored) == 1
