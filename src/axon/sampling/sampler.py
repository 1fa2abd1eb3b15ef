"""The batched sampler: penalties, min_tokens, greedy or filtered random sampling, logprobs.

One call handles a whole batch with a fixed number of torch ops; no Python loop touches a
vocab-sized tensor. Random rows draw by an exponential race, `argmax(probs / E)` with
`E ~ Exp(1)`, whose noise is a counter-based hash of (the row's key, vocab index): a row's token
depends only on its own seed, output position and probabilities, never on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from axon.sampling.metadata import PenaltyTensors, RowValues, SamplingMetadata, TopPTensors

_MASK32 = 0xFFFFFFFF
_HASH_MULTIPLIER = 0x45D9F3B  # < 2^27, so a 32-bit value times it stays far below 2^63
_LARGEST_BELOW_ONE = 1.0 - 2.0**-24  # float32


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

    @torch.inference_mode()
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Return the sampled tokens (and requested logprobs) for `logits` [B, V].

        `logits` is not modified; logprobs come from it raw, as vLLM's default `raw_logprobs`.
        """
        logits = logits.float()  # [B, V]
        processed = logits.clone() if meta.edits_logits else logits  # [B, V]
        if meta.penalties is not None:
            apply_penalties_(processed, meta.penalties)
        if meta.banned_rows is not None:
            processed[meta.banned_rows, meta.banned_ids] = float("-inf")
        token_ids = self._choose_tokens(processed, meta, owned=meta.edits_logits)  # [B]
        return SamplerOutput(token_ids.tolist(), gather_logprobs(logits, token_ids, meta))

    def _choose_tokens(
        self, logits: torch.Tensor, meta: SamplingMetadata, owned: bool
    ) -> torch.Tensor:
        """Return the token of every row [B]: argmax for greedy rows, a draw for the others.

        Random rows' logits are changed in place when `owned` (the caller's copy).
        """
        if meta.random_rows is None:
            return logits.argmax(dim=-1)  # [B]
        if meta.all_random:
            return self._sample(logits, meta, owned)  # [B]
        token_ids = torch.empty(meta.num_rows, dtype=torch.long, device=logits.device)  # [B]
        token_ids[meta.greedy_rows] = logits[meta.greedy_rows].argmax(dim=-1)
        token_ids[meta.random_rows] = self._sample(logits[meta.random_rows], meta, owned=True)
        return token_ids

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, owned: bool) -> torch.Tensor:
        """Return one draw [R] per row of the random rows' logits [R, V] (changed when `owned`)."""
        if meta.temperatures is not None:
            logits = logits.div_(meta.temperatures) if owned else logits / meta.temperatures
            owned = True
        filters = meta.top_k is not None or meta.top_p is not None or meta.log_min_p is not None
        if filters and not owned:
            logits = logits.clone()
        if meta.top_k is not None:
            apply_top_k_(logits, meta.top_k)
        if meta.top_p is not None:
            apply_top_p_(logits, meta.top_p)
        if meta.log_min_p is not None:
            apply_min_p_(logits, meta.log_min_p)
        probs = logits.softmax(dim=-1)  # [R, V]
        noise = exponential_noise(meta.noise_keys, self._vocab_hash(logits))  # [R, V]
        return probs.div_(noise).argmax(dim=-1)  # [R]

    def _vocab_hash(self, logits: torch.Tensor) -> torch.Tensor:
        """Return hash32(arange(V)) [V] int64, cached per vocab size and device."""
        cache_key = (logits.shape[-1], logits.device)
        if cache_key not in self._vocab_hashes:
            vocab = torch.arange(logits.shape[-1], dtype=torch.long, device=logits.device)
            self._vocab_hashes[cache_key] = hash32_(vocab)  # [V]
        return self._vocab_hashes[cache_key]


