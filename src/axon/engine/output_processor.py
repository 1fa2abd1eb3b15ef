"""Frontend-side request state: detokenized text, stop strings, logprobs, RequestOutputs.

Lives wherever the tokenizer is (the HTTP process when serving) and consumes the engine's
TokenUpdates, so it never touches the device.
"""

from __future__ import annotations

from axon.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs, TokenUpdate
from axon.sampling_params import SamplingParams
from axon.tokenizer.detokenizer import IncrementalDetokenizer


class SampleState:
    """One of a request's `n` samples as the client sees it."""

    def __init__(self, index: int, params: SamplingParams, prompt_token_ids: list[int], tokenizer):
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.detokenizer = None
        if tokenizer is not None:
            self.detokenizer = IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.skip_special_tokens
            )
        self.text = ""
        self.emitted = 0  # characters of `text` already streamed
        self.token_ids: list[int] = []
        want_logprobs = params.logprobs is not None
        self.logprobs = SampleLogprobs(tokenizer) if want_logprobs else None
        self.cumulative_logprob = 0.0 if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.num_draft_tokens = 0  # speculative decoding's running totals (TokenUpdate's)
        self.num_accepted_tokens = 0
        # vLLM's prompt_logprobs (the first sample's, once its first token came): None for the
        # first prompt token, then token id -> Logprob per position
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, update: TokenUpdate) -> bool:
        """Apply one step's update; returns True when a stop string ended the sample (the
        caller must then stop the engine's sequence)."""
        if self.finished:
            return False
        self.num_cached_tokens = update.num_cached_tokens
        self.num_draft_tokens = update.num_draft_tokens
        self.num_accepted_tokens = update.num_accepted_tokens
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = [
                None if lp is None else self._entry(*lp) for lp in update.prompt_logprobs
            ]
        if update.token_id is not None:
            self.token_ids.append(update.token_id)
            if update.logprobs is not None and self.logprobs is not None:
                self._add_logprobs(update.logprobs)
            if self.detokenizer is not None:
                self.text += self.detokenizer.add(update.token_id)
                if self._match_stop_string():
                    return True
        if update.finish_reason is not None:
            if self.detokenizer is not None:
                self.text += self.detokenizer.flush()
            self.finish_reason, self.stop_reason = update.finish_reason, update.stop_reason
        return False

    def _add_logprobs(self, lp) -> None:
        self.logprobs.add(lp)
        self.cumulative_logprob += lp.logprob

    def _entry(self, token_id: int, logprob: float, rank: int, top: list) -> dict[int, Logprob]:
        """One position's token id -> Logprob: the top ones ranked 1.., and the token's own."""
        entry = {
            tok: Logprob(val, rank=i + 1, decoded_token=self._piece(tok))
            for i, (tok, val) in enumerate(top)
        }
        entry[token_id] = Logprob(logprob, rank=rank, decoded_token=self._piece(token_id))
        return entry

    def _piece(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _match_stop_string(self) -> bool:
        stops = self.params.stop
        if not stops:
            return False
        start = max(0, self.emitted - max(len(s) for s in stops))
        for stop in stops:
            index = self.text.find(stop, start)
            if index >= 0:
                keep = index + len(stop) if self.params.include_stop_str_in_output else index
                self.text = self.text[:keep]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        return False

    def new_text(self) -> str:
        """Text not streamed yet; holds back a tail that could still become a stop string."""
        stops = self.params.stop
        hold = 0 if self.finished or not stops else max(len(s) for s in stops) - 1
        end = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.samples = [
            SampleState(i, params, prompt_token_ids, tokenizer) for i in range(params.n)
        ]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt's logprobs when the params ask for them (the first sample carries them);
        None until its first token."""
        return self.samples[0].prompt_logprobs

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[s.output() for s in self.samples],
            finished=self.finished,
            num_cached_tokens=self.samples[0].num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )
