"""Scheduler steps simulated without a model: exact token counts, block ids and queue order.

Pure Python, no torch. `step` plays the engine's part: schedule, then hand `update` one sampled
token for every sequence whose scheduled tokens reach its last token.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from axon.cache.block_manager import BlockManager
from axon.cache.state_slots import StateSlotManager
from axon.engine.scheduler import Scheduler, SchedulerOutput
from axon.sampling_params import SamplingParams
from axon.sequence import FinishReason, Sequence, SequenceStatus

TOKEN = 1000  # what the fake model samples unless told otherwise; in no stop set
EOS = 2
_fresh_tokens = itertools.count(10_000)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len), bm


def make_seq(
    prompt: list[int] | int,
    request_id: str = "req",
    eos_token_ids: frozenset[int] = frozenset(),
    **params,
) -> Sequence:
    """A sequence; an int prompt means that many tokens no other prompt shares."""
    if isinstance(prompt, int):
        prompt = list(itertools.islice(_fresh_tokens, prompt))
    params.setdefault("max_tokens", 100)
    return Sequence(request_id, prompt, SamplingParams(**params), eos_token_ids=eos_token_ids)


def add_request(
    sched: Scheduler, request_id: str, prompt: list[int], n: int, **params
) -> list[Sequence]:
    """Queue `n` samples of one request the way EngineCore.add_request does."""
    sampling_params = SamplingParams(n=n, **params)
    seqs = [Sequence(request_id, prompt, sampling_params, index=i) for i in range(n)]
    for child in seqs[1:]:
        child.fork_parent = seqs[0]
    for seq in seqs:
        sched.add(seq)
    return seqs


def step(
    sched: Scheduler, token: int | Callable[[Sequence], int] = TOKEN
) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    sampled = {
        seq.seq_id: token(seq) if callable(token) else token
        for seq, num_new in out.scheduled
        if seq.num_computed_tokens + num_new == seq.num_tokens
    }
    finished = sched.update(out, sampled)
    return out, finished


def scheduled(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(seq.seq_id, num_new) for seq, num_new in out.scheduled]


def run_until_done(sched: Scheduler, max_steps: int = 200) -> int:
    """Step until nothing is left; fails if a step schedules nothing while work remains."""
    for num_steps in range(1, max_steps + 1):
        out, _ = step(sched)
        assert not out.is_empty, f"stalled at step {num_steps}: {sched.waiting} {sched.running}"
        if not sched.has_unfinished():
            return num_steps
    raise AssertionError(f"not done after {max_steps} steps")


# ---- token budget -------------------------------------------------------------------------------


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    sched, bm = make_scheduler(
        num_blocks=1024, block_size=16, max_num_batched_tokens=4096, max_model_len=16384
    )
    seq = make_seq(9000, max_tokens=2)
    sched.add(seq)
    for num_new, computed, num_blocks in [(4096, 4096, 256), (4096, 8192, 512), (808, 9000, 563)]:
        out, finished = step(sched)
        assert scheduled(out) == [(seq.seq_id, num_new)]
        assert out.num_batched_tokens == num_new
        assert seq.num_computed_tokens == computed
        assert len(seq.block_table) == num_blocks
        assert finished == []
    assert seq.output_token_ids == [TOKEN]  # sampled only when the last chunk ran
    assert seq.block_table == list(range(563))
    out, finished = step(sched)
    assert scheduled(out) == [(seq.seq_id, 1)]
    assert finished == [seq]
    assert seq.finish_reason == FinishReason.LENGTH
    assert bm.num_free_blocks == 1024


BOUNDARIES = list(range(256, 9000, 256))  # the 35 snapshot boundaries of a 9,000-token prompt


@pytest.mark.parametrize(
    ("num_snapshots", "saved"),
    [
        (64, BOUNDARIES),
        # Too few snapshots: each chunk takes its latest boundaries, evicting older snapshots.
        (4, [3328, 3584, 3840, 4096, 7424, 7680, 7936, 8192, 8448, 8704, 8960]),
    ],
    ids=["room-for-all", "pool-of-4"],
)
def test_a_hybrid_prompt_is_not_cut_at_snapshot_boundaries(num_snapshots, saved) -> None:
    """The states at the 256-token boundaries are snapshotted inside 4,096-token chunks: three
    prefill steps, not 36."""
    bm = BlockManager(1024, 16)
    slots = StateSlotManager(1, num_snapshots)
    sched = Scheduler(bm, 1, 4096, 16384, slots, snapshot_interval=256)
    seq = make_seq(9000, max_tokens=2)
    sched.add(seq)
    saves = []
    for num_new, computed in [(4096, 4096), (4096, 8192), (808, 9000)]:
        out, _ = step(sched)
        assert scheduled(out) == [(seq.seq_id, num_new)]
        saves += out.state_saves
        assert seq.num_computed_tokens == computed
    assert seq.output_token_ids == [TOKEN]
    assert [computed for _, computed, _ in saves] == saved
    assert {slot for slot, _, _ in saves} == {0}
    held = [c for c in BOUNDARIES if slots.has_snapshot(seq.block_hashes[c // 16 - 1])]
    assert held == saved[-num_snapshots:]


def test_decodes_and_prefill_chunks_share_a_step() -> None:
    sched, _ = make_scheduler(
        num_blocks=1024, block_size=16, max_num_batched_tokens=4096, max_model_len=16384
    )
    short = make_seq(10)
    sched.add(short)
    out, _ = step(sched)
    assert scheduled(out) == [(short.seq_id, 10)]
    long = make_seq(9000)
    sched.add(long)  # a new request joins between steps
    for long_chunk in (4095, 4095, 810):
        out, _ = step(sched)
        assert scheduled(out) == [(short.seq_id, 1), (long.seq_id, long_chunk)]
        assert out.num_batched_tokens == 1 + long_chunk
    assert long.num_computed_tokens == 9000
    assert long.output_token_ids == [TOKEN]
    out, _ = step(sched)
    assert scheduled(out) == [(short.seq_id, 1), (long.seq_id, 1)]
    assert short.num_output_tokens == 5


def test_running_sequences_go_before_waiting_ones() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=8)
    a = make_seq(20)
    b = make_seq(10)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert scheduled(out) == [(a.seq_id, 8)]
    assert list(sched.waiting) == [b]
    out, _ = step(sched)
    assert scheduled(out) == [(a.seq_id, 8)]
    out, _ = step(sched)
    assert scheduled(out) == [(a.seq_id, 4), (b.seq_id, 4)]
    assert a.num_output_tokens == 1
    out, _ = step(sched)
    assert scheduled(out) == [(a.seq_id, 1), (b.seq_id, 6)]
    out, _ = step(sched)
    assert scheduled(out) == [(a.seq_id, 1), (b.seq_id, 1)]


def test_max_num_seqs_caps_the_running_set() -> None:
    sched, _ = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq(5, max_tokens=1), make_seq(5, max_tokens=3), make_seq(5)
    for seq in (a, b, c):
        sched.add(seq)
    out, finished = step(sched)
    assert scheduled(out) == [(a.seq_id, 5), (b.seq_id, 5)]
    assert list(sched.waiting) == [c]
    assert finished == [a]
    out, _ = step(sched)
    assert scheduled(out) == [(b.seq_id, 1), (c.seq_id, 5)]
    assert sched.num_running == 2
    assert sched.num_waiting == 0


def test_admission_is_fifo_even_when_a_later_request_would_fit() -> None:
    sched, bm = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    r = make_seq(8, max_tokens=3)
    sched.add(r)
    step(sched)
    assert r.block_table == [0, 1]
    big, small = make_seq(13, max_tokens=2), make_seq(3, max_tokens=1)
    sched.add(big)
    sched.add(small)
    for _ in range(2):
        out, finished = step(sched)
        # big needs 4 blocks and at most one is free; small would fit but must not jump it.
        assert scheduled(out) == [(r.seq_id, 1)]
        assert list(sched.waiting) == [big, small]
    assert finished == [r]
    out, finished = step(sched)
    assert scheduled(out) == [(big.seq_id, 13)]
    assert big.block_table == [0, 1, 2, 3]
    assert list(sched.waiting) == [small]
    out, finished = step(sched)
    assert scheduled(out) == [(big.seq_id, 1)]
    assert finished == [big]
    out, finished = step(sched)
    assert scheduled(out) == [(small.seq_id, 3)]
    assert finished == [small]
    assert bm.num_free_blocks == 4


def test_a_decode_takes_a_new_block_at_the_boundary() -> None:
    sched, bm = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    seq = make_seq(8)
    sched.add(seq)
    step(sched)
    assert seq.block_table == [0, 1]  # 8 tokens computed, the 9th sampled
    step(sched)
    assert seq.block_table == [0, 1, 2]
    for _ in range(3):
        step(sched)
    assert seq.num_computed_tokens == 12
    assert seq.block_table == [0, 1, 2]
    step(sched)
    assert seq.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0


def test_waiting_requests_are_admitted_in_arrival_order() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=10)
    seqs = [make_seq(4) for _ in range(4)]
    for seq in seqs:
        sched.add(seq)
    out, _ = step(sched)
    assert scheduled(out) == [(seqs[0].seq_id, 4), (seqs[1].seq_id, 4), (seqs[2].seq_id, 2)]
    assert list(sched.waiting) == [seqs[3]]
    out, _ = step(sched)
    assert scheduled(out) == [
        (seqs[0].seq_id, 1),
        (seqs[1].seq_id, 1),
        (seqs[2].seq_id, 2),
        (seqs[3].seq_id, 4),
    ]


# ---- prefix caching through the scheduler -------------------------------------------------------


def test_a_repeated_prompt_computes_only_the_uncached_tail() -> None:
    sched, bm = make_scheduler()
    prompt = list(range(10))
    first = make_seq(prompt, max_tokens=1)
    sched.add(first)
    step(sched)
    assert first.is_finished
    second = make_seq(prompt, max_tokens=2)
    sched.add(second)
    out, _ = step(sched)
    assert scheduled(out) == [(second.seq_id, 2)]
    assert second.num_cached_tokens == 8
    assert second.block_table == [0, 1, 2]  # hits on 0 and 1; the unhashed block 2 came back free
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)


# ---- preemption ---------------------------------------------------------------------------------


def test_preemption_recomputes_the_newest_running_sequence() -> None:
    sched, bm = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    a, b, c = (make_seq(7, max_tokens=4) for _ in range(3))
    for seq in (a, b, c):
        sched.add(seq)
    step(sched)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4, 5])
    out, _ = step(sched)  # every decode still fits in its second block
    assert scheduled(out) == [(a.seq_id, 1), (b.seq_id, 1), (c.seq_id, 1)]
    assert bm.num_free_blocks == 0

    d = make_seq(7, max_tokens=2)
    sched.add(d)
    out, _ = step(sched)
    # a needs a third block: c, the newest, goes; its blocks 5, 4 come back and a and b take them.
    assert out.preempted == [c]
    assert scheduled(out) == [(a.seq_id, 1), (b.seq_id, 1)]
    assert a.block_table == [0, 1, 4]
    assert b.block_table == [2, 3, 5]
    assert (c.status, c.block_table, c.num_computed_tokens) == (SequenceStatus.WAITING, [], 0)
    assert c.output_token_ids == [TOKEN, TOKEN]  # recompute keeps what was sampled
    assert list(sched.waiting) == [c, d]  # back at the front, and nothing admitted this step
    assert (c.num_preemptions, sched.num_preemptions) == (1, 1)

    out, finished = step(sched)
    assert scheduled(out) == [(a.seq_id, 1), (b.seq_id, 1)]  # c still has no room
    assert finished == [a, b]
    out, _ = step(sched)
    assert scheduled(out) == [(c.seq_id, 9), (d.seq_id, 7)]
    assert c.block_table == [2, 3, 5]
    assert d.block_table == [0, 1]
    out, finished = step(sched)
    assert scheduled(out) == [(c.seq_id, 1), (d.seq_id, 1)]
    assert finished == [c, d]
    assert c.finish_reason == FinishReason.LENGTH
    assert c.output_token_ids == [TOKEN] * 4
    assert bm.num_free_blocks == 6
    assert not sched.has_unfinished()


def test_the_newest_sequence_preempts_itself_when_it_is_the_one_short_of_blocks() -> None:
    sched, bm = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    a = make_seq(5, max_tokens=5)
    b = make_seq(7, max_tokens=3)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    assert (a.num_tokens, b.num_tokens) == (7, 9)
    out, _ = step(sched)
    assert out.preempted == [b]
    assert scheduled(out) == [(a.seq_id, 1)]
    assert a.block_table == [0, 1]
    assert bm.num_free_blocks == 2
    assert list(sched.waiting) == [b]
    assert sched.num_preemptions == 1

    run_until_done(sched)
    assert a.output_token_ids == [TOKEN] * 5
    assert b.output_token_ids == [TOKEN] * 3
    assert b.finish_reason == FinishReason.LENGTH
    assert bm.num_free_blocks == 4


def test_a_preempted_sequence_resumes_from_its_own_cached_blocks() -> None:
    sched, bm = make_scheduler(num_blocks=5)
    a = make_seq(7, max_tokens=4)
    c = make_seq(9, max_tokens=4)
    sched.add(a)
    sched.add(c)
    step(sched)
    assert (a.block_table, c.block_table) == ([0, 1], [2, 3, 4])
    step(sched)
    out, finished = step(sched)
    assert out.preempted == [c]
    assert a.block_table == [0, 1, 4]  # c's unhashed tail block; its full blocks stay cached
    assert list(bm.cached_free) == [3, 2]
    out, finished = step(sched)
    assert scheduled(out) == [(a.seq_id, 1)]
    assert finished == [a]
    out, _ = step(sched)
    assert scheduled(out) == [(c.seq_id, 3)]  # 11 tokens, 8 of them cached
    # ... by c itself before it was preempted: no prefix-cache hit, and one lookup counted.
    assert c.num_cached_tokens == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (16, 0)
    assert c.block_table == [2, 3, 4]
    assert c.output_token_ids == [TOKEN] * 3
    run_until_done(sched)
    assert c.output_token_ids == [TOKEN] * 4


def test_num_cached_tokens_after_a_preemption_is_the_real_prefix_hit() -> None:
    sched, bm = make_scheduler(num_blocks=6)
    prompt = list(range(100, 109))
    first = make_seq(prompt, max_tokens=1)
    sched.add(first)
    step(sched)  # caches blocks 0 and 1 (tokens 0-7) of the prompt
    a = make_seq(7, max_tokens=4)
    c = make_seq(prompt + [5, 6, 7], max_tokens=4)
    sched.add(a)
    sched.add(c)
    out, _ = step(sched)
    assert scheduled(out) == [(a.seq_id, 7), (c.seq_id, 4)]
    assert c.num_cached_tokens == 8
    step(sched)
    out, _ = step(sched)  # a needs a third block: c goes, its blocks 0-3 stay cached
    assert out.preempted == [c] and c.num_tokens == 14
    step(sched)  # a finishes
    out, _ = step(sched)
    assert scheduled(out) == [(c.seq_id, 2)]  # 12 of 14 tokens found cached on re-admission
    assert c.num_cached_tokens == 8  # but only the first 8 were a prefix-cache hit
    # Lookups: first (9), a (7), c once (12); hits: c's 8, not the 12 of its re-admission.
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (28, 8)


def test_recomputed_tokens_are_new_prompt_tokens_only_once() -> None:
    """What EngineCore counts as prompt tokens: each prompt token computed for the first time,
    whatever a preemption makes the sequence compute again."""
    sched, _ = make_scheduler(num_blocks=4, max_num_batched_tokens=4, enable_prefix_caching=False)
    a = make_seq(5, max_tokens=5)
    b = make_seq(7, max_tokens=3)
    sched.add(a)
    sched.add(b)
    counted = {a.seq_id: 0, b.seq_id: 0}
    while sched.has_unfinished():
        out = sched.schedule()
        for seq, num_new in out.scheduled:
            counted[seq.seq_id] += seq.num_new_prompt_tokens(num_new)
        sched.update(
            out,
            {
                s.seq_id: TOKEN
                for s, n in out.scheduled
                if s.num_computed_tokens + n == s.num_tokens
            },
        )
    assert b.num_preemptions > 0
    assert counted == {a.seq_id: 5, b.seq_id: 7}


# ---- fairness -----------------------------------------------------------------------------------


def test_a_budget_smaller_than_the_running_set_rotates_decodes() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=4)
    seqs = [make_seq(1, max_tokens=50) for _ in range(4)]
    for seq in seqs:
        sched.add(seq)
    step(sched)
    # Admission keeps the running set within the budget; a smaller one (here lowered) must not
    # starve the sequences that come last in the running order.
    sched.max_num_batched_tokens = 2
    served = []
    for _ in range(6):
        out, _ = step(sched)
        served.append({seq.seq_id for seq, _ in out.scheduled})
        assert out.num_batched_tokens == 2
    ids = [seq.seq_id for seq in seqs]
    assert served == [set(ids[:2]), set(ids[2:])] * 3
    for first, second in zip(served, served[1:]):
        assert first | second == set(ids)  # every sequence decodes within ceil(4 / 2) steps
    assert [seq.num_output_tokens for seq in seqs] == [4, 4, 4, 4]
    assert sched.running == seqs  # preemption still picks the newest: the order is untouched


def test_rotation_with_an_odd_budget_serves_every_sequence_within_two_steps() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=5)
    seqs = [make_seq(1, max_tokens=50) for _ in range(5)]
    for seq in seqs:
        sched.add(seq)
    step(sched)
    sched.max_num_batched_tokens = 3
    served = [[seq.seq_id for seq, _ in step(sched)[0].scheduled] for _ in range(8)]
    ids = [seq.seq_id for seq in seqs]
    assert served == [(ids * 5)[3 * i : 3 * i + 3] for i in range(8)]  # round robin: abc dea bcd
    for first, second in zip(served, served[1:]):
        assert set(first + second) == set(ids)
    assert [seq.num_output_tokens for seq in seqs] == [6, 6, 6, 6, 5]  # 24 decodes, in turn


# ---- abort --------------------------------------------------------------------------------------


def test_abort_frees_waiting_and_running_sequences_at_once() -> None:
    sched, bm = make_scheduler(max_num_seqs=1)
    running = make_seq(9, request_id="r1")
    waiting = make_seq(5, request_id="r2")
    keep = make_seq(5, request_id="r3")
    for seq in (running, waiting, keep):
        sched.add(seq)
    step(sched)
    assert running.block_table == [0, 1, 2]
    assert sched.abort({"nope"}) == []

    aborted = sched.abort({"r1", "r2"})
    assert aborted == [waiting, running]  # waiting ones are collected first
    for seq in aborted:
        assert seq.status == SequenceStatus.FINISHED
        assert seq.finish_reason == FinishReason.ABORT
        assert seq.block_table == []
    assert sched.running == []
    assert list(sched.waiting) == [keep]
    assert bm.num_free_blocks == 64
    assert ref_counts_of(bm, [0, 1, 2]) == [0, 0, 0]
    out, _ = step(sched)
    assert scheduled(out) == [(keep.seq_id, 5)]


def test_abort_releases_prefix_hits_held_by_a_waiting_sequence() -> None:
    sched, bm = make_scheduler(num_blocks=4)
    prompt = list(range(9))
    first = make_seq(prompt, max_tokens=1)
    sched.add(first)
    step(sched)
    hog = make_seq(8, max_tokens=50)
    sched.add(hog)
    step(sched)
    blocked = make_seq(prompt)
    sched.add(blocked)
    step(sched)
    assert blocked.status == SequenceStatus.WAITING
    held = list(blocked.block_table)
    sched.abort({blocked.request_id})
    assert ref_counts_of(bm, held) == [0] * len(held)
    assert blocked.block_table == []


def test_abort_finishes_every_sample_of_a_request() -> None:
    sched, bm = make_scheduler()
    prompt = list(range(10))
    parent, *children = add_request(sched, "multi", prompt, n=3, max_tokens=10)
    step(sched)
    step(sched)
    assert all(child.status == SequenceStatus.RUNNING for child in children)
    aborted = sched.abort({"multi"})
    assert {seq.seq_id for seq in aborted} == {parent.seq_id, *(c.seq_id for c in children)}
    assert all(seq.finish_reason == FinishReason.ABORT for seq in aborted)
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == 64
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_abort_of_a_request_whose_samples_wait_for_their_parent() -> None:
    sched, bm = make_scheduler(max_num_batched_tokens=4)
    seqs = add_request(sched, "multi", list(range(10)), n=2)
    step(sched)  # the parent's first chunk only
    assert seqs[1].fork_parent is seqs[0]
    aborted = sched.abort({"multi"})
    assert len(aborted) == 2
    assert seqs[1].fork_parent is None
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == 64


def ref_counts_of(bm: BlockManager, block_ids: list[int]) -> list[int]:
    return [bm.blocks[block_id].ref_count for block_id in block_ids]


# ---- stop conditions ----------------------------------------------------------------------------


def run_one(seq: Sequence, tokens: list[int], max_model_len: int = 256) -> list[Sequence]:
    """Feed `tokens` one per step to a lone `seq`; returns what finished at each step."""
    sched, bm = make_scheduler(max_model_len=max_model_len)
    sched.add(seq)
    for token in tokens:
        _, finished = step(sched, token)
        if finished:
            assert finished == [seq]
            assert seq.block_table == []
            assert bm.num_free_blocks == 64
            assert not sched.has_unfinished()
            break
    return [seq] if seq.is_finished else []


def test_eos_stops() -> None:
    seq = make_seq(5, eos_token_ids=frozenset({EOS}))
    run_one(seq, [7, 8, EOS, 9])
    assert seq.output_token_ids == [7, 8, EOS]
    assert seq.finish_reason == FinishReason.STOP
    assert seq.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    seq = make_seq(5, eos_token_ids=frozenset({EOS}), ignore_eos=True, max_tokens=3)
    run_one(seq, [EOS, EOS, EOS, EOS])
    assert seq.output_token_ids == [EOS, EOS, EOS]
    assert seq.finish_reason == FinishReason.LENGTH


def test_stop_token_ids_stop_and_are_recorded() -> None:
    seq = make_seq(5, stop_token_ids=[42], ignore_eos=True)
    run_one(seq, [7, 42, 9])
    assert seq.output_token_ids == [7, 42]
    assert seq.finish_reason == FinishReason.STOP
    assert seq.stop_reason == 42


def test_min_tokens_holds_back_eos_and_stop_tokens() -> None:
    seq = make_seq(5, eos_token_ids=frozenset({EOS}), stop_token_ids=[42], min_tokens=3)
    run_one(seq, [EOS, 42, EOS, 9])
    assert seq.output_token_ids == [EOS, 42, EOS]
    assert seq.finish_reason == FinishReason.STOP
    assert seq.stop_reason is None


def test_max_tokens_stops_with_length() -> None:
    seq = make_seq(5, max_tokens=3)
    run_one(seq, [7, 8, 9, 10])
    assert seq.output_token_ids == [7, 8, 9]
    assert seq.finish_reason == FinishReason.LENGTH


def test_a_stop_token_on_the_last_allowed_token_is_a_stop() -> None:
    seq = make_seq(5, eos_token_ids=frozenset({EOS}), max_tokens=2)
    run_one(seq, [7, EOS])
    assert seq.finish_reason == FinishReason.STOP


def test_max_model_len_stops_with_length() -> None:
    seq = make_seq(30, max_tokens=None)
    run_one(seq, [7] * 10, max_model_len=32)
    assert seq.num_tokens == 32
    assert seq.output_token_ids == [7, 7]
    assert seq.finish_reason == FinishReason.LENGTH


def test_finish_stopped_frees_a_running_sequence() -> None:
    sched, bm = make_scheduler()
    seq = make_seq(5)
    sched.add(seq)
    step(sched)
    sched.finish_stopped(seq)
    assert seq.finish_reason == FinishReason.STOP
    assert sched.running == []
    assert bm.num_free_blocks == 64
    sched.finish_stopped(seq)  # a second call changes nothing
    assert seq.finish_reason == FinishReason.STOP


@pytest.mark.parametrize("prompt_len", [32, 33])
def test_add_rejects_prompts_that_leave_no_room_to_generate(prompt_len: int) -> None:
    sched, _ = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(make_seq(prompt_len))
    assert not sched.has_unfinished()


def test_add_accepts_a_prompt_one_short_of_max_model_len() -> None:
    sched, _ = make_scheduler(max_model_len=32)
    seq = make_seq(31)
    sched.add(seq)
    _, finished = step(sched)
    assert finished == [seq]
    assert seq.finish_reason == FinishReason.LENGTH


# ---- n > 1 --------------------------------------------------------------------------------------


def test_samples_wait_for_the_parent_then_share_its_prompt_blocks() -> None:
    sched, bm = make_scheduler(num_blocks=16)
    prompt = list(range(10))
    parent, child1, child2 = add_request(sched, "multi", prompt, n=3)
    out, _ = step(sched)
    assert scheduled(out) == [(parent.seq_id, 10)]
    assert parent.block_table == [0, 1, 2]
    # Forked as the parent sampled its first token: the two full prompt blocks are shared.
    assert list(sched.waiting) == [child1, child2]
    for child in (child1, child2):
        assert child.fork_parent is None
        assert child.block_table == [0, 1]
        assert child.num_computed_tokens == 8
        assert child.token_ids == prompt
    assert [bm.blocks[i].ref_count for i in range(4)] == [3, 3, 1, 0]
    assert bm.num_free_blocks == 13

    out, _ = step(sched)
    assert scheduled(out) == [(parent.seq_id, 1), (child1.seq_id, 2), (child2.seq_id, 2)]
    assert child1.block_table == [0, 1, 3]
    assert child2.block_table == [0, 1, 4]
    assert child1.output_token_ids == [TOKEN]
    assert child2.output_token_ids == [TOKEN]
    out, _ = step(sched)
    assert scheduled(out) == [(parent.seq_id, 1), (child1.seq_id, 1), (child2.seq_id, 1)]


def test_samples_wait_through_a_chunked_parent_prefill() -> None:
    sched, bm = make_scheduler(max_num_batched_tokens=4)
    prompt = list(range(10))
    parent, child = add_request(sched, "multi", prompt, n=2)
    other = make_seq(3, request_id="other")
    sched.add(other)
    for num_new in (4, 4):
        out, _ = step(sched)
        assert scheduled(out) == [(parent.seq_id, num_new)]
        assert list(sched.waiting) == [child, other]
    out, _ = step(sched)
    # The parent's last 2 prompt tokens; the child is skipped over, so `other` gets the rest.
    assert scheduled(out) == [(parent.seq_id, 2), (other.seq_id, 2)]
    assert list(sched.waiting) == [child]
    assert child.block_table == [0, 1]
    assert child.num_computed_tokens == 8
    out, _ = step(sched)
    assert scheduled(out) == [(parent.seq_id, 1), (other.seq_id, 1), (child.seq_id, 2)]
    assert [bm.blocks[i].ref_count for i in range(2)] == [2, 2]


def test_a_two_block_prompt_shares_one_block() -> None:
    sched, bm = make_scheduler()
    prompt = list(range(8))
    parent, child = add_request(sched, "multi", prompt, n=2)
    step(sched)
    assert child.block_table == [0]
    assert child.num_computed_tokens == 4
    assert [bm.blocks[i].ref_count for i in range(3)] == [2, 1, 0]
    out, _ = step(sched)
    assert scheduled(out) == [(parent.seq_id, 1), (child.seq_id, 4)]
    # The child computes its own copy of block 1 (parent's block 1 is a cached duplicate).
    assert child.block_table == [0, 3]
    assert bm.blocks[3].block_hash is None


def test_samples_keep_shared_blocks_when_the_parent_finishes_at_once() -> None:
    sched, bm = make_scheduler()
    prompt = list(range(10))
    parent, child = add_request(sched, "multi", prompt, n=2, max_tokens=1)
    _, finished = step(sched)
    assert finished == [parent]
    assert child.block_table == [0, 1]
    assert [bm.blocks[i].ref_count for i in range(3)] == [1, 1, 0]
    out, finished = step(sched)
    assert scheduled(out) == [(child.seq_id, 2)]
    assert finished == [child]
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_fork_shares_blocks_without_prefix_caching() -> None:
    sched, bm = make_scheduler(enable_prefix_caching=False)
    parent, child = add_request(sched, "multi", list(range(10)), n=2)
    step(sched)
    assert child.block_table == [0, 1]
    assert [bm.blocks[i].ref_count for i in range(3)] == [2, 2, 1]
    out, _ = step(sched)
    assert scheduled(out) == [(parent.seq_id, 1), (child.seq_id, 2)]


def test_a_sample_whose_parent_left_unshared_prefills_on_its_own() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=4)
    parent, child = add_request(sched, "multi", list(range(10)), n=2)
    step(sched)
    parent.request_id = "parent-only"  # so an abort reaches the parent alone
    sched.abort({"parent-only"})
    out, _ = step(sched)
    assert scheduled(out) == [(child.seq_id, 4)]
    assert child.fork_parent is None


# ---- liveness -----------------------------------------------------------------------------------


def test_every_request_finishes_under_cache_pressure() -> None:
    sched, bm = make_scheduler(num_blocks=12, max_num_batched_tokens=16)
    shared = list(range(12))
    seqs = [make_seq(shared + [200 + i] * (i + 1), max_tokens=6 + i) for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    run_until_done(sched)
    for i, seq in enumerate(seqs):
        assert seq.finish_reason == FinishReason.LENGTH
        assert seq.num_output_tokens == 6 + i
    assert sched.num_preemptions > 0
    assert bm.num_free_blocks == 12
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_prefix_hits_held_by_a_blocked_waiting_sequence_do_not_deadlock() -> None:
    """A waiting sequence that matched cached blocks but could not be admitted keeps them.

    Here x holds cached block 0 while it waits; r then needs a second block, finds none (x has
    the only one), preempts itself and goes back in front of x. r needs both blocks, x holds
    one, and nothing is ever scheduled again. Each alone fits in the cache.
    """
    sched, bm = make_scheduler(num_blocks=2)
    warm = make_seq([1, 2, 3, 4, 5], max_tokens=1)
    sched.add(warm)
    step(sched)  # block 0 = [1, 2, 3, 4] is cached
    r = make_seq([10, 11, 12], max_tokens=5)  # 7 tokens to compute: fits in the 2 blocks
    sched.add(r)
    step(sched)  # r runs in block 1
    x = make_seq([1, 2, 3, 4, 9], max_tokens=1)
    sched.add(x)
    out, _ = step(sched)
    assert scheduled(out) == [(r.seq_id, 1)]
    assert x.status == SequenceStatus.WAITING  # x hit block 0 but needs a block r holds
    run_until_done(sched, max_steps=50)
    assert r.num_output_tokens == 5
    assert x.num_output_tokens == 1


def test_two_requests_under_preemption_with_prefix_caching_do_not_deadlock() -> None:
    """The same hold-and-wait with default settings and just two requests.

    b preempts itself (its full blocks 2, 3 stay cached); next step b re-hits them but a holds
    the rest, so b waits holding 2 and 3; then a needs a third block and preempts itself, going
    back in front of b. Each now holds two blocks and needs a third: nothing is ever scheduled.
    """
    sched, bm = make_scheduler(num_blocks=4)
    a = make_seq(5, max_tokens=8)
    b = make_seq(7, max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert out.preempted == [b]
    run_until_done(sched, max_steps=50)
    assert a.output_token_ids == [TOKEN] * 8
    assert b.output_token_ids == [TOKEN] * 8
