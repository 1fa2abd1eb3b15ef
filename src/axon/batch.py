"""What one engine step computes: the scheduler's decision, which the runner turns into a flat
batch. It sits below both so the runner needs nothing from the engine. Pure Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from axon.sequence import Sequence


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num_new_tokens)
    preempted: list[Sequence] = field(default_factory=list)
    # Hybrid models: (state slot, snapshot index) copies the runner makes before the step ...
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    # ... and (state slot, computed tokens, snapshot index): the slot's state once that many of
    # its sequence's tokens are computed, captured during the step, inside a chunk or at its end.
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    # Speculative decoding on hybrid models: (state slot, computed tokens, scratch index) after
    # each draft, captured like the saves above; the accepted one is restored into the slot by
    # the next step's `state_restores`. Never a prefix snapshot.
    draft_state_saves: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
