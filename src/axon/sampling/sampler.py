"""The batched sampler: penalties, min_tokens, greedy or filtered random sampling, logprobs.

One call handles a whole batch with torch ops over all rows of a group at once; no Python loop
runs per token or per request. Random rows draw by an exponential race, `argmax(probs / E)` with
`E ~ Exp(1)`, whose noise is a counter-based hash of (the row's key, token id). So a row's token
depends only on its own seed, output position and probabilities, never on its batch, and
looking at a row's top candidates only gives the same token as looking at the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from axon.sampling.metadata import FilteredRows, PenaltyTensors, RandomRows, SamplingMetadata

_MASK32 = 0xFFFFFFFF
_HASH_MULTIPLIER = 0x45D9F3B  # < 2^27: a 32-bit value times it stays far below 2^63
_LARGEST_BELOW_ONE = 1.0 - 2.0**-24  # in float32
# On CPU the vocabulary-wide race runs a few rows at a time: ~20 elementwise passes over a
# chunk that stays in cache run ~3x faster than over the whole [R, V] batch.
_CPU_CHUNK_ELEMENTS = 1 << 20


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability under the raw model distribution."""

    token_id: int
    logprob: float
    rank: int  # 1-based: 1 + the number of tokens with a strictly higher logprob
    top: list[tuple[int, float]]  # the k = params.logprobs most likely (token_id, logprob)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [B] the sampled token of each row
    logprobs: list[TokenLogprobs | None]  # [B] None where the row asked for no logprobs


class Sampler(nn.Module):
    """Turns one step's logits into one token per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self._vocab_hashes: dict[tuple[int, torch.device], torch.Tensor] = {}

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Return the sampled token (and requested logprobs) of each row of `logits` [B, V].

        `logits` is left unchanged; logprobs come from it raw, like vLLM's `raw_logprobs`.
        """
        if tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
            expected = (meta.num_rows, meta.vocab_size)
            raise ValueError(f"logits shape {tuple(logits.shape)} != metadata's {expected}")
        if meta.greedy_only:  # decode's hot path: one argmax a row and nothing else
            return SamplerOutput(greedy_token_ids(logits.float()), [None] * meta.num_rows)
        return self._sample(logits.float(), meta)

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """`forward` for a batch with random rows, logit edits or logprobs; logits [B, V]."""
        # Contiguous: the stages below edit it through a 1-D view.
        processed = (
            logits.clone(memory_format=torch.contiguous_format) if meta.edits_logits else logits
        )  # [B, V]
        if meta.bias is not None:
            bias_index = flat_index(processed, meta.bias.rows, meta.bias.token_ids)  # [T]
            processed.view(-1).index_add_(0, bias_index, meta.bias.values)
        if meta.penalties is not None:
            apply_penalties_(processed, meta.penalties)
        if meta.banned_rows is not None:
            banned = flat_index(processed, meta.banned_rows, meta.banned_ids)  # [X]
            processed.view(-1).index_fill_(0, banned, float("-inf"))
        token_ids = self._choose_tokens(processed, meta)  # [B]
        if meta.forced_rows is not None:  # taken whatever the logits; logprobs are of these
            token_ids.index_copy_(0, meta.forced_rows, meta.forced_ids)
        return SamplerOutput(token_ids.tolist(), gather_logprobs(logits, token_ids, meta))

    def _choose_tokens(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Return each row's token [B]: argmax for greedy rows, a draw for the others."""
        if meta.plain is None and meta.filtered is None:  # every row greedy (decode's hot path)
            return greedy(logits)
        token_ids = torch.empty(meta.num_rows, dtype=torch.long, device=logits.device)  # [B]
        if meta.greedy_rows is not None:
            rows = meta.greedy_rows
            token_ids.index_copy_(0, rows, greedy(_take_rows(logits, rows)))
        if meta.plain is not None:
            draws = sample_plain(logits, meta.plain, self._vocab_hash(logits))
            token_ids.index_copy_(0, meta.plain.rows, draws)
        if meta.filtered is not None:
            rows = meta.filtered.rows
            vocab_hash = self._vocab_hash(logits)
            draws = sample_filtered(_take_rows(logits, rows), meta.filtered, vocab_hash)
            token_ids.index_copy_(0, rows, draws)
        return token_ids

    def _vocab_hash(self, logits: torch.Tensor) -> torch.Tensor:
        """Return hash32(arange(V)) [V] int64, cached per vocab size and device."""
        cache_key = (logits.shape[-1], logits.device)
        if cache_key not in self._vocab_hashes:
            vocab = torch.arange(logits.shape[-1], dtype=torch.long, device=logits.device)
            self._vocab_hashes[cache_key] = hash32_(vocab)  # [V]
        return self._vocab_hashes[cache_key]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Return each row's argmax [B] long: its first maximum, or its first NaN (torch's rule)."""
    if _numpy_argmax(logits):
        return torch.from_numpy(logits.detach().numpy().argmax(axis=1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def greedy_token_ids(logits: torch.Tensor) -> list[int]:
    """Return `greedy(logits)` as a list, with no tensor in between on CPU float32."""
    if _numpy_argmax(logits):
        return logits.detach().numpy().argmax(axis=1).tolist()
    return greedy(logits).tolist()


def _numpy_argmax(logits: torch.Tensor) -> bool:
    """Whether numpy's argmax takes `logits` [B, V]: CPU float32, where it reads a row once,
    far faster than torch's. The same result, ties and NaN included."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2


