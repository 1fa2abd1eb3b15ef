"""The adaptive rule of speculation: a sequence whose drafts are rejected pauses, twice as long
after each failure in a row, and a draft that pays again ends the backoff; the n-gram drafter
cuts its drafts to the positions whose measured rate pays for their verify rows."""

from __future__ import annotations

import time

from axon.engine.drafter_ngram import MatchRates, NgramDrafter
from axon.engine.speculation import Speculator, min_acceptance
from axon.sampling_params import SamplingParams
from axon.sequence import Sequence
from axon.speculative_config import parse


class FixedDrafter:
    def propose(self, seqs, max_tokens):
        return [[7] * n for n in max_tokens]

    def release(self, seq_ids):
        pass


def _decoding_sequence() -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10_000))
    seq.append_token(4)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def _drafting_steps(speculator: Speculator, seq: Sequence, steps: int, accept: bool) -> list[int]:
    """Run `steps` steps; the step numbers at which `seq` drafted (all rejected or accepted)."""
    drafted = []
    for _ in range(steps):
        speculator.propose([seq])
        if seq.spec_token_ids:
            drafted.append(speculator.num_steps)
            rows = list(seq.spec_token_ids) + [9] if accept else [8] * (len(seq.spec_token_ids) + 1)
            speculator.accept(seq, rows)
    return drafted


def test_rejected_drafts_back_off_and_accepted_ones_end_it():
    spec = parse({"method": "ngram", "num_speculative_tokens": 4})
    speculator = Speculator(spec, FixedDrafter(), max_model_len=100_000)
    seq = _decoding_sequence()
    drafted = _drafting_steps(speculator, seq, 1100, accept=False)
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    # Optimistic at first: a few steps in a row, then it tries again 16, 32 ... 256 steps later.
    assert gaps[:2] == [1, 1]
    assert [gap for gap in gaps if gap > 1][:6] == [16, 32, 64, 128, 256, 256]
    # A draft that pays resets the backoff: the next failure pauses 16 steps again.
    assert _drafting_steps(speculator, seq, 300, accept=True)
    again = _drafting_steps(speculator, seq, 60, accept=False)
    assert [b - a for a, b in zip(again, again[1:]) if b - a > 1][:1] == [16]


def test_the_bar_rises_with_the_running_sequences():
    assert min_acceptance(1) < min_acceptance(4) < min_acceptance(16) < 1.0
    assert abs(min_acceptance(1) - 0.45) < 1e-9


class SlowDrafter(FixedDrafter):
    """Drafts that are always right, but take ten times a step's forward to make."""

    def propose(self, seqs, max_tokens):
        time.sleep(0.005)
        return super().propose(seqs, max_tokens)


def _timed_steps(speculator: Speculator, seq: Sequence, steps: int) -> list[int]:
    """Like `_drafting_steps` with every draft accepted, each step's forward timed at 0.5 ms."""
    drafted = []
    for _ in range(steps):
        speculator.propose([seq])
        rows = 1 + len(seq.spec_token_ids)
        speculator.time_step(rows, 0.0005)
        if seq.spec_token_ids:
            drafted.append(speculator.num_steps)
            speculator.accept(seq, list(seq.spec_token_ids) + [9])
    return drafted


def test_a_drafter_slower_than_the_step_stops_drafting_though_its_drafts_are_right():
    spec = parse({"method": "draft_model", "model": "draft", "num_speculative_tokens": 4})
    speculator = Speculator(spec, SlowDrafter(), max_model_len=100_000)
    seq = _decoding_sequence()
    drafted = _timed_steps(speculator, seq, 200)
    assert speculator.draft_cost > 1.0  # 5 ms for 4 tokens against a step of 0.5 ms
    assert min_acceptance(1, speculator.row_cost, speculator.draft_cost) > 1.0
    assert len(drafted) < 10  # paused, though all its drafts were accepted
    # ... and k d times as long as a fast drafter would (16 steps at first): its probes cost more.
    next_probe = drafted[3] if len(drafted) > 3 else speculator.num_steps + 1
    assert next_probe - drafted[2] > 16 * 4
    # Pinned costs (the engine tests' "every draft pays") leave the drafter's time out.
    pinned = Speculator(spec, SlowDrafter(), max_model_len=100_000)
    pinned.row_cost = 0.0
    assert len(_timed_steps(pinned, _decoding_sequence(), 20)) == 20


def _ngram_sequence(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(temperature=0.0, max_tokens=10_000))


