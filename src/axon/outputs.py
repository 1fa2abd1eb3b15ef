"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class SampleLogprobs(Sequence):
    """A sample's per-token logprobs, read as vLLM's `list[dict[int, Logprob]]` (per position:
    token id -> Logprob, the top ones ranked 1.. and the sampled token's own), but held as one
    flat tuple of plain numbers per position, the dicts built (and tokens decoded) when a
    position is read. A served n: 128 x 300 answer with top_logprobs: 20 held 800,000 Logprob
    objects as long as the request lived, and every full pass of Python's cyclic GC walked them
    all while holding the GIL (0.1-0.4 s of a stalled event loop each); a tuple of numbers is
    untracked by the GC once a collection has seen it. What a read returns is built anew:
    changing it changes nothing here."""

    __slots__ = ("_rows", "_tokenizer")

    def __init__(self, tokenizer=None):
        # per position: (token_id, logprob, rank, top1_id, top1_logprob, top2_id, ...)
        self._rows: list[tuple] = []
        self._tokenizer = tokenizer  # decodes the tokens of what is read; None: no text

    def add(self, lp) -> None:
        """Appends a position from `lp`'s token_id, logprob, rank and top [(id, logprob)]."""
        self._rows.append((lp.token_id, lp.logprob, lp.rank, *chain.from_iterable(lp.top)))

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._entry(row) for row in self._rows[index]]
        return self._entry(self._rows[index])

    def _entry(self, row: tuple) -> dict[int, Logprob]:
        entry = {
            row[i]: Logprob(row[i + 1], rank=(i - 1) // 2, decoded_token=self._piece(row[i]))
            for i in range(3, len(row), 2)
        }
        entry[row[0]] = Logprob(row[1], rank=row[2], decoded_token=self._piece(row[0]))
        return entry

    def _piece(self, token_id: int) -> str | None:
        return self._tokenizer.decode([token_id]) if self._tokenizer is not None else None

    def __eq__(self, other) -> bool:
        if isinstance(other, SampleLogprobs | list):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # as a list's

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):  # pickled as the list it reads as: the tokenizer stays here
        return list, (list(self),)


class TokenUpdate(NamedTuple):
    """One sample's progress in one engine step. A NamedTuple: it crosses the engine pipe as
    the plain tuple of its fields and is rebuilt from it without a call per field
    (axon.engine.messages)."""

    request_id: str
    index: int  # which of the request's `n` samples
    token_id: int | None  # None when only a prompt chunk was computed
    # axon.sampling.TokenLogprobs in the engine; axon.engine.messages.WireLogprobs past the pipe
    logprobs: Any = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's pooled vector, once finished
    # With the first token of a sample that asked for them: per prompt token, None for the first,
    # then (token_id, logprob, rank, top [(token_id, logprob)]) as TokenLogprobs' fields
    prompt_logprobs: list | None = None
    # Speculative decoding: the sample's running totals of drafted and accepted draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Sequence[dict[int, Logprob]] | None = None  # a SampleLogprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # vLLM's: None for the first prompt token, then token id -> Logprob (with the top k)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
