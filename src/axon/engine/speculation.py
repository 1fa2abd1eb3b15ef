"""Speculative decoding in the engine: which sequences draft, and what verification accepts.

Before a step, `propose` gives each eligible running decode up to k drafts
(`Sequence.spec_token_ids`); the scheduler counts them as extra query tokens of that decode and
the runner returns logits for its 1 + k rows. After the forward every row is sampled as its own
output position (row i as position num_output_tokens + i, with the sampler's deterministic
(seed, position) noise), and `accept` keeps the sampled tokens while each equals the draft
before it: the first mismatch is the target's own token. For a one-hot proposal (n-gram) this
is the standard accept / resample rule, and the tokens are the ones the engine without drafts
would have sampled, greedy and seeded alike.

Adaptive: a draft pays when its expected accepted tokens cost less than the tokens the step
makes anyway. One step's forward of T rows costs about 1 + c * (T - 1) one-row steps: the
weights are read once a step, every row adds its compute. c is measured while serving
(engine/row_cost.py: the engine times its decode-only steps and fits it, from a prior of 0.45).
Drafting a token costs d more (the drafter's time per draft token over a one-row step's, also
measured: a draft model's forwards, the MTP block's; n-gram lookup's is next to nothing). With
B sequences running a token costs (1 + c (B - 1)) / B and a draft token (c + d) / acceptance,
so a sequence drafts while the EWMA of its acceptance (accepted / drafted) exceeds
(c + d) B / (1 + c (B - 1)) (with c = 0.45, d = 0: 0.45 alone, 0.77 with 4 running, 0.92 with
16; a drafter slower than a step never pays). Below it, a sequence pauses `_PAUSE_STEPS`
steps and then tries again, twice as long after each pause in a row (text with nothing to copy
stops costing anything), and k d times as long where a probe's k drafts take more than a step
to make; above `max_seqs` running sequences nobody drafts.

The same bar applies to each draft position: the drafter is told it every step (`required`),
and the n-gram lookup cuts each draft before the first position whose measured rate of coming
true is below it (engine/drafter_ngram.py: per match length and position, from every lookup
it makes, verified or not). With several sequences running, where the bar is
0.5-0.9, a two-token match in free text (right about one time in three at its first position,
one in ten past it) then drafts nothing, and a long match in text that repeats its prompt
drafts in full: the first drafts of a sequence with nothing to copy are no longer k blind
probes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from axon.engine.drafting import Drafter
from axon.engine.row_cost import ROW_COST_PRIOR, RowCost
from axon.sequence import Sequence
from axon.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

_EWMA_WEIGHT = 0.3  # of the newest step's acceptance
ROW_COST = ROW_COST_PRIOR  # one more row of a step, in one-row steps, before any is measured
_PAUSE_STEPS = 16  # steps without drafts before a paused sequence tries again, at first
_MAX_PAUSE_DOUBLINGS = 4  # the longest pause: 16 << 4 = 256 steps
DEFAULT_MAX_SEQS = 16  # where drafts would need 84% acceptance to pay


def min_acceptance(num_running: int, row_cost: float = ROW_COST, draft_cost: float = 0.0) -> float:
    """The acceptance above which a draft pays with `num_running` sequences in the step: a
    draft token costs its verify row plus its drafting (`draft_cost`, in one-row steps too)."""
    return (row_cost + draft_cost) * num_running / (1 + row_cost * (num_running - 1))


@dataclass
class _Acceptance:
    rate: float = 1.0  # EWMA of accepted / drafted, optimistic at first
    paused_until: int = 0  # the step from which it may draft again
    pauses: int = 0  # pauses in a row: each one doubles the next


class Speculator:
    """Drafts for a step's decodes and verifies them; keeps the acceptance statistics."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        drafter: Drafter,
        max_model_len: int,
        max_seqs: int = DEFAULT_MAX_SEQS,
    ) -> None:
        self.k = spec.num_speculative_tokens
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.max_seqs = max_seqs
        self.num_steps = 0
        self.row_costs = RowCost()
        self._fixed_row_cost: float | None = None
        self.draft_cost = 0.0  # EWMA: drafting one token, in one-row steps (measured)
        self._draft_seconds = 0.0  # the latest step's drafting
        self._drafted = 0  # its draft tokens, while they may be measured
        self._required = min_acceptance(1)
        self._acceptance: dict[int, _Acceptance] = {}
        # vLLM's spec_decode counters: drafts (sequences that drafted, per step), their tokens,
        # the accepted ones, and how often the i-th draft token was accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.k

    @property
    def row_cost(self) -> float:
        """One more row of a step, in one-row steps: measured (`row_costs`), unless set."""
        fixed = self._fixed_row_cost
        return self.row_costs.value if fixed is None else fixed

    @row_cost.setter
    def row_cost(self, value: float) -> None:
        self._fixed_row_cost = value

    def time_step(self, rows: int, seconds: float) -> None:
        """Count a decode-only step's forward (`rows` rows, drafts included) in the row cost,
        and the drafting of its drafts against what one row of it cost."""
        self.row_costs.observe(rows, seconds)
        if self._drafted and seconds > 0.0:
            one_row = seconds / (1 + self.row_costs.value * (rows - 1))
            sample = self._draft_seconds / self._drafted / one_row
            self.draft_cost += _EWMA_WEIGHT * (sample - self.draft_cost)
        self._drafted = 0

    def propose(self, running: list[Sequence]) -> None:
        """Set each running sequence's drafts for the coming step (none for most)."""
        self.num_steps += 1
        for seq in running:
            seq.spec_token_ids = []
        if len(running) > self.max_seqs:
            return
        self._drafted = 0
        self._required = min_acceptance(len(running), self.row_cost, self._draft_cost())
        self.drafter.required = self._required
        seqs = [seq for seq in running if self._may_draft(seq)]
        limits = [self._limit(seq) for seq in seqs]
        seqs, limits = [s for s, n in zip(seqs, limits) if n], [n for n in limits if n]
        if not seqs:
            return
        started = time.perf_counter()
        drafts = self.drafter.propose(seqs, limits)
        self._draft_seconds = time.perf_counter() - started
        for seq, draft, limit in zip(seqs, drafts, limits):
            seq.spec_token_ids = grammar_prefix(seq, list(draft[:limit]))
        # A sequence's first drafts include the drafter's catching up with its whole prompt (a
        # draft model prefills it): not what drafting a token costs from then on.
        if all(seq.seq_id in self._acceptance for seq in seqs):
            self._drafted = sum(len(seq.spec_token_ids) for seq in seqs)

    def _draft_cost(self) -> float:
        """Drafting a token, in one-row steps; left out where the row cost is pinned (tests:
        every draft pays)."""
        return 0.0 if self._fixed_row_cost is not None else self.draft_cost

    def _may_draft(self, seq: Sequence) -> bool:
        """A decode after its first token, not paused. Penalties, a grammar and a thinking
        budget draft too: each row is sampled as after the drafts before it."""
        if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_output_tokens < 1:
            return False
        if seq.pooling:
            return False
        state = self._acceptance.get(seq.seq_id)
        return state is None or state.paused_until <= self.num_steps

    def _limit(self, seq: Sequence) -> int:
        """Drafts that can still become output: the step gives 1 + drafts tokens at most."""
        limit = min(self.k, self.max_model_len - seq.num_tokens - 1)
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - seq.num_output_tokens - 1)
        return max(0, limit)

    def accept(self, seq: Sequence, row_tokens: list[int]) -> list[int]:
        """The tokens `seq` keeps from its drafts and the sampled `row_tokens` (one per row,
        1 + drafts): the drafts while each equals the target's token at its row, then the
        target's own token at the first row that differs (or past the last draft). Updates the
        statistics."""
        drafts = seq.spec_token_ids
        accepted = 0
        while accepted < len(drafts) and row_tokens[accepted] == drafts[accepted]:
            accepted += 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
        seq.num_draft_tokens += len(drafts)
        seq.num_accepted_tokens += accepted
        self._observe(seq.seq_id, accepted / len(drafts))
        return [*drafts[:accepted], row_tokens[accepted]]

    def _observe(self, seq_id: int, rate: float) -> None:
        state = self._acceptance.setdefault(seq_id, _Acceptance())
        state.rate += _EWMA_WEIGHT * (rate - state.rate)
        if state.rate >= self._required:
            state.pauses = 0
            return
        doublings = min(state.pauses, _MAX_PAUSE_DOUBLINGS)
        # A probe drafts k tokens at d steps each: a slow drafter pauses longer, so that its
        # probes cost no more of the decode than a fast drafter's.
        scale = max(1.0, self.k * self._draft_cost())
        state.paused_until = self.num_steps + int((_PAUSE_STEPS << doublings) * scale)
        state.pauses += 1
        state.rate = self._required  # tried again later from the threshold, not below it

    def release(self, seqs: list[Sequence]) -> None:
        """Forget finished, aborted or preempted sequences."""
        if not seqs:
            return
        for seq in seqs:
            seq.spec_token_ids = []
            if seq.is_finished:
                self._acceptance.pop(seq.seq_id, None)
        self.drafter.release(seq.seq_id for seq in seqs)

    def stats(self) -> dict:
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_position": list(self.accepted_per_position),
        }


