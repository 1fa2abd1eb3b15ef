"""Qwen3.5's multi-token-prediction block as the drafter (speculative_config method mtp).

The block (models/qwen3_5_mtp.py) reads, for each position t, the target's final hidden state
at t and the token at t+1, and predicts the token at t+2. Its row t is computed once both are
known and accepted: the runner hands every forward's hidden states to `_on_hidden` (the
runner's `hidden_sink`), which feeds at once the rows whose next token is already known (a
prompt chunk's) and keeps the others, one per sequence and step (the last token's, whose next
token is being sampled) or 1 + k after a verify step, until the next forward or `propose`:
there the rows past the sequence's computed tokens (rejected drafts) are dropped and the rest
fed. Drafting a sequence of n tokens feeds row n - 2 (the last token's) for the first draft,
then applies the block to its own output hidden state k - 1 times.

The block's KV cache mirrors the target's: row t lives in the target's cache slot of position
t (same block table), so block bookkeeping, rollback, prefix hits and preemption are the
target's. A prefix hit finds the rows its blocks' last writer computed (for the last position
of a block, with that writer's next token: a possibly worse draft, never a wrong output).
Draft rows, past the target's computed tokens, go to scratch slots after the mirrored ones.
The drafts are the block's argmax (a one-hot proposal, as the draft model's).

The block is not sharded: with tensor parallelism it would need every rank; the model refuses
to build it there (models/qwen3_5_mtp.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from axon.config import EngineConfig
from axon.layers.forward_context import AttentionMetadata, PrefillChunk, set_forward_context
from axon.runner import host_memory
from axon.runner.memory import kv_cache_shape
from axon.runner.model_runner import ModelRunner
from axon.sequence import Sequence


@dataclasses.dataclass
class _Pending:
    """A sequence's target hidden states not yet fed to the block: rows [start, start + n)."""

    start: int
    rows: torch.Tensor  # [n, hidden]

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