def _take_rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Return `logits[rows]`, without a copy when `rows` (ascending) is every row."""
    return logits if rows.numel() == logits.shape[0] else logits.index_select(0, rows)


def apply_penalties_(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Apply repetition, frequency and presence penalties to `logits` [B, V] in place.

    Repetition (HF): logit > 0 → logit / p, else logit * p. Then logit -= frequency * count +
    presence * (count > 0). A pair listed twice computes the same value twice.
    """
    flat = logits.view(-1)  # [B * V]: `logits` must be contiguous
    index = flat_index(logits, penalties.rows, penalties.token_ids)  # [T]
    values = flat.index_select(0, index)  # [T]
    if penalties.repetition is not None:
        repetition = penalties.repetition
        values = torch.where(values > 0, values / repetition, values * repetition)  # [T]
    if penalties.subtract is not None:
        values = values - penalties.subtract  # [T]
    flat.index_copy_(0, index, values)


def flat_index(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Return the positions [T] of (rows [T], token_ids [T]) in `logits` [B, V] seen as 1-D.

    1-D index_select / index_copy_ on these run serially on CPU, where 2-D advanced indexing
    (`logits[rows, ids]`) starts an OpenMP region even for a few pairs, which on a busy machine
    waits for a descheduled thread.
    """
    return rows * logits.shape[-1] + token_ids


def sample_plain(logits: torch.Tensor, plain: RandomRows, vocab_hash: torch.Tensor) -> torch.Tensor:
    """Return one draw [R] from softmax(logits[row] / T) for each of `plain.rows`."""
    num_rows, vocab_size = plain.rows.numel(), logits.shape[-1]
    chunk = num_rows
    if logits.device.type == "cpu":
        chunk = max(1, _CPU_CHUNK_ELEMENTS // vocab_size)
    draws = []
    for start in range(0, num_rows, chunk):
        part = slice(start, start + chunk)
        scaled = logits.index_select(0, plain.rows[part])  # [c, V], a copy
        scaled = scaled.sub_(scaled.amax(dim=-1, keepdim=True))  # [c, V]
        if plain.temperatures is not None:
            scaled.div_(plain.temperatures[part])
        probs = scaled.exp_()  # [c, V] unnormalised: the race's argmax does not need the sum
        draws.append(exponential_race(probs, plain.noise_keys[part], vocab_hash))
    return torch.cat(draws)  # [R]


def exponential_race(
    probs: torch.Tensor, keys: torch.Tensor, token_hash: torch.Tensor
) -> torch.Tensor:
    """Return argmax(probs / E) [R]: an exact categorical draw from `probs` [R, N] (any scale).

    `token_hash` ([N] or [R, N]) is hash32 of each column's token id; `probs` is overwritten.
    """
    return probs.div_(exponential_noise(keys, token_hash)).argmax(dim=-1)


def exponential_noise(keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """Return Exp(1) noise [R, N] float32, a pure function of (keys [R], token_hash [.., N]).

    E = -log(1 - u): building u from 32 bits keeps small E (the ones that let an unlikely
    token win) resolved down to 2^-32; the clamp keeps E finite and positive.
    """
    bits = hash32_(token_hash ^ keys.unsqueeze(1))  # [R, N] int64 in [0, 2^32)
    uniform = bits.float().add_(0.5).mul_(2.0**-32).clamp_(max=_LARGEST_BELOW_ONE)  # [R, N]
    return uniform.neg_().log1p_().neg_()  # [R, N]


def hash32_(x: torch.Tensor) -> torch.Tensor:
    """Return `x` (int64 values in [0, 2^32)) hashed in place to well-mixed 32-bit values.

    Thomas Mueller's integer hash; masking after each multiply keeps products below 2^59.
    """
    shifted = torch.empty_like(x)
    for _ in range(2):
        torch.bitwise_right_shift(x, 16, out=shifted)
        x.bitwise_xor_(shifted).mul_(_HASH_MULTIPLIER).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 16, out=shifted)
    return x.bitwise_xor_(shifted)


def sample_filtered(
    logits: torch.Tensor, filtered: FilteredRows, vocab_hash: torch.Tensor
) -> torch.Tensor:
    """Return one draw [F] per row of `logits` [F, V] under the rows' top_k, top_p and min_p.

    Rows are first sampled among their top candidates; a row whose kept set might reach past
    them is sampled again over its whole sorted vocabulary. Both give the same token.
    """
    vocab_size = logits.shape[-1]
    draws, fits = _sample_candidates(logits, filtered, vocab_hash, filtered.num_candidates)
    if filtered.num_candidates < vocab_size:
        unfit = (~fits).nonzero().squeeze(1)  # [U]
        if unfit.numel() > 0:
            rows = filtered.select(unfit)
            draws[unfit] = _sample_candidates(logits[unfit], rows, vocab_hash, vocab_size)[0]
    return draws


def _sample_candidates(
    logits: torch.Tensor, filtered: FilteredRows, vocab_hash: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (draws [F], fits [F]) sampling among each row's `num_candidates` top logits.

    `fits` says the row's kept tokens all lie among its candidates, so its draw is final.
    """
    if num_candidates == logits.shape[-1]:
        values, token_ids = logits.sort(dim=-1, descending=True)  # [F, V], [F, V]
    else:
        values, token_ids = logits.topk(num_candidates, dim=-1)  # [F, C] descending
    if filtered.temperatures is not None:
        values = values / filtered.temperatures  # [F, C]
    keep, fits = _keep_candidates(values, logits, filtered)  # [F, C], [F]
    probs = values.sub(values[:, :1]).exp_().masked_fill_(~keep, 0.0)  # [F, C] unnormalised
    choice = exponential_race(probs, filtered.noise_keys, vocab_hash[token_ids])  # [F]
    return token_ids.gather(1, choice.unsqueeze(1)).squeeze(1), fits


def _keep_candidates(
    values: torch.Tensor, logits: torch.Tensor, filtered: FilteredRows
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (keep [F, C], fits [F]) for descending, temperature-scaled candidates [F, C].

    Every filter keeps a token by its value alone (ties stay together), so `keep` does not
    depend on how many candidates there are; a row fits when its last candidate is dropped.
    """
    keep = torch.ones_like(values, dtype=torch.bool)  # [F, C]
    mass_known = torch.ones_like(values[:, 0], dtype=torch.bool)  # [F]
    if filtered.top_k is not None:
        last = values.shape[-1] - 1
        kth = values.gather(1, (filtered.top_k - 1).clamp(max=last))  # [F, 1]
        keep &= values >= kth
    if filtered.top_p is not None:
        keep_p, mass_known = _top_p_keep(values, keep, logits, filtered)
        keep &= keep_p
    if filtered.log_min_p is not None:
        keep &= values >= values[:, :1] + filtered.log_min_p
    if values.shape[-1] == logits.shape[-1]:
        return keep, mass_known
    return keep, mass_known & ~keep[:, -1]


def _top_p_keep(
    values: torch.Tensor, keep_k: torch.Tensor, logits: torch.Tensor, filtered: FilteredRows
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (keep [F, C], mass_known [F]) for top_p, applied after top_k as vLLM does.

    A token is kept while the probability of the tokens strictly above it is below top_p.
    Probabilities need the top_k set's normaliser: the candidates' when it lies among them,
    the whole vocabulary's when the row has no top_k; otherwise the row is not `mass_known`.
    """
    vocab_size, num_candidates = logits.shape[-1], values.shape[-1]
    masked = values.masked_fill(~keep_k, float("-inf"))  # [F, C]
    k_inside = ~keep_k[:, -1] if num_candidates < vocab_size else torch.ones_like(keep_k[:, 0])
    no_k = (
        torch.ones_like(k_inside) if filtered.top_k is None else filtered.top_k[:, 0] >= vocab_size
    )
    normaliser = masked.logsumexp(dim=-1, keepdim=True)  # [F, 1]
    if num_candidates < vocab_size and not bool(k_inside.all()):
        scaled = logits if filtered.temperatures is None else logits / filtered.temperatures
        normaliser = torch.where(k_inside.unsqueeze(1), normaliser, scaled.logsumexp(-1, True))
    probs = (masked - normaliser).exp_()  # [F, C]
    mass_above = _mass_strictly_above(masked, probs)  # [F, C]
    off = filtered.top_p >= 1.0  # [F, 1]
    return (mass_above < filtered.top_p) | off, k_inside | no_k | off[:, 0]


def _mass_strictly_above(values: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Return, for descending `values` [F, C], the summed `probs` of strictly larger values."""
    positions = torch.arange(values.shape[-1], device=values.device)  # [C]
    group_starts = torch.ones_like(values, dtype=torch.bool)  # [F, C] first of a run of ties
    group_starts[:, 1:] = values[:, 1:] != values[:, :-1]
    first_of_group = torch.where(group_starts, positions, 0).cummax(dim=-1).values  # [F, C]
    exclusive = probs.cumsum(dim=-1).sub_(probs)  # [F, C]
    return exclusive.gather(1, first_of_group)


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, meta: SamplingMetadata
) -> list[TokenLogprobs | None]:
    """Return each row's TokenLogprobs for `token_ids` [B] under raw `logits` [B, V], or None."""
    if meta.logprob_rows is None:
        return [None] * meta.num_rows
    rows = meta.logprob_rows  # [L]
    row_list = [row for row, k in enumerate(meta.num_logprobs) if k is not None]
    logprobs = _take_rows(logits, rows).log_softmax(dim=-1)  # [L, V]
    sampled = token_ids[rows].unsqueeze(1)  # [L, 1]
    sampled_logprobs = logprobs.gather(1, sampled)  # [L, 1]
    ranks = (logprobs > sampled_logprobs).sum(dim=-1).add_(1)  # [L]
    max_top = max(meta.num_logprobs[row] for row in row_list)
    top_logprobs, top_ids = logprobs.topk(max_top, dim=-1)  # [L, max_top] descending
    results: list[TokenLogprobs | None] = [None] * meta.num_rows
    row_data = zip(
        row_list,
        sampled.squeeze(1).tolist(),
        sampled_logprobs.squeeze(1).tolist(),
        ranks.tolist(),
        top_ids.tolist(),
        top_logprobs.tolist(),
    )
    for row, token_id, logprob, rank, ids, values in row_data:
        k = meta.num_logprobs[row]
        results[row] = TokenLogprobs(token_id, logprob, rank, list(zip(ids[:k], values[:k])))
    return results
