"""A sequence's thinking budget: which token, if any, the engine must emit next.

Pure Python, kept on the sequence (`Sequence.thinking_budget`) and advanced with every token it
emits, so preemption (which recomputes the same tokens) leaves it right. Once thinking has taken
`SamplingParams.thinking_limit()` tokens without closing, the end-of-thinking tokens are forced
one a step; a model that closes thinking itself is left alone.
"""

from __future__ import annotations

import copy

from axon.sampling_params import SamplingParams

_BEFORE, _THINKING, _CLOSING, _DONE = "before", "thinking", "closing", "done"


class ThinkingBudget:
    def __init__(self, params: SamplingParams) -> None:
        self.limit = params.thinking_limit() or 0
        self.start_id = params.thinking_start_token_id
        self.end_ids = list(params.thinking_end_token_ids)
        self.state = _THINKING if params.thinking_in_prompt else _BEFORE
        self.num_thinking = 0  # tokens generated inside thinking, markers excluded
        self.num_forced = 0  # end tokens emitted by force so far

    @classmethod
    def of(cls, params: SamplingParams) -> ThinkingBudget | None:
        """The budget of a request that sets one, else None."""
        return cls(params) if params.thinking_token_budget is not None else None

    def forced_token(self) -> int | None:
        """The token the next step must emit, or None when the sampler chooses."""
        if self.state == _CLOSING:
            return self.end_ids[self.num_forced]
        if self.state == _THINKING and self.num_thinking >= self.limit:
            return self.end_ids[0]
        return None

    def after(self, token_ids: list[int]) -> ThinkingBudget:
        """A copy of this budget advanced by `token_ids` (a draft's row sees the drafts before
        it); this one is left unchanged."""
        budget = copy.copy(self)
        for token_id in token_ids:
            budget.advance(token_id)
        return budget

    def advance(self, token_id: int) -> None:
        """Take the token the sequence just emitted."""
        forced = self.forced_token()
        if self.state == _BEFORE:
            # Thinking opens only as the output's first token; anything else means none.
            self.state = _THINKING if token_id == self.start_id else _DONE
        elif self.state == _THINKING:
            if token_id != self.end_ids[0]:
                self.num_thinking += 1
            elif forced is not None and len(self.end_ids) > 1:
                self.state, self.num_forced = _CLOSING, 1
            else:
                self.state = _DONE
        elif self.state == _CLOSING:
            self.num_forced += 1
            if self.num_forced == len(self.end_ids):
                self.state = _DONE

    @property
    def done(self) -> bool:
        return self.state == _DONE
