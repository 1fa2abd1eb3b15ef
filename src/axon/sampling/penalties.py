"""Repetition, frequency and presence penalties: which (row, token) pairs they change, and how.

Frequency and presence (OpenAI) look at a sequence's output tokens: logit -= frequency * count
+ presence * (count > 0). Repetition (HF, as vLLM defines it) looks at prompt and output tokens:
a token seen in either is divided by the penalty when its logit is positive, multiplied
otherwise. Only the distinct tokens a row has seen are touched, never the whole vocabulary.

`PenaltyCounts` keeps each penalised sequence's distinct tokens and output counts on the device
between steps and adds only the tokens sampled since, so a step's cost does not grow with the
prompt or output length; `penalty_tensors_ref` rebuilds the same pairs from the full token
lists, its reference twin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from axon.sampling_params import SamplingParams
from axon.sequence import Sequence, SequenceStatus


@dataclass
class PenaltyTensors:
    """Every (row, token) pair a penalty changes, flat, with what happens to its logit."""

    rows: torch.Tensor  # [T] long batch rows
    token_ids: torch.Tensor  # [T] long
    repetition: torch.Tensor | None  # [T] float32 the pair's row's penalty; None when all 1
    subtract: torch.Tensor | None  # [T] float32 frequency*count + presence*(count>0); or None


def has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _pair_tensors(
    params: list[SamplingParams],
    pair_rows: torch.Tensor,
    pair_ids: torch.Tensor,
    counts: torch.Tensor,
    row_of: torch.Tensor,
) -> PenaltyTensors:
    """Return the penalties of pairs ([T] rows, ids, output counts) of the rows whose
    parameters are `params`; `row_of` [T] is each pair's index into `params`."""
    by_row = lambda name: _float([getattr(p, name) for p in params], counts.device)  # [P]
    per_pair = lambda name: by_row(name).index_select(0, row_of)  # [T]
    subtract = None
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        subtract = per_pair("frequency_penalty") * counts
        subtract += per_pair("presence_penalty") * (counts > 0)
    repetition = None
    if any(p.repetition_penalty != 1.0 for p in params):
        repetition = per_pair("repetition_penalty")
    return PenaltyTensors(pair_rows, pair_ids, repetition, subtract)


class _RowCounts:
    """One penalised sequence's distinct tokens, in the order they were first seen."""

    def __init__(self, seq: Sequence, slot: int, vocab_size: int) -> None:
        self.seq = seq
        self.slot = slot  # its row in PenaltyCounts' pool
        self.num_preemptions = seq.num_preemptions
        self.with_prompt = seq.sampling_params.repetition_penalty != 1.0
        self.position: dict[int, int] = {}  # token id -> its column in the pool
        self.num_tokens = 0  # how many of seq.token_ids are counted
        self.counts: list[int] = []  # output count per column (only while building)
        start = 0 if self.with_prompt else seq.num_prompt_tokens
        for index in range(start, seq.num_tokens):
            token_id = seq.token_ids[index]
            if token_id < vocab_size:
                column = self.position.setdefault(token_id, len(self.position))
                if column == len(self.counts):
                    self.counts.append(0)
                self.counts[column] += index >= seq.num_prompt_tokens
        self.num_tokens = seq.num_tokens

    @property
    def length(self) -> int:
        return len(self.position)

    def stale(self) -> bool:
        """Whether the sequence's tokens may no longer extend what was counted."""
        seq = self.seq
        return seq.num_preemptions != self.num_preemptions or seq.num_tokens < self.num_tokens


@dataclass
class _Pending:
    """A step's count updates, applied to the pool together."""

    new: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, column, token id)
    counted: list[tuple[int, int]] = field(default_factory=list)  # (slot, column): count += 1


