"""Frontend-side request state: detokenized text, stop strings, logprobs, RequestOutputs."""

from __future__ import annotations

from axon.engine.engine_core import SequenceUpdate
from axon.outputs import CompletionOutput, Logprob, RequestOutput
from axon.sampling import TokenLogprobs
from axon.sequence import Sequence
from axon.tokenizer.detokenizer import IncrementalDetokenizer


class SampleState:
    """One of a request's `n` samples as the client sees it."""

    def __init__(self, seq: Sequence, tokenizer):
        self.seq = seq
        params = seq.sampling_params
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.tokenizer = tokenizer
        self.text = ""
        self.emitted = 0  # characters of `text` already streamed
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, update: SequenceUpdate) -> bool:
        """Apply one step's update; returns True when a stop string ended the sample."""
        if update.token_id is not None:
            self.token_ids.append(update.token_id)
            if update.logprobs is not None:
                self._add_logprobs(update.logprobs)
            if self.detokenizer is not None:
                self.text += self.detokenizer.add(update.token_id)
                if self._match_stop_string():
                    return True
        if update.finished:
            self._finish()
        return False

    def _add_logprobs(self, lp: TokenLogprobs) -> None:
        entry = {
            tok: Logprob(val, rank=i + 1, decoded_token=self._piece(tok))
            for i, (tok, val) in enumerate(lp.top)
        }
        entry[lp.token_id] = Logprob(
            lp.logprob, rank=lp.rank, decoded_token=self._piece(lp.token_id)
        )
        self.logprobs.append(entry)
        self.cumulative_logprob += lp.logprob

    def _piece(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _match_stop_string(self) -> bool:
        params = self.seq.sampling_params
        if not params.stop:
            return False
        longest = max(len(s) for s in params.stop)
        start = max(0, self.emitted - longest)
        for stop in params.stop:
            index = self.text.find(stop, start)
            if index >= 0:
                end = index + len(stop) if params.include_stop_str_in_output else index
                self.text = self.text[:end]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        return False

    def _finish(self) -> None:
        if self.detokenizer is not None:
            self.text += self.detokenizer.flush()
        reason = self.seq.finish_reason
        self.finish_reason = reason.value if reason is not None else "stop"
        self.stop_reason = self.seq.stop_reason

    def new_text(self, finished: bool) -> str:
        """Text not streamed yet; holds back what could still become a stop string."""
        params = self.seq.sampling_params
        hold = 0 if finished or not params.stop else max(len(s) for s in params.stop) - 1
        end = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.seq.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, seqs: list[Sequence], tokenizer):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = seqs[0].prompt_token_ids
        self.samples = {seq.seq_id: SampleState(seq, tokenizer) for seq in seqs}

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())

    def to_output(self) -> RequestOutput:
        samples = sorted(self.samples.values(), key=lambda s: s.seq.index)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[s.output() for s in samples],
            finished=self.finished,
            num_cached_tokens=samples[0].seq.num_cached_tokens,
        )
