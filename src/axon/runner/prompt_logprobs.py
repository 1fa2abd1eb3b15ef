"""Prompt logprobs (vLLM's `prompt_logprobs`; the legacy completions' `echo` with `logprobs`):
each prompt token's log-probability given the tokens before it, its rank and the k most likely
tokens at its position, from the raw logits of the rows that compute the prompt. A chunked
prompt gives its positions chunk by chunk; the engine gathers them until the first token.

Only the rows asked for reach the LM head, a bounded number at a time: a long prompt never
holds [num_prompt_tokens, vocab] logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from axon.batch import SchedulerOutput

MAX_ROWS_PER_PASS = 256  # logits [rows, vocab] float32 at once: 256 x 152k is ~150 MiB


@dataclass
class PromptRows:
    """The rows of a step's flat batch whose next token is a prompt token to score."""

    rows: torch.Tensor  # [P] rows of the flat batch
    targets: torch.Tensor  # [P] the prompt token each row predicts
    top_k: int  # the most top logprobs any sequence asks for
    spans: list[tuple[int, int, int, int]]  # (seq_id, first target position, count, k)
    # (logprobs [P], ranks [P], top ids [P, top_k], top logprobs [P, top_k]) on the CPU,
    # set by the forward on rank 0
    result: tuple | None = field(default=None, init=False)


def find_prompt_rows(out: SchedulerOutput, device: torch.device) -> PromptRows | None:
    """The rows of `out`'s flat batch (sequences in order, each its scheduled tokens) that
    predict a prompt token of a sequence wanting prompt logprobs, or None when there are none.
    A prompt's last row predicts the first output token: the sampler's row, not one of these."""
    rows, targets, spans, top_k, row = [], [], [], 0, 0
    for seq, num_new in out.scheduled:
        start = seq.num_computed_tokens
        end = min(start + num_new, seq.num_prompt_tokens - 1)
        if seq.wants_prompt_logprobs and end > start:
            k = seq.sampling_params.prompt_logprobs
            rows.extend(range(row, row + end - start))
            targets.extend(seq.token_ids[start + 1 : end + 1])
            spans.append((seq.seq_id, start + 1, end - start, k))
            top_k = max(top_k, k)
        row += num_new
    if not rows:
        return None
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PromptRows(as_tensor(rows), as_tensor(targets), top_k, spans)


def score_prompt_rows(model, hidden: torch.Tensor, prompt: PromptRows | None) -> None:
    """Sets `prompt.result`: the logprobs of its rows of `hidden` [T, hidden] under the model's
    logits, on the CPU (every tensor-parallel rank runs it: the LM head gathers across them).
    Does nothing when `prompt` is None."""
    if prompt is None:
        return
    logprobs, ranks, top_ids, top_values = [], [], [], []
    for first in range(0, len(prompt.rows), MAX_ROWS_PER_PASS):
        rows = prompt.rows[first : first + MAX_ROWS_PER_PASS]
        targets = prompt.targets[first : first + MAX_ROWS_PER_PASS].unsqueeze(1)  # [R, 1]
        scores = model.compute_logits(hidden[rows]).float().log_softmax(dim=-1)  # [R, V]
        target = scores.gather(1, targets)  # [R, 1]
        ranks.append((scores > target).sum(dim=-1).add_(1))
        logprobs.append(target.squeeze(1))
        values, ids = scores.topk(prompt.top_k, dim=-1)  # [R, k] descending
        top_ids.append(ids)
        top_values.append(values)
    parts = (logprobs, ranks, top_ids, top_values)
    prompt.result = tuple(torch.cat(part).cpu() for part in parts)


def by_sequence(prompt: PromptRows) -> dict[int, tuple[int, list[tuple]]]:
    """seq_id -> (first target position, [(token_id, logprob, rank, top)] per position) of a
    computed `prompt` (its `result` set): TokenLogprobs' fields, plain, for the engine pipe."""
    logprobs, ranks, top_ids, top_values = (part.tolist() for part in prompt.result)
    targets = prompt.targets.tolist()
    found, row = {}, 0
    for seq_id, first, count, k in prompt.spans:
        entries = [
            (targets[r], logprobs[r], ranks[r], list(zip(top_ids[r][:k], top_values[r][:k])))
            for r in range(row, row + count)
        ]
        found[seq_id] = (first, entries)
        row += count
    return found
