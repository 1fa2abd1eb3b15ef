"""Token-budget continuous batching over the paged KV cache. Pure Python: no torch here.

Each step every sequence is given a number of new tokens to compute: 1 for a decode, a chunk for
a prompt, under `max_num_batched_tokens` and `max_num_seqs`. Running sequences go first: decodes
(least recently served first, so under a budget smaller than the running set every sequence
decodes within ceil(running / budget) steps), then unfinished prompt chunks (oldest first). When
the cache runs out of blocks the newest running sequence is preempted and later recomputed.
Waiting sequences are admitted in FIFO order, prefix-cache hits first matched.

Hybrid models (Gated DeltaNet layers) also hold one recurrent-state slot per running sequence:
none is admitted without a free slot. With prefix caching, the state is snapshotted wherever a
sequence's computed tokens cross a boundary (every `snapshot_interval` tokens): the scheduler
takes a snapshot index per boundary a step's tokens reach, the runner captures the state there
during the forward (inside a prompt chunk as well as at its end, so chunks are never cut short),
and `update` keys the snapshot by the hash of the block ending there. A prefix hit resumes only
from a snapshot, which the runner restores into the new slot.
"""

from __future__ import annotations

from collections import deque

from axon.batch import SchedulerOutput
from axon.cache.block_manager import BlockManager
from axon.cache.state_slots import StateSlotManager
from axon.sequence import FinishReason, Sequence, SequenceStatus


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        state_slots: StateSlotManager | None = None,
        snapshot_interval: int = 0,
    ) -> None:
        if snapshot_interval % block_manager.block_size:
            raise ValueError(
                f"snapshot_interval {snapshot_interval} must be a multiple of the block size"
            )
        self.block_manager = block_manager
        self.state_slots = state_slots
        # Tokens between state snapshots; 0 takes none (no hybrid model or no prefix caching).
        self.snapshot_interval = snapshot_interval if state_slots is not None else 0
        if self.snapshot_interval:
            block_manager.can_resume_at = state_slots.has_snapshot
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_served = 0  # (sequence, tokens) pairs scheduled so far: a clock for fairness
        # Hybrid models that speculate: scratch state indices hold the state after each draft;
        # seq_id -> (seq, slot, index) of the one the next step restores (drafts rejected).
        self.draft_state_base = self.num_draft_state_rows = self._draft_rows_taken = 0
        self._draft_restores: dict[int, tuple[Sequence, int, int]] = {}

    # ---- requests ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue `seq`. Raises ValueError when its prompt can never fit."""
        # An embedding (pooling) sequence generates nothing: its prompt may fill the context.
        if seq.num_tokens >= self.max_model_len + (seq.pooling is not None):
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens; max_model_len is {self.max_model_len} "
                "and at least one token must be generated"
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def abort(self, request_ids: set[str]) -> list[Sequence]:
        """Finish every sequence of these requests at once and free their blocks. One pass
        over each queue however many requests and sequences go: a client that leaves with
        thousands of sequences must not cost a pass (or a deque removal) per sequence."""
        waiting = [s for s in self.waiting if s.request_id in request_ids]
        running = [s for s in self.running if s.request_id in request_ids]
        if waiting:
            self.waiting = deque(s for s in self.waiting if s.request_id not in request_ids)
        if running:
            self.running = [s for s in self.running if s.request_id not in request_ids]
        for seq in (*waiting, *running):
            self._release(seq, FinishReason.ABORT)
        return [*waiting, *running]

    # ---- scheduling -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's (sequence, num_new_tokens) pairs; may preempt running sequences."""
        out = SchedulerOutput()
        if self.state_slots is not None:
            # Snapshot indices left unstored by a step that failed before its update: reuse them.
            self.state_slots.release_unstored()
        self._draft_rows_taken = 0
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self._restore_draft_states(out)
        return out

    def use_draft_states(self, base: int, rows: int) -> None:
        """Hybrid models that speculate: scratch state indices [base, base + rows)."""
        self.draft_state_base, self.num_draft_state_rows = base, rows

    def _restore_draft_states(self, out: SchedulerOutput) -> None:
        """Roll back the recurrent state of sequences whose drafts were partly rejected: copy
        the state after their last accepted token into their slot before this step (only while
        they still run in that slot: a preempted or finished sequence's restore is dropped)."""
        for seq, slot, index in self._draft_restores.values():
            if seq.status == SequenceStatus.RUNNING and seq.state_slot == slot:
                out.state_restores.append((slot, index))
        self._draft_restores.clear()

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decodes go before unfinished prompt chunks so a long prompt never starves them, those
        # served longest ago first: a budget smaller than the running set serves them in turn.
        decodes = sorted(
            (s for s in self.running if s.num_tokens - s.num_computed_tokens == 1),
            key=lambda s: s.last_served,
        )
        chunks = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + chunks:
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk_size(seq, budget)
            if seq.spec_token_ids:
                num_new = self._fit_drafts(seq, budget)
            if not self._make_room(seq, num_new, out):
                continue
            self._add_scheduled(seq, num_new, out)
            budget -= num_new
        return budget

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes this step: the rest of it under `budget`."""
        return min(seq.num_tokens - seq.num_computed_tokens, budget)

    def _fit_drafts(self, seq: Sequence, budget: int) -> int:
        """Tokens a drafted decode computes: its last token and the drafts that fit the budget
        and the free blocks (drafts never preempt anything: they are dropped first)."""
        del seq.spec_token_ids[max(0, budget - 1) :]
        if self.state_slots is not None:  # one scratch state row per draft
            del seq.spec_token_ids[self.num_draft_state_rows - self._draft_rows_taken :]
        if not self.block_manager.can_allocate(seq, 1 + len(seq.spec_token_ids)):
            seq.spec_token_ids = []
        return 1 + len(seq.spec_token_ids)

    def _add_scheduled(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        """Schedule `num_new` tokens of `seq` (room checked, state slot taken)."""
        self.block_manager.allocate(seq, num_new)
        if seq.spec_token_ids and self.state_slots is not None:
            self._plan_draft_states(seq, out)  # no prefix snapshot inside drafts
        elif self.snapshot_interval:
            self._plan_snapshots(seq, num_new, out)
        self.num_served += 1
        seq.last_served = self.num_served
        out.scheduled.append((seq, num_new))

    def _plan_snapshots(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        """Take a snapshot index for each boundary `seq`'s tokens reach this step, the latest
        first: when the pool is short, the longest prefixes are the ones worth keeping. Only
        with a snapshot interval (hybrid models under prefix caching)."""
        interval = self.snapshot_interval
        start = seq.num_computed_tokens
        saves = []
        for computed in range((start + num_new) // interval * interval, start, -interval):
            index = self.state_slots.take_snapshot()
            if index is None:
                break
            saves.append((seq.state_slot, computed, index))
        out.state_saves.extend(reversed(saves))

    def _plan_draft_states(self, seq: Sequence, out: SchedulerOutput) -> None:
        """A scratch state index for the state after each of `seq`'s drafts."""
        start = seq.num_computed_tokens
        for computed in range(start + 1, start + 1 + len(seq.spec_token_ids)):
            index = self.draft_state_base + self._draft_rows_taken
            self._draft_rows_taken += 1
            out.draft_state_saves.append((seq.state_slot, computed, index))

    def _has_free_slot(self) -> bool:
        return self.state_slots is None or self.state_slots.num_free_slots > 0

    def _take_slot(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Give an admitted sequence its state slot, restored from a snapshot on a prefix hit."""
        if self.state_slots is None:
            return
        seq.state_slot = self.state_slots.allocate()
        if seq.num_computed_tokens:
            index = self.state_slots.lookup(seq.block_hashes[-1])
            if index is None:
                raise RuntimeError("prefix hit without a state snapshot")  # match_prefix bug
            out.state_restores.append((seq.state_slot, index))

    def _release_slot(self, seq: Sequence) -> None:
        if self.state_slots is not None and seq.state_slot is not None:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = None

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences not yet scheduled this step until `seq` fits;
        False if `seq` itself had to go."""
        if self.block_manager.can_allocate(seq, num_new):
            return True  # the common case: no set of the step's sequences to build
        scheduled = {s.seq_id for s, _ in out.scheduled}
        while not self.block_manager.can_allocate(seq, num_new):
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Sequence] = []
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and self._has_free_slot()
        ):
            seq = self.waiting[0]
            if self._waits_for_parent(seq):
                skipped.append(self.waiting.popleft())
                continue
            # Mean pooling needs every prompt row's hidden state, prompt logprobs every prompt
            # row's logits: no prefix-cache hits for them.
            every_row = seq.pooling == "mean" or seq.wants_prompt_logprobs
            looked_up = not seq.block_table and not every_row
            if looked_up:
                self._match_prefix(seq)
            num_new = self._chunk_size(seq, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                # Hold no blocks while waiting: a waiting sequence pinning prefix hits (or a
                # forked prompt) could starve the sequences that must run to release memory.
                if looked_up and not seq.num_preemptions:
                    self.block_manager.undo_match(seq)
                self.block_manager.free(seq)
                break
            self.waiting.popleft()
            self._take_slot(seq, out)
            self._add_scheduled(seq, num_new, out)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _match_prefix(self, seq: Sequence) -> None:
        """Point `seq` at its cached prefix. A preempted sequence mostly finds the blocks it
        computed itself: its `num_cached_tokens` and the hit statistics keep the lookup of its
        first admission, the real prefix-cache hit."""
        if not seq.num_preemptions:
            self.block_manager.match_prefix(seq)
            return
        num_cached = seq.num_cached_tokens
        self.block_manager.match_prefix(seq)
        self.block_manager.undo_match(seq)
        seq.num_cached_tokens = num_cached

    def _waits_for_parent(self, seq: Sequence) -> bool:
        """A sibling of an `n > 1` request waits until the first sample has its prompt cached."""
        parent = seq.fork_parent
        if parent is None:
            return False
        if parent.status == SequenceStatus.FINISHED:
            seq.fork_parent = None  # the parent left before sharing: prefill on our own
            return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        seq.spec_token_ids = []
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._release_slot(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- after the step ---------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[int]]) -> list[Sequence]:
        """Advance the scheduled sequences; `sampled` maps seq_id -> new token for those that
        reached their last token (a drafted decode: its accepted tokens, the target's own one
        last). Returns the sequences that finished this step."""
        finished = []
        for seq, num_new in out.scheduled:
            token_id = sampled.get(seq.seq_id)
            if isinstance(token_id, list):
                if self._update_drafted(seq, token_id, out):
                    finished.append(seq)
                continue
            seq.num_computed_tokens += num_new
            seq.max_num_computed_tokens = max(seq.max_num_computed_tokens, seq.num_computed_tokens)
            self.block_manager.cache_full_blocks(seq)
            self._store_snapshots(seq, out)
            if seq.pooling is not None:
                if seq.num_computed_tokens >= seq.num_prompt_tokens:
                    self._finish(seq, FinishReason.STOP)  # pooled: no KV kept after the prompt
                    finished.append(seq)
                continue
            if token_id is None:
                continue  # a prompt chunk that did not reach the end of the prompt
            if seq.num_output_tokens == 0:
                self._fork_children(seq)
            seq.append_token(token_id)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _update_drafted(self, seq: Sequence, tokens: list[int], out: SchedulerOutput) -> bool:
        """Advance a drafted decode by its accepted tokens (up to the first that ends it) and
        roll the rest back: the KV of rejected drafts is past `num_computed_tokens` (its blocks
        freed, never hashed). Returns whether `seq` finished."""
        reason = None
        for token_id in tokens:
            seq.append_token(token_id)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                break
        seq.spec_token_ids = []
        seq.num_computed_tokens = seq.num_tokens - 1  # every token but the newest one
        seq.max_num_computed_tokens = max(seq.max_num_computed_tokens, seq.num_computed_tokens)
        self.block_manager.trim(seq)
        self.block_manager.cache_full_blocks(seq)
        for slot, computed, index in out.draft_state_saves:
            if slot == seq.state_slot and computed == seq.num_computed_tokens:
                self._draft_restores[seq.seq_id] = (seq, slot, index)
        if reason is not None:
            self._finish(seq, reason)
        return reason is not None

    def _store_snapshots(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Key the snapshots the runner took of `seq` this step by the hash of the block that
        ends at each (computed by `cache_full_blocks`), so prefix hits can find them. One past
        the computed tokens (inside rejected drafts) stays unstored: the next step frees it."""
        for slot, computed, index in out.state_saves:
            if slot == seq.state_slot and computed <= seq.num_computed_tokens:
                block_hash = seq.block_hashes[computed // self.block_manager.block_size - 1]
                self.state_slots.store_snapshot(block_hash, index)

    def _fork_children(self, parent: Sequence) -> None:
        for child in self.waiting:
            if child.fork_parent is parent:
                # A hybrid child cannot share blocks without the state at their end: it finds
                # the parent's cached blocks and snapshots through match_prefix instead.
                if self.state_slots is None:
                    self.block_manager.fork(parent, child, parent.num_prompt_tokens - 1)
                child.fork_parent = None

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return FinishReason.STOP
            if not params.ignore_eos and token_id in seq.eos_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish `seq`, already out of both queues: its blocks and state slot go back."""
        self.block_manager.free(seq)
        self._release_slot(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.fork_parent = None

    def finish_stopped(self, seq: Sequence) -> None:
        """Finish `seq` early because the frontend matched a stop string."""
        if seq.status != SequenceStatus.FINISHED:
            self._finish(seq, FinishReason.STOP)