def test_match_rates_count_each_position_until_the_first_wrong_token():
    rates = MatchRates(range(2, 4))
    rates.observe(2, drafted=4, correct=1)
    assert [rates.rate(2, i) for i in range(4)] == [1.0, 0.0, 0.0, 0.0]
    rates.observe(2, drafted=4, correct=3)
    assert [rates.rate(2, i) for i in range(4)] == [1.0, 0.5, 0.5, 0.0]
    assert rates.rate(3, 0) == 1.0  # nothing seen of length 3: optimistic
    assert rates.cut(2, [5, 6, 7, 8], required=0.5) == [5, 6, 7]
    assert rates.cut(2, [5, 6, 7, 8], required=0.6) == [5]
    assert rates.cut(2, [5, 6, 7, 8], required=0.0) == [5, 6, 7, 8]


def test_the_ngram_drafter_checks_its_lookups_against_the_tokens_that_followed():
    drafter = NgramDrafter(2, 2)
    seq = _ngram_sequence([1, 2, 3, 4, 9, 1, 2])  # [1, 2] was followed by 3, 4, 9
    assert drafter.propose([seq], [3]) == [[3, 4, 9]]
    # One token a step, as a sequence that did not draft gets them: the lookup stays open
    # while its tokens come true, and counts when the third is wrong.
    for token in (3, 4):
        seq.append_token(token)
        drafter.propose([seq], [0])
        assert drafter.rates.rate(2, 0) == 1.0 and not drafter.rates._counts[2]
    seq.append_token(5)
    drafter.propose([seq], [0])
    assert [drafter.rates.rate(2, i) for i in range(3)] == [1.0, 1.0, 0.0]


def test_the_ngram_drafter_cuts_drafts_to_the_positions_that_pay():
    drafter = NgramDrafter(2, 2)
    drafter.rates.observe(2, drafted=3, correct=1)  # the first token right, the rest wrong
    seq = _ngram_sequence([1, 2, 3, 4, 9, 1, 2])
    drafter.required = 0.5
    assert drafter.propose([seq], [3]) == [[3]]
    drafter.required = 1.5  # nothing pays (a drafter slower than a step)
    assert drafter.propose([seq], [3]) == [[]]
    drafter.required = 0.0
    assert drafter.propose([seq], [3]) == [[3, 4, 9]]


def test_a_sequences_own_rates_outweigh_the_engines_as_its_lookups_come_in():
    engine, own = MatchRates(range(2, 3)), MatchRates(range(2, 3))
    for _ in range(50):
        engine.observe(2, drafted=1, correct=0)  # free text: no lookup came true
    assert own.rate(2, 0, prior=engine) == engine.rate(2, 0) == 0.0
    for _ in range(8):
        own.observe(2, drafted=1, correct=1)  # this sequence repeats itself
    assert own.rate(2, 0, prior=engine) == 0.5  # as many of its own as the half weight
    for _ in range(32):
        own.observe(2, drafted=1, correct=1)
    assert own.rate(2, 0, prior=engine) == 40 / 48


def test_in_one_batch_a_repeating_sequence_drafts_and_a_free_one_is_cut():
    drafter = NgramDrafter(2, 2)
    for _ in range(50):
        drafter.rates.observe(2, drafted=3, correct=0)  # the engine's: mostly free text
    repeating = _ngram_sequence([1, 2, 3, 4, 9, 1, 2])
    free = _ngram_sequence([5, 6, 7, 8, 5, 6])
    drafter.required = 0.5
    assert drafter.propose([repeating, free], [3, 3]) == [[], []]
    for _ in range(40):  # its own lookups came true
        drafter._indexes[repeating.seq_id].rates.observe(2, drafted=3, correct=3)
    assert drafter.propose([repeating, free], [3, 3]) == [[3, 4, 9], []]


def test_the_speculator_tells_the_drafter_the_acceptance_a_draft_needs():
    spec = parse({"method": "ngram", "num_speculative_tokens": 4})
    drafter = NgramDrafter(2, 4)
    speculator = Speculator(spec, drafter, max_model_len=100_000)
    running = [_decoding_sequence() for _ in range(4)]
    speculator.propose(running)
    assert drafter.required == min_acceptance(4, speculator.row_cost)
    speculator.row_cost = 0.0  # pinned (the engine tests): every draft pays, nothing is cut
    speculator.propose(running)
    assert drafter.required == 0.0
