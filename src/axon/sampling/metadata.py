"""Per-step sampling tensors, built once from the batch's sequences.

Rows fall into three groups that each take one path through the sampler: greedy rows (argmax),
plain random rows (temperature only: one pass over the vocabulary) and filtered random rows
(top_k / top_p / min_p: work on each row's top candidates). A group, or a stage such as the
penalties, is `None` when no row needs it, so the sampler skips it without touching a
vocab-sized tensor. Which group a row is in depends only on its own parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from axon.sampling.penalties import (
    PenaltyCounts,
    PenaltyTensors,
    has_penalty,
    penalty_tensors_ref,
)
from axon.sampling_params import SamplingParams
from axon.sequence import Sequence

__all__ = ["FilteredRows", "PenaltyTensors", "RandomRows", "SamplingMetadata", "noise_key"]

_MASK64 = (1 << 64) - 1
# Filtered rows first look at this many top logits; a row whose kept tokens might extend past
# them is redone with a full sort. Real next-token distributions rarely need the full sort.
_MIN_CANDIDATES = 256
_MAX_TOP_K_CANDIDATES = 2048  # a larger top_k relies on the other filters, or the full sort


def _mix64(z: int) -> int:
    """Return splitmix64's output for state `z`: a 64-bit integer that avalanches every bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def noise_key(seed: int, step: int) -> int:
    """Return the 32-bit key of the noise used at output position `step` of a `seed`ed stream.

    A pure function of its arguments: this is what makes a row's draw independent of the batch.
    """
    return _mix64(_mix64(seed & _MASK64) ^ step) >> 32


def sequence_noise_key(seq: Sequence, offset: int = 0) -> int:
    """Return the noise key of `seq`'s token `offset` places past its next one (a draft's
    verification samples row i as output position num_output_tokens + i).

    The sample index is added to the seed, as vLLM does for `n > 1` with a fixed seed, so the
    `n` samples of one seeded request differ from each other.
    """
    return noise_key(seq.seed + seq.index, seq.num_output_tokens + offset)


@dataclass
class RandomRows:
    """Random rows with no filter: temperature, softmax, draw."""

    rows: torch.Tensor  # [R] long, ascending batch rows
    noise_keys: torch.Tensor  # [R] int64, 32-bit keys
    temperatures: torch.Tensor | None  # [R, 1] float32; None when all are 1


@dataclass
class FilteredRows(RandomRows):
    """Random rows with top_k, top_p or min_p; a parameter is None when no row uses it."""

    top_k: torch.Tensor | None  # [F, 1] long; vocab_size where a row has none
    top_p: torch.Tensor | None  # [F, 1] float32; 1.0 where a row has none
    log_min_p: torch.Tensor | None  # [F, 1] float32 log(min_p); -inf where a row has none
    num_candidates: int  # top logits looked at first, <= vocab_size

    def select(self, index: torch.Tensor) -> FilteredRows:
        """Return these rows' parameters at `index` [U] (positions in this group)."""
        pick = lambda t: None if t is None else t[index]
        return replace(
            self,
            rows=self.rows[index],
            noise_keys=self.noise_keys[index],
            temperatures=pick(self.temperatures),
            top_k=pick(self.top_k),
            top_p=pick(self.top_p),
            log_min_p=pick(self.log_min_p),
        )


@dataclass
class BiasTensors:
    """Every (row, token) pair a logit_bias names, flat, with the value added to its logit."""

    rows: torch.Tensor  # [T] long batch rows
    token_ids: torch.Tensor  # [T] long
    values: torch.Tensor  # [T] float32


