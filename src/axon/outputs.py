"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


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


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
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
