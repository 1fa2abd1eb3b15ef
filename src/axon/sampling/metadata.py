"""Per-step sampling tensors, built once from the batch's sequences.

Every stage the sampler may run has its tensors here, or `None` when no row in the batch needs
that stage, so the sampler skips it without looking at a single vocab-sized tensor. Row subsets
are index tensors; `rows=None` means "every row" and saves a gather and a scatter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from axon.sampling_params import SamplingParams
from axon.sequence import Sequence

_MASK64 = (1 << 64) - 1


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


def sequence_noise_key(seq: Sequence) -> int:
    """Return the noise key of `seq`'s next token.

    The sample index is added to the seed, as vLLM does for `n > 1` with a fixed seed, so the
    `n` samples of one seeded request differ from each other.
    """
    return noise_key(seq.seed + seq.index, seq.num_output_tokens)


@dataclass
class RowValues:
    """A per-row parameter for the rows that use it."""

    rows: torch.Tensor | None  # [N] long; None = every row of the tensor it applies to
    values: torch.Tensor  # [N, 1]


@dataclass
class TopPTensors:
    """Rows that need a sort: top_p (and their top_k, applied first)."""

    rows: torch.Tensor | None  # [P] long into the random sub-batch; None = all of it
    top_p: torch.Tensor  # [P, 1] float32
    top_k: torch.Tensor  # [P, 1] long; vocab_size where top_k is off


@dataclass
class PenaltyTensors:
    """Flat (row, token) pairs to count, and the penalties of the rows that have any."""

    rows: torch.Tensor | None  # [N] long into the batch; None = every row
    output_rows: torch.Tensor  # [T_out] long into the N penalised rows
    output_ids: torch.Tensor  # [T_out] long, every output token of those rows
    prompt_rows: torch.Tensor | None  # [T_prompt] long; None without repetition penalties
    prompt_ids: torch.Tensor | None  # [T_prompt] long
    repetition: torch.Tensor | None  # [N, 1] float32; None when all are 1
    frequency: torch.Tensor | None  # [N, 1] float32; None when all are 0
    presence: torch.Tensor | None  # [N, 1] float32; None when all are 0


@dataclass
class SamplingMetadata:
    """Everything the sampler needs about one step's batch, one row per sequence."""

    num_rows: int
    vocab_size: int
    greedy_rows: torch.Tensor | None  # [G] long; None when no row is greedy
    random_rows: torch.Tensor | None  # [R] long; None when every row is greedy
    all_random: bool
    noise_keys: torch.Tensor | None  # [R] int64, 32-bit keys of the random rows
    temperatures: torch.Tensor | None  # [R, 1] float32; None when all are 1
    top_k: RowValues | None  # long k, rows with top_k but no top_p (into the random sub-batch)
    top_p: TopPTensors | None
    log_min_p: RowValues | None  # float32 log(min_p), rows with min_p > 0 (random sub-batch)
    penalties: PenaltyTensors | None
    banned_rows: torch.Tensor | None  # [X] long; with banned_ids: logits set to -inf
    banned_ids: torch.Tensor | None  # [X] long
    logprob_rows: torch.Tensor | None  # [L] long; rows that asked for logprobs
    num_logprobs: list[int | None]  # [B] each row's SamplingParams.logprobs

    @property
    def edits_logits(self) -> bool:
        """Return whether any stage before the greedy/random split rewrites logits."""
        return self.penalties is not None or self.banned_rows is not None

    @classmethod
    def from_sequences(
        cls, seqs: list[Sequence], vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        """Return the metadata of a batch whose logits row i belongs to `seqs[i]`."""
        params = [seq.sampling_params for seq in seqs]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        random = [i for i, p in enumerate(params) if not p.greedy]
        random_seqs = [seqs[i] for i in random]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        banned_rows, banned_ids = _banned_tokens(seqs, vocab_size)
        return cls(
            num_rows=len(seqs),
            vocab_size=vocab_size,
            greedy_rows=_long(greedy, device) if greedy else None,
            random_rows=_long(random, device) if random else None,
            all_random=len(random) == len(seqs),
            noise_keys=_long([sequence_noise_key(s) for s in random_seqs], device)
            if random
            else None,
            temperatures=_temperatures(random_seqs, device),
            top_k=_top_k_only(random_seqs, device),
            top_p=_top_p(random_seqs, vocab_size, device),
            log_min_p=_log_min_p(random_seqs, device),
            penalties=_penalties(seqs, vocab_size, device),
            banned_rows=_long(banned_rows, device) if banned_rows else None,
            banned_ids=_long(banned_ids, device) if banned_ids else None,
            logprob_rows=_long(logprob_rows, device) if logprob_rows else None,
            num_logprobs=[p.logprobs for p in params],
        )


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    """Return `values` as a long tensor on `device`."""
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """Return `values` as a float32 column [N, 1] on `device`."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _subset(used: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    """Return the row indices `used`, or None when they are all `total` rows."""
    return None if len(used) == total else _long(used, device)


def _temperatures(seqs: list[Sequence], device: torch.device) -> torch.Tensor | None:
    """Return the random rows' temperatures [R, 1], or None when every one is 1."""
    temperatures = [s.sampling_params.temperature for s in seqs]
    if all(t == 1.0 for t in temperatures):
        return None
    return _column(temperatures, device)


def _top_k_only(seqs: list[Sequence], device: torch.device) -> RowValues | None:
    """Return k for the rows with top_k and no top_p (those go through the sort instead)."""
    params = [s.sampling_params for s in seqs]
    used = [i for i, p in enumerate(params) if p.top_k > 0 and p.top_p >= 1.0]
    if not used:
        return None
    k = _long([params[i].top_k for i in used], device).unsqueeze(1)  # [K, 1]
    return RowValues(_subset(used, len(seqs), device), k)


def _top_p(seqs: list[Sequence], vocab_size: int, device: torch.device) -> TopPTensors | None:
    """Return top_p, and the top_k that precedes it, for the rows with top_p < 1."""
    params = [s.sampling_params for s in seqs]
    used = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if not used:
        return None
    top_k = [min(params[i].top_k, vocab_size) or vocab_size for i in used]
    return TopPTensors(
        rows=_subset(used, len(seqs), device),
        top_p=_column([params[i].top_p for i in used], device),
        top_k=_long(top_k, device).unsqueeze(1),
    )


def _log_min_p(seqs: list[Sequence], device: torch.device) -> RowValues | None:
    """Return log(min_p) for the rows with min_p > 0: min_p on probabilities is a logit gap."""
    params = [s.sampling_params for s in seqs]
    used = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if not used:
        return None
    log_min_p = _column([math.log(params[i].min_p) for i in used], device)
    return RowValues(_subset(used, len(seqs), device), log_min_p)


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def _flat_pairs(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (row, token id) of every in-vocab token in `token_lists`: ([T] long, [T] long)."""
    lengths = _long([len(ids) for ids in token_lists], device)  # [N]
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)  # [T]
    ids = _long([t for token_ids in token_lists for t in token_ids], device)  # [T]
    # Ids past the logits' width (a tokenizer's added tokens) cannot be penalised; drop them.
    in_vocab = ids < vocab_size  # [T]
    return rows[in_vocab], ids[in_vocab]


def _penalties(
    seqs: list[Sequence], vocab_size: int, device: torch.device
) -> PenaltyTensors | None:
    """Return the penalty tensors of the rows with any penalty, or None when none has one."""
    used = [i for i, s in enumerate(seqs) if _has_penalty(s.sampling_params)]
    if not used:
        return None
    params = [seqs[i].sampling_params for i in used]
    repetition = [p.repetition_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    presence = [p.presence_penalty for p in params]
    output_rows, output_ids = _flat_pairs(
        [seqs[i].output_token_ids for i in used], vocab_size, device
    )
    prompt_rows = prompt_ids = None
    if any(r != 1.0 for r in repetition):
        prompt_rows, prompt_ids = _flat_pairs(
            [seqs[i].prompt_token_ids for i in used], vocab_size, device
        )
    return PenaltyTensors(
        rows=_subset(used, len(seqs), device),
        output_rows=output_rows,
        output_ids=output_ids,
        prompt_rows=prompt_rows,
        prompt_ids=prompt_ids,
        repetition=_column(repetition, device) if any(r != 1.0 for r in repetition) else None,
        frequency=_column(frequency, device) if any(frequency) else None,
        presence=_column(presence, device) if any(presence) else None,
    )


def _banned_tokens(seqs: list[Sequence], vocab_size: int) -> tuple[list[int], list[int]]:
    """Return (rows, token ids) that min_tokens forbids this step: EOS and stop token ids."""
    rows: list[int] = []
    ids: list[int] = []
    for row, seq in enumerate(seqs):
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            continue
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= seq.eos_token_ids
        banned_ids = sorted(t for t in banned if t < vocab_size)
        rows += [row] * len(banned_ids)
        ids += banned_ids
    return rows, ids