@dataclass
class SamplingMetadata:
    """Everything the sampler needs about one step's batch, one logits row per sequence."""

    num_rows: int
    vocab_size: int
    greedy_rows: torch.Tensor | None  # [G] long; None when no row is greedy
    plain: RandomRows | None
    filtered: FilteredRows | None
    penalties: PenaltyTensors | None
    bias: BiasTensors | None  # logit_bias, added before the penalties (vLLM's order)
    banned_rows: torch.Tensor | None  # [X] long; with banned_ids: min_tokens sets them -inf
    banned_ids: torch.Tensor | None  # [X] long
    logprob_rows: torch.Tensor | None  # [L] long rows that asked for logprobs
    num_logprobs: list[int | None]  # [B] each row's SamplingParams.logprobs
    # Rows whose token is decided already (a spent thinking budget), and that token.
    forced_rows: torch.Tensor | None = None  # [K] long
    forced_ids: torch.Tensor | None = None  # [K] long

    @property
    def greedy_only(self) -> bool:
        """Return whether every row is a plain argmax: no random rows, logit edits or logprobs."""
        return (
            self.plain is None
            and self.filtered is None
            and self.logprob_rows is None
            and self.forced_rows is None
            and not self.edits_logits
        )

    @property
    def edits_logits(self) -> bool:
        """Return whether a stage before the greedy/random split rewrites logits."""
        return self.penalties is not None or self.bias is not None or self.banned_rows is not None

    @classmethod
    def from_sequences(
        cls,
        seqs: list[Sequence],
        vocab_size: int,
        device: torch.device,
        penalty_counts: PenaltyCounts | None = None,
        offsets: list[int] | None = None,
    ) -> SamplingMetadata:
        """Return the metadata of a batch whose logits row i belongs to `seqs[i]`.

        `offsets` (speculative decoding): row i samples `seqs[i]`'s output position
        `num_output_tokens + offsets[i]` after its drafts `spec_token_ids[:offsets[i]]` (its
        noise, min_tokens, penalty counts and thinking budget are those of that position);
        None: every offset is 0.

        `penalty_counts`: the engine's persistent penalty state, brought up to date with the
        tokens sampled since its last step; without it the penalties are rebuilt from the
        sequences' full token lists (the same pairs, at a cost that grows with their length).
        """
        offsets = offsets or [0] * len(seqs)
        if all(map(_plain_greedy, seqs, offsets)):  # decode's common case: one argmax a row
            if penalty_counts is not None:
                penalty_counts.release_departed()
            return cls.all_greedy(len(seqs), vocab_size, device)
        params = [seq.sampling_params for seq in seqs]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        plain = [i for i, p in enumerate(params) if not p.greedy and not _has_filter(p)]
        filtered = [i for i, p in enumerate(params) if not p.greedy and _has_filter(p)]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        banned_rows, banned_ids = _banned_tokens(seqs, vocab_size, offsets)
        forced = [(i, t) for i, t in enumerate(map(forced_token, seqs, offsets)) if t is not None]
        return cls(
            num_rows=len(seqs),
            vocab_size=vocab_size,
            greedy_rows=_long(greedy, device) if greedy else None,
            plain=_random_rows(seqs, plain, device, offsets) if plain else None,
            filtered=_filtered_rows(seqs, filtered, vocab_size, device, offsets)
            if filtered
            else None,
            penalties=penalty_counts.tensors(seqs, offsets)
            if penalty_counts is not None
            else penalty_tensors_ref(seqs, vocab_size, device, offsets),
            bias=_logit_bias(seqs, vocab_size, device),
            banned_rows=_long(banned_rows, device) if banned_rows else None,
            banned_ids=_long(banned_ids, device) if banned_ids else None,
            logprob_rows=_long(logprob_rows, device) if logprob_rows else None,
            num_logprobs=[p.logprobs for p in params],
            forced_rows=_long([i for i, _ in forced], device) if forced else None,
            forced_ids=_long([t for _, t in forced], device) if forced else None,
        )

    @classmethod
    def all_greedy(cls, num_rows: int, vocab_size: int, device: torch.device) -> SamplingMetadata:
        """Return the metadata of `num_rows` greedy rows that nothing else applies to."""
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            greedy_rows=row_range(num_rows, device),
            plain=None,
            filtered=None,
            penalties=None,
            bias=None,
            banned_rows=None,
            banned_ids=None,
            logprob_rows=None,
            num_logprobs=[None] * num_rows,
        )


# arange(num_rows) per (num_rows, device): read-only, so every step of that size shares one.
_ROW_RANGES: dict[tuple[int, torch.device], torch.Tensor] = {}