def apply_penalties_(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Apply repetition, frequency and presence penalties to `logits` [B, V] in place.

    Repetition (HF): over prompt and output tokens, logit > 0 → logit / p, else logit * p.
    Frequency and presence (OpenAI): over output tokens, logit -= f * count + p * (count > 0).
    """
    rows = penalties.rows
    penalised = logits if rows is None else logits[rows]  # [N, V]
    counts = torch.zeros_like(penalised)  # [N, V] output-token counts
    flat_index = penalties.output_rows * logits.shape[-1] + penalties.output_ids  # [T_out]
    counts.view(-1).index_add_(0, flat_index, torch.ones_like(flat_index, dtype=counts.dtype))
    if penalties.repetition is not None:
        seen = counts > 0  # [N, V]
        seen[penalties.prompt_rows, penalties.prompt_ids] = True
        factor = torch.where(seen, penalties.repetition, 1.0)  # [N, V]
        penalised.copy_(torch.where(penalised > 0, penalised / factor, penalised * factor))
    if penalties.frequency is not None:
        penalised.sub_(counts * penalties.frequency)
    if penalties.presence is not None:
        penalised.sub_((counts > 0).float() * penalties.presence)
    if rows is not None:
        logits[rows] = penalised


def _select(logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Return the `rows` of `logits` [N, V] (a copy), or `logits` itself when rows is None."""
    return logits if rows is None else logits[rows]


def _put_back(logits: torch.Tensor, rows: torch.Tensor | None, selected: torch.Tensor) -> None:
    """Write `selected` [N, V] back into `logits` when `_select` made a copy."""
    if rows is not None:
        logits[rows] = selected


def apply_top_k_(logits: torch.Tensor, top_k: RowValues) -> None:
    """Keep each row's k largest logits (ties at the k-th included), -inf the rest, in place."""
    selected = _select(logits, top_k.rows)  # [K, V]
    max_k = min(int(top_k.values.max()), logits.shape[-1])
    largest = selected.topk(max_k, dim=-1).values  # [K, max_k] descending
    kth = largest.gather(1, top_k.values.clamp(max=max_k) - 1)  # [K, 1]
    selected.masked_fill_(selected < kth, float("-inf"))
    _put_back(logits, top_k.rows, selected)


def apply_top_p_(logits: torch.Tensor, top_p: TopPTensors) -> None:
    """Apply top_k then top_p (nucleus) to the rows in `top_p`, in place.

    A token is dropped when the tokens ranked above it already hold at least top_p of the
    probability after top_k, so the most likely token always survives.
    """
    selected = _select(logits, top_p.rows)  # [P, V]
    sorted_logits, order = selected.sort(dim=-1, descending=True)  # [P, V], [P, V]
    positions = torch.arange(logits.shape[-1], device=logits.device)  # [V]
    beyond_k = positions >= top_p.top_k  # [P, V]
    sorted_logits.masked_fill_(beyond_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [P, V]
    mass_above = probs.cumsum(dim=-1).sub_(probs)  # [P, V] exclusive cumulative probability
    drop_sorted = beyond_k.logical_or_(mass_above >= top_p.top_p)  # [P, V]
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)  # [P, V]
    selected.masked_fill_(drop, float("-inf"))
    _put_back(logits, top_p.rows, selected)


def apply_min_p_(logits: torch.Tensor, log_min_p: RowValues) -> None:
    """Drop tokens whose probability is below min_p times the row's largest, in place.

    p_i < min_p * p_max is l_i < l_max + log(min_p): no softmax needed.
    """
    selected = _select(logits, log_min_p.rows)  # [M, V]
    threshold = selected.amax(dim=-1, keepdim=True) + log_min_p.values  # [M, 1]
    selected.masked_fill_(selected < threshold, float("-inf"))
    _put_back(logits, log_min_p.rows, selected)


def hash32_(x: torch.Tensor) -> torch.Tensor:
    """Return `x` (int64 values in [0, 2^32)) hashed in place to well-mixed 32-bit values.

    Thomas Mueller's integer hash; masking after each multiply keeps products below 2^59.
    """
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(_HASH_MULTIPLIER).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def exponential_noise(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """Return Exp(1) noise [R, V] float32 that is a pure function of (keys [R], vocab index).

    E = -log(1 - u): building u from 32 bits keeps small E (the ones that let an unlikely
    token win) resolved down to 2^-32, and the clamp keeps E finite and positive.
    """
    bits = hash32_(vocab_hash ^ keys.unsqueeze(1))  # [R, V] int64 in [0, 2^32)
    uniform = bits.float().add_(0.5).mul_(2.0**-32).clamp_(max=_LARGEST_BELOW_ONE)  # [R, V]
    return uniform.neg_().log1p_().neg_()  # [R, V]


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, meta: SamplingMetadata
) -> list[TokenLogprobs | None]:
    """Return each row's TokenLogprobs for `token_ids` [B] under raw `logits` [B, V], or None."""
    if meta.logprob_rows is None:
        return [None] * meta.num_rows
    row_list = [row for row, k in enumerate(meta.num_logprobs) if k is not None]
    rows = meta.logprob_rows  # [L]
    logprobs = (logits if len(row_list) == meta.num_rows else logits[rows]).log_softmax(-1)
    sampled = token_ids[rows].unsqueeze(1)  # [L, 1]
    sampled_logprobs = logprobs.gather(1, sampled)  # [L, 1]  logprobs: [L, V]
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