class MtpDrafter:
    """Drafts with the target's own MTP block (`runner.model.mtp`), for every sequence at once."""

    required = 0.0  # not used: its drafts are never cut

    def __init__(self, config: EngineConfig, runner: ModelRunner):
        """Raises ValueError when the target has no MTP block loaded."""
        self.mtp = getattr(runner.model, "mtp", None)
        if self.mtp is None:
            raise ValueError(
                f"speculative_config.method mtp needs the model's MTP weights (mtp.*), and "
                f"{config.model!r} ({runner.hf_config.model_type}) has no MTP block: only Qwen3.5 "
                "and Qwen3.5-MoE checkpoints with mtp.* weights (or GGUF files with nextn "
                "tensors) do; use ngram or draft_model"
            )
        self.runner = runner
        self.k = config.speculative_config.num_speculative_tokens
        self.vocab_size = runner.vocab_size
        self.num_slots = runner.plan.num_tokens  # the mirrored ones; scratch after them
        scratch = config.max_num_seqs * max(self.k - 1, 1)
        attention = self.mtp.attention
        kv_dtype = runner.config.kv_torch_dtype(runner.dtype)
        shape = kv_cache_shape(
            1, self.num_slots + scratch, attention.num_kv_heads, attention.head_dim, kv_dtype
        )
        self.kv_cache = host_memory.zeros(shape, kv_dtype, runner.device)
        attention.k_cache, attention.v_cache = self.kv_cache[0, 0], self.kv_cache[1, 0]
        self.pending: dict[int, _Pending] = {}
        runner.hidden_sink = self._on_hidden

    # ---- the Drafter protocol ---------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """Up to max_tokens[i] greedy drafts to follow seqs[i] (none for a sequence whose last
        token's hidden state the drafter has not seen)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        work, active = [], []
        for index, (seq, wanted) in enumerate(zip(seqs, max_tokens)):
            pending = self._accepted(seq)
            if wanted <= 0 or pending is None or pending.end != seq.num_tokens - 1:
                continue
            del self.pending[seq.seq_id]
            work.append((seq, pending))
            active.append(index)
        if not work:
            return drafts
        out = self._feed(work)
        ends = torch.tensor([0, *[p.rows.shape[0] for _, p in work]]).cumsum(0)[1:] - 1
        hidden = out[ends.to(out.device)]  # [B, hidden] each sequence's row n - 2
        tokens = self._argmax(hidden)
        for index, token in zip(active, tokens):
            drafts[index].append(token)
        lanes = list(range(len(active)))  # each sequence's scratch slots, fixed for the call
        for step in range(1, self.k):
            live = [i for i, index in enumerate(active) if max_tokens[index] > step]
            if not live:
                break
            active, lanes = [active[i] for i in live], [lanes[i] for i in live]
            last = [drafts[index][-1] for index in active]
            chosen = hidden[torch.tensor(live, device=hidden.device)]
            hidden = self._draft_step([seqs[i] for i in active], lanes, last, chosen, step)
            for index, token in zip(active, self._argmax(hidden)):
                drafts[index].append(token)
        return drafts

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self.pending.pop(seq_id, None)

    # ---- the target's hidden states ---------------------------------------------------------

    @torch.inference_mode()
    def _on_hidden(self, hidden: torch.Tensor) -> None:
        """A target forward's final hidden states [T, hidden], rows in scheduled order: feed the
        rows whose next token is known, keep the others."""
        work, row = [], 0
        for seq, num_new in self.runner.scheduled:
            start = seq.num_computed_tokens
            rows = hidden[row : row + num_new]
            row += num_new
            pending = self._accepted(seq)
            if pending is None or pending.end != start:  # a new sequence, or a prefix hit
                pending = _Pending(start, rows[:0])
            pending.rows = torch.cat([pending.rows, rows])  # a copy: the runner reuses buffers
            ready = min(pending.end, seq.num_tokens - 1) - pending.start
            if ready > 0:
                work.append((seq, _Pending(pending.start, pending.rows[:ready])))
            if pending.end - pending.start > ready:
                kept = pending.rows[ready:].clone()  # not a view holding a whole chunk's rows
                self.pending[seq.seq_id] = _Pending(pending.start + ready, kept)
            else:
                self.pending.pop(seq.seq_id, None)
        if work:
            self._feed(work)

    def _accepted(self, seq: Sequence) -> _Pending | None:
        """The sequence's pending rows of accepted tokens (those past its computed tokens,
        rejected drafts', dropped), or None."""
        pending = self.pending.get(seq.seq_id)
        if pending is None:
            return None
        keep = min(pending.end, seq.num_computed_tokens) - pending.start
        if keep <= 0:
            del self.pending[seq.seq_id]
            return None
        if keep < pending.rows.shape[0]:
            pending = self.pending[seq.seq_id] = _Pending(pending.start, pending.rows[:keep])
        return pending

    # ---- running the block ------------------------------------------------------------------

    def _feed(self, work: list[tuple[Sequence, _Pending]]) -> torch.Tensor:
        """Compute the block's rows for each (sequence, its hidden rows [start, end)) into the
        mirrored cache slots; return their outputs [R, hidden]."""
        ids, positions, slots, chunks, row = [], [], [], [], 0
        for seq, pending in work:
            start, end = pending.start, pending.end
            ids.extend(seq.token_ids[start + 1 : end + 1])
            positions.extend(range(start + self._delta(seq), end + self._delta(seq)))
            slots.append(self.runner._slots(seq, start, end))
            key_slots = self.runner._slots(seq, 0, end).to(self.runner.device)
            chunks.append(PrefillChunk(row, end - start, end, key_slots))
            row += end - start
        hidden = torch.cat([pending.rows for _, pending in work])
        return self._run(ids, positions, torch.cat(slots), chunks, hidden)

    def _draft_step(
        self, seqs: list[Sequence], lanes: list[int], tokens: list[int], hidden, step: int
    ) -> torch.Tensor:
        """Draft row `step` (1..k-1) of each sequence: position n - 2 + step, its KV in the
        sequence's scratch slots (`lanes`: its index among this propose's drafting ones)."""
        positions, slots, chunks = [], [], []
        for row, (seq, lane) in enumerate(zip(seqs, lanes)):
            computed = seq.num_tokens - 1  # mirrored rows 0 .. n - 2
            scratch = self.num_slots + lane * max(self.k - 1, 1) + torch.arange(step)
            positions.append(computed - 1 + step + self._delta(seq))
            slots.append(scratch[-1:])
            key_slots = torch.cat([self.runner._slots(seq, 0, computed), scratch])
            chunks.append(PrefillChunk(row, 1, computed + step, key_slots.to(self.runner.device)))
        return self._run(tokens, positions, torch.cat(slots), chunks, hidden)

    def _run(self, ids, positions, slot_mapping, chunks, hidden) -> torch.Tensor:
        device = self.runner.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            prefills=chunks,
            decode_token_index=None,
            decode_key_slots=None,
            decode_context_lens=None,
        )
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        embeds = self.runner.model.model.embed(ids_t)
        with set_forward_context(meta):
            return self.mtp(embeds, hidden, torch.tensor(positions, device=device))

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        logits = self.runner.model.compute_logits(hidden)[:, : self.vocab_size]
        return logits.argmax(dim=-1).tolist()

    @staticmethod
    def _delta(seq: Sequence) -> int:
        """Past an image prompt, a text position is its index plus the M-RoPE delta."""
        return seq.images.mrope_delta if seq.images is not None else 0