class PenaltyCounts:
    """Persistent per-sequence penalty state on the device, updated with each step's tokens.

    Pool rows (slots) belong to penalised sequences while they run: `ids[slot, :length]` are
    the distinct tokens the penalties touch, `counts[slot, :length]` their output counts. A
    sequence joining the batch, or resuming after a preemption, is counted from scratch; one
    that finishes or is preempted gives its slot back. Sequences without penalties never get a
    slot, so they cost nothing here.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.rows: dict[int, _RowCounts] = {}  # seq_id -> its state
        self.free_slots: list[int] = []
        self.ids = torch.zeros(0, 16, dtype=torch.long, device=device)  # [S, C]
        self.counts = torch.zeros(0, 16, dtype=torch.float32, device=device)  # [S, C]

    def tensors(
        self, seqs: list[Sequence], offsets: list[int] | None = None
    ) -> PenaltyTensors | None:
        """Return the pairs the penalties change for a batch whose row i is `seqs[i]`, or None
        when no row has a penalty; first brings every penalised row's counts up to date.
        `offsets` (drafts): row i also counts `seqs[i].spec_token_ids[:offsets[i]]` as output."""
        self.release_departed()
        batch_rows = [i for i, seq in enumerate(seqs) if has_penalty(seq.sampling_params)]
        if not batch_rows:
            return None
        pending = _Pending()
        states = [self._sync(seqs[i], pending) for i in batch_rows]
        self._apply(pending)
        width = max(state.length for state in states)
        slots = _long([state.slot for state in states], self.device)  # [P]
        lengths = _long([state.length for state in states], self.device)  # [P]
        columns = torch.arange(width, device=self.device)  # [W]
        valid = columns < lengths.unsqueeze(1)  # [P, W]
        # Flat positions in the pool, read as 1-D: see sampler.flat_index for why.
        pool_index = (slots.unsqueeze(1) * self.ids.shape[1] + columns).masked_select(valid)
        states_index = torch.arange(len(states), device=self.device).unsqueeze(1)  # [P, 1]
        row_of = states_index.masked_select(valid)  # [T] index into states (broadcast)
        pair_rows = _long(batch_rows, self.device).index_select(0, row_of)  # [T]
        params = [state.seq.sampling_params for state in states]
        counts = self.counts.view(-1).index_select(0, pool_index)  # [T]
        pair_ids = self.ids.view(-1).index_select(0, pool_index)  # [T]
        drafts = [seqs[i].spec_token_ids[: offsets[i]] if offsets else [] for i in batch_rows]
        if any(drafts):
            pairs = _DraftPairs(self.vocab_size, self.device)
            pairs.add(states, batch_rows, drafts)
            pair_rows, pair_ids, counts, row_of = pairs.extend(pair_rows, pair_ids, counts, row_of)
        return _pair_tensors(params, pair_rows, pair_ids, counts, row_of)

    def release_departed(self) -> None:
        """Give back the slots of sequences that finished or were preempted (recounted when
        they resume: their tokens are the same, but a fresh count needs no bookkeeping)."""
        for seq_id, state in list(self.rows.items()):
            if state.seq.status != SequenceStatus.RUNNING or state.stale():
                del self.rows[seq_id]
                self.free_slots.append(state.slot)

    def _sync(self, seq: Sequence, pending: _Pending) -> _RowCounts:
        """Return `seq`'s state with every token of it counted (or queued in `pending`)."""
        state = self.rows.get(seq.seq_id)
        if state is None:
            state = _RowCounts(seq, self._take_slot(), self.vocab_size)
            self._write_row(state)
            self.rows[seq.seq_id] = state
        elif state.num_tokens < seq.num_tokens:
            self._add_tokens(state, seq.token_ids[state.num_tokens :], pending)
        return state

    def _write_row(self, state: _RowCounts) -> None:
        """Copy a freshly counted row into the pool."""
        self._reserve(state.length)
        self.ids[state.slot, : state.length] = _long(list(state.position), self.device)
        self.counts[state.slot, : state.length] = _float(state.counts, self.device)
        state.counts = []

    def _add_tokens(self, state: _RowCounts, token_ids: list[int], pending: _Pending) -> None:
        """Queue the counts of output tokens sampled since the last step (one, normally)."""
        for token_id in token_ids:
            state.num_tokens += 1
            if token_id >= self.vocab_size:
                continue
            column = state.position.get(token_id)
            if column is None:  # a token the row has not seen: a new column from count 0
                column = state.position[token_id] = len(state.position)
                pending.new.append((state.slot, column, token_id))
            pending.counted.append((state.slot, column))

    def _apply(self, pending: _Pending) -> None:
        """Write the queued columns and counts into the pool: a few ops for the whole batch."""
        if pending.new:
            self._reserve(1 + max(column for _, column, _ in pending.new))
            slots, columns, token_ids = zip(*pending.new)
            index = self._pool_index(slots, columns)
            self.ids.view(-1).index_copy_(0, index, _long(token_ids, self.device))
            self.counts.view(-1).index_fill_(0, index, 0.0)
        if pending.counted:
            slots, columns = zip(*pending.counted)
            ones = torch.ones(len(slots), device=self.device)
            self.counts.view(-1).index_add_(0, self._pool_index(slots, columns), ones)

    def _pool_index(self, slots: tuple[int, ...], columns: tuple[int, ...]) -> torch.Tensor:
        """Return the flat pool positions [N] of (slot, column) pairs."""
        width = self.ids.shape[1]
        return _long([slot * width + column for slot, column in zip(slots, columns)], self.device)

    def _take_slot(self) -> int:
        if not self.free_slots:
            old = self.ids.shape[0]
            self._resize(max(4, 2 * old), self.ids.shape[1])
            self.free_slots.extend(range(old, self.ids.shape[0]))
        return self.free_slots.pop()

    def _reserve(self, width: int) -> None:
        """Make the pool at least `width` columns wide (doubling, so growth is rare)."""
        if width > self.ids.shape[1]:
            self._resize(self.ids.shape[0], max(width, 2 * self.ids.shape[1]))

    def _resize(self, num_slots: int, width: int) -> None:
        ids = torch.zeros(num_slots, width, dtype=torch.long, device=self.device)
        counts = torch.zeros(num_slots, width, dtype=torch.float32, device=self.device)
        old_slots, old_width = self.ids.shape
        ids[:old_slots, :old_width] = self.ids
        counts[:old_slots, :old_width] = self.counts
        self.ids, self.counts = ids, counts


