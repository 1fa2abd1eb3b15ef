"""The step's sampling: turning a forward's logits into each sequence's tokens (grammar masks,
penalties, thinking budgets, the verification of drafts) and the step's updates.

`StepSampling` is a part of `EngineCore`, kept in its own module; it reads the core's
`runner`, `scheduler`, `speculator`, `penalty_counts`, `config`, `eos_token_ids` and
`_captured_logits`, and calls its `_after_step` and `_take_prompt_logprobs`.
"""

from __future__ import annotations

import torch

from axon.engine.speculation import verified_drafts, verify_rows
from axon.outputs import TokenUpdate
from axon.sampling import SamplingMetadata
from axon.sequence import Sequence


class StepSampling:
    """EngineCore's sampling half: see the module docstring for what it reads."""

    def _finish_step(self, out, sampled: dict, logprobs: dict) -> list[TokenUpdate]:
        """A step without drafts: one update per scheduled sequence."""
        finished = self.scheduler.update(out, sampled)
        self.num_generation_tokens += len(sampled)
        take = self._take_prompt_logprobs
        updates = [
            self._update_of(seq, sampled, logprobs, prompt_logprobs=take(seq, sampled))
            for seq, _ in out.scheduled
        ]
        self._after_step(out, finished)
        return updates

    def _finish_drafted_step(self, out, sampled: dict, logprobs: dict) -> list[TokenUpdate]:
        """A step with drafts: each drafted sequence gives one update per token it kept (the
        finish reason on the last), the others one as usual."""
        before = {seq.seq_id: seq.num_output_tokens for seq, _ in out.scheduled}
        finished = self.scheduler.update(out, sampled)
        take = self._take_prompt_logprobs
        updates = []
        for seq, _ in out.scheduled:
            tokens = sampled.get(seq.seq_id)
            if not isinstance(tokens, list):
                self.num_generation_tokens += tokens is not None
                updates.append(self._update_of(seq, sampled, logprobs, None, take(seq, sampled)))
                continue
            kept = seq.num_output_tokens - before[seq.seq_id]
            self.num_generation_tokens += kept
            lps = logprobs.get(seq.seq_id) or [None] * kept
            for i in range(kept):
                update = self._update_of(seq, {seq.seq_id: tokens[i]}, {seq.seq_id: lps[i]})
                updates.append(update if i == kept - 1 else update._replace(finish_reason=None))
        self._after_step(out, finished)
        return updates

    @staticmethod
    def _update_of(
        seq: Sequence,
        sampled: dict,
        logprobs: dict,
        embedding: list[float] | None = None,
        prompt_logprobs: list | None = None,
    ) -> TokenUpdate:
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        return TokenUpdate(
            request_id=seq.request_id,
            index=seq.index,
            token_id=sampled.get(seq.seq_id),
            logprobs=logprobs.get(seq.seq_id),
            finish_reason=reason,
            stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_tokens,
            embedding=embedding,
            prompt_logprobs=prompt_logprobs,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
        )

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, offsets: list[int] | None):
        """seq_id -> its token and its logprobs; a drafted sequence's: the list it accepts."""
        if not seqs:
            return {}, {}
        if self._captured_logits is not None:
            for seq, row in zip(seqs, logits):
                self._captured_logits[seq.seq_id] = row.clone()
        vocab_size, device = self.runner.vocab_size, self.runner.device
        meta = SamplingMetadata.from_sequences(
            seqs, vocab_size, device, self.penalty_counts, offsets
        )
        grammars = [seq.grammar for seq in seqs]
        has_grammar = any(g is not None for g in grammars)
        if has_grammar:
            drafts = verified_drafts(seqs, offsets) if offsets is not None else None
            self.structured.apply_masks(grammars, logits, drafts)
        result = self.runner.sampler(logits, meta)
        if offsets is not None:
            sampled, logprobs = verify_rows(self.speculator, seqs, offsets, result)
        else:
            sampled = {seq.seq_id: tok for seq, tok in zip(seqs, result.token_ids)}
            logprobs = {seq.seq_id: lp for seq, lp in zip(seqs, result.logprobs) if lp is not None}
        self._advance_states(seqs, sampled, has_grammar)
        return sampled, logprobs

    def _advance_states(self, seqs: list[Sequence], sampled: dict, has_grammar: bool) -> None:
        """Feed each sequence's new tokens (a drafted one's: those it keeps) to its grammar
        and its thinking budget."""
        if not has_grammar and all(seq.thinking_budget is None for seq in seqs):
            return
        unique = list({seq.seq_id: seq for seq in seqs}.values())  # a drafted one has rows
        new = [sampled[seq.seq_id] for seq in unique]
        new = [tokens if isinstance(tokens, list) else [tokens] for tokens in new]
        if has_grammar:
            self.structured.advance([seq.grammar for seq in unique], new)
        for seq, tokens in zip(unique, new):
            for token_id in tokens if seq.thinking_budget is not None else ():
                seq.thinking_budget.advance(token_id)

    @property
    def structured(self):
        """The grammar backend (llguidance), made on first use: most engines never need it."""
        if self._structured is None:
            from axon.structured import StructuredOutputs  # lazy: llguidance, rarely needed

            path = self.config.tokenizer or self.config.model
            self._structured = StructuredOutputs(path, self.runner.vocab_size, self.eos_token_ids)
        return self._structured