def row_range(num_rows: int, device: torch.device) -> torch.Tensor:
    """Return arange(num_rows) [num_rows] long on `device` (cached: do not write to it)."""
    key = (num_rows, device)
    rows = _ROW_RANGES.get(key)
    if rows is None:
        rows = _ROW_RANGES[key] = torch.arange(num_rows, device=device)
    return rows


def _plain_greedy(seq: Sequence, offset: int = 0) -> bool:
    """Whether `seq`'s token `offset` past its next is a plain argmax: greedy, with no
    penalty, logit_bias, logprobs or min_tokens still to hold."""
    params = seq.sampling_params
    return (
        params.greedy
        and params.logprobs is None
        and not params.logit_bias
        and not has_penalty(params)
        and seq.num_output_tokens + offset >= params.min_tokens
        and forced_token(seq, offset) is None
    )


def forced_token(seq: Sequence, offset: int = 0) -> int | None:
    """The token `seq` must emit `offset` places past its next one, after its drafts before
    it, whatever its logits (a spent thinking budget)."""
    budget = seq.thinking_budget
    if budget is not None and offset:
        budget = budget.after(seq.spec_token_ids[:offset])
    return None if budget is None else budget.forced_token()


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    """Return `values` as a long tensor on `device`."""
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: list[float], device: torch.device) -> torch.Tensor:
    """Return `values` as a float32 tensor on `device`."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def _has_filter(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _random_rows(
    seqs: list[Sequence], rows: list[int], device: torch.device, offsets: list[int]
) -> RandomRows:
    """Return the rows, noise keys and temperatures of random `rows`."""
    temperatures = [seqs[i].sampling_params.temperature for i in rows]
    return RandomRows(
        rows=_long(rows, device),
        noise_keys=_long([sequence_noise_key(seqs[i], offsets[i]) for i in rows], device),
        temperatures=None
        if all(t == 1.0 for t in temperatures)
        else _float(temperatures, device).unsqueeze(1),
    )


def _filtered_rows(
    seqs: list[Sequence],
    rows: list[int],
    vocab_size: int,
    device: torch.device,
    offsets: list[int],
) -> FilteredRows:
    """Return random `rows`' filter parameters, each None when none of them uses it."""
    params = [seqs[i].sampling_params for i in rows]
    top_k = [min(p.top_k, vocab_size) or vocab_size for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    small_k = [k for k in top_k if k <= _MAX_TOP_K_CANDIDATES]
    column = lambda values: _float(values, device).unsqueeze(1)  # [F, 1]
    return FilteredRows(
        **vars(_random_rows(seqs, rows, device, offsets)),
        top_k=_long(top_k, device).unsqueeze(1) if any(p.top_k for p in params) else None,
        top_p=column(top_p) if any(p < 1.0 for p in top_p) else None,
        log_min_p=column([math.log(p) if p > 0 else -math.inf for p in min_p])
        if any(min_p)
        else None,
        # One more than the largest top_k shows that the k-th candidate's successor is cut.
        num_candidates=min(vocab_size, max([_MIN_CANDIDATES] + [k + 1 for k in small_k])),
    )


def _logit_bias(seqs: list[Sequence], vocab_size: int, device: torch.device) -> BiasTensors | None:
    """Return the pairs the rows' logit_bias names (ids past the logits left out), or None."""
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for row, seq in enumerate(seqs):
        for token_id, value in (seq.sampling_params.logit_bias or {}).items():
            if token_id < vocab_size:
                rows.append(row)
                ids.append(token_id)
                values.append(value)
    if not rows:
        return None
    return BiasTensors(_long(rows, device), _long(ids, device), _float(values, device))


def _banned_tokens(
    seqs: list[Sequence], vocab_size: int, offsets: list[int]
) -> tuple[list[int], list[int]]:
    """Return (rows, token ids) that min_tokens forbids this step: EOS and stop token ids."""
    rows: list[int] = []
    ids: list[int] = []
    for row, (seq, offset) in enumerate(zip(seqs, offsets)):
        params = seq.sampling_params
        if seq.num_output_tokens + offset >= params.min_tokens:
            continue
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= seq.eos_token_ids
        banned_ids = sorted(t for t in banned if t < vocab_size)
        rows += [row] * len(banned_ids)
        ids += banned_ids
    return rows, ids