def empty_stats(k: int = 0) -> dict:
    """The statistics of an engine that does not speculate."""
    return {
        "spec_num_drafts": 0,
        "spec_num_draft_tokens": 0,
        "spec_num_accepted_tokens": 0,
        "spec_accepted_per_position": [0] * k,
    }


def verify_rows(speculator: Speculator, seqs: list[Sequence], offsets: list[int], result):
    """The sampler's `result` over rows (row j of `seqs[j]`, output offset `offsets[j]`) as
    seq_id -> token and seq_id -> logprobs; a drafted sequence's values are the lists of the
    tokens it keeps (accepted drafts, then the target's own token) and their logprobs."""
    sampled, logprobs = {}, {}
    row, num_rows = 0, len(seqs)
    while row < num_rows:
        seq = seqs[row]
        end = row + 1
        while end < num_rows and offsets[end] > 0:
            end += 1
        lps = result.logprobs[row:end]
        if end - row == 1:
            sampled[seq.seq_id] = result.token_ids[row]
            if lps[0] is not None:
                logprobs[seq.seq_id] = lps[0]
        else:
            kept = speculator.accept(seq, result.token_ids[row:end])
            sampled[seq.seq_id] = kept
            if lps[0] is not None:
                logprobs[seq.seq_id] = lps[: len(kept)]
        row = end
    return sampled, logprobs


def grammar_prefix(seq: Sequence, draft: list[int]) -> list[int]:
    """The drafts up to the first that `seq`'s grammar rejects (none: no point verifying a
    token the target may not sample); the matcher is left unchanged."""
    if seq.grammar is None or not draft:
        return draft
    return draft[: seq.grammar.validate_tokens(draft)]


def verified_drafts(seqs: list[Sequence], offsets: list[int]) -> list[list[int]]:
    """Per row (row j of `seqs[j]`, output offset `offsets[j]`): at a drafted sequence's first
    row the drafts its next rows verify, else []."""
    drafts: list[list[int]] = [[] for _ in seqs]
    for row, (seq, offset) in enumerate(zip(seqs, offsets)):
        if offset:
            drafts[row - offset] = seq.spec_token_ids[:offset]
    return drafts