class _DraftPairs:
    """What a drafted row's own drafts before it add to its pairs: +1 output count per draft
    token, on the row's pair for that token or on a new pair (a token it had not seen)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counted: dict[int, int] = {}  # index into the pairs -> count to add
        # new pairs: (batch row, token id) -> [index into the states, count]
        self.new: dict[tuple[int, int], list[int]] = {}

    def add(self, states: list[_RowCounts], rows: list[int], drafts: list[list[int]]) -> None:
        """Count `drafts[j]` for batch row `rows[j]`, whose state is `states[j]`."""
        start = 0  # a state's first pair: the pairs are its columns, state by state
        for index, (state, row, draft) in enumerate(zip(states, rows, drafts)):
            for token_id in draft:
                if token_id >= self.vocab_size:
                    continue
                column = state.position.get(token_id)
                if column is not None:
                    pair = start + column
                    self.counted[pair] = self.counted.get(pair, 0) + 1
                else:
                    self.new.setdefault((row, token_id), [index, 0])[1] += 1
            start += state.length

    def extend(self, pair_rows, pair_ids, counts, row_of):
        """The pairs ([T] rows, ids, counts, index into the states) with the drafts counted."""
        if self.counted:
            index = _long(list(self.counted), self.device)
            counts = counts.index_add(0, index, _float(list(self.counted.values()), self.device))
        if not self.new:
            return pair_rows, pair_ids, counts, row_of
        new_rows, new_ids = zip(*self.new)
        new_states, new_counts = zip(*self.new.values())
        return (
            torch.cat([pair_rows, _long(list(new_rows), self.device)]),
            torch.cat([pair_ids, _long(list(new_ids), self.device)]),
            torch.cat([counts, _float(list(new_counts), self.device)]),
            torch.cat([row_of, _long(list(new_states), self.device)]),
        )


def _flat_pairs(
    rows: list[int], token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (row, token id) of every in-vocab token of `token_lists`: ([T] long, [T] long)."""
    lengths = _long([len(ids) for ids in token_lists], device)  # [N]
    pair_rows = torch.repeat_interleave(_long(rows, device), lengths)  # [T]
    pair_ids = _long([t for token_ids in token_lists for t in token_ids], device)  # [T]
    # Ids past the logits' width (a tokenizer's added tokens) have no logit to penalise.
    in_vocab = pair_ids < vocab_size  # [T]
    return pair_rows[in_vocab], pair_ids[in_vocab]


def penalty_tensors_ref(
    seqs: list[Sequence],
    vocab_size: int,
    device: torch.device,
    offsets: list[int] | None = None,
) -> PenaltyTensors | None:
    """Return the penalties' pairs rebuilt from the full token lists (PenaltyCounts' twin);
    `offsets` (drafts): row i's output also has `seqs[i].spec_token_ids[:offsets[i]]`.

    A token listed twice makes two equal pairs, which compute the same value; a prompt-only
    pair has count 0, so subtracting its term changes nothing.
    """
    rows = [i for i, s in enumerate(seqs) if has_penalty(s.sampling_params)]
    if not rows:
        return None
    params = [seqs[i].sampling_params for i in rows]
    drafts = [seqs[i].spec_token_ids[: offsets[i]] if offsets else [] for i in rows]
    output = [[*seqs[i].output_token_ids, *draft] for i, draft in zip(rows, drafts)]
    tokens = [
        [*seqs[i].prompt_token_ids, *out] if p.repetition_penalty != 1.0 else out
        for i, p, out in zip(rows, params, output)
    ]
    pair_rows, pair_ids = _flat_pairs(rows, tokens, vocab_size, device)  # [T], [T]
    out_rows, out_ids = _flat_pairs(rows, output, vocab_size, device)  # [T_out]
    sorted_keys = (out_rows * vocab_size + out_ids).sort().values  # [T_out]
    keys = pair_rows * vocab_size + pair_ids  # [T]
    counts = (
        torch.searchsorted(sorted_keys, keys, right=True) - torch.searchsorted(sorted_keys, keys)
    ).float()  # [T]
    index_of = [0] * len(seqs)
    for index, row in enumerate(rows):
        index_of[row] = index
    row_of = _long(index_of, device).index_select(0, pair_rows)  # [T]
    return _pair_tensors(params, pair_rows, pair_ids, counts, row_of)
