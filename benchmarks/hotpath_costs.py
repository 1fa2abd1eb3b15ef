"""Per-token costs of the serving hot path, in CPU microseconds (thread time, so a busy
machine distorts them less than wall time): what the profile at concurrency 16 pointed at.

Measures, for a 16-row decode batch on the demo model's vocabulary and tokenizer:
penalty metadata per step (rebuilt from full token lists vs the persistent PenaltyCounts),
the rest of the sampling metadata, the engine->HTTP transfer of a step's updates (encoded),
and per token in the HTTP process: incremental detokenization and SSE chunk framing.

    .venv/bin/python benchmarks/hotpath_costs.py [--output-len 512]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from types import SimpleNamespace

import torch

from axon.demo import demo_model_path
from axon.engine.messages import Updates, decode, encode
from axon.engine.output_processor import RequestState
from axon.outputs import TokenUpdate
from axon.sampling import SamplingMetadata
from axon.sampling.penalties import PenaltyCounts, penalty_tensors_ref
from axon.sampling.sampler import apply_penalties_
from axon.sampling_params import SamplingParams
from axon.sequence import Sequence, SequenceStatus
from axon.server.routes.openai_completions import _CompletionContext
from axon.server.schemas.protocol import CompletionRequest, sse
from axon.tokenizer.gguf_tokenizer import load_gguf_tokenizer

CPU = torch.device("cpu")
ROWS = 16


def cpu_us(fn, repeats: int) -> float:
    """Mean CPU microseconds of `fn()` over `repeats` calls."""
    start = time.thread_time()
    for _ in range(repeats):
        fn()
    return (time.thread_time() - start) / repeats * 1e6


def decode_batch(params: SamplingParams, prompt_len: int, output_len: int, vocab: int):
    rng = random.Random(0)
    batch = []
    for _ in range(ROWS):
        seq = Sequence("r", [rng.randrange(vocab) for _ in range(prompt_len)], params)
        seq.status = SequenceStatus.RUNNING
        for _ in range(output_len):
            seq.append_token(rng.randrange(vocab))
        batch.append(seq)
    return batch


def penalty_costs(args, vocab: int) -> dict[str, float]:
    """Per-step CPU us of the penalties for a decode batch, each step adding a token per row."""
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
    batch = decode_batch(params, args.prompt_len, args.output_len, vocab)
    rng = random.Random(1)
    counts = PenaltyCounts(vocab, CPU)
    counts.tensors(batch)  # the rows join: counted once

    def grow() -> None:
        for seq in batch:
            seq.append_token(rng.randrange(vocab))

    steps = args.steps
    rebuild = cpu_us(lambda: (grow(), penalty_tensors_ref(batch, vocab, CPU)), steps)
    incremental = cpu_us(lambda: (grow(), counts.tensors(batch)), steps)
    greedy = decode_batch(SamplingParams(temperature=0.0), args.prompt_len, 1, vocab)
    plain_meta = cpu_us(lambda: SamplingMetadata.from_sequences(greedy, vocab, CPU, counts), steps)
    pairs = counts.tensors(batch)
    logits = torch.randn(ROWS, vocab)
    return {
        "penalty pairs, rebuilt from token lists (per step)": rebuild,
        "penalty pairs, PenaltyCounts (per step)": incremental,
        "apply penalties, 2-D advanced indexing (per step)": cpu_us(
            lambda: _apply_2d(logits, pairs), steps
        ),
        "apply penalties, apply_penalties_ (per step)": cpu_us(
            lambda: apply_penalties_(logits, pairs), steps
        ),
        "sampling metadata, greedy rows, no penalties (per step)": plain_meta,
    }


def _apply_2d(logits: torch.Tensor, penalties) -> None:
    """apply_penalties_ as it was: gather and scatter with `logits[rows, ids]`."""
    values = logits[penalties.rows, penalties.token_ids]  # [T]
    values = torch.where(values > 0, values / penalties.repetition, values * penalties.repetition)
    logits[penalties.rows, penalties.token_ids] = values - penalties.subtract


def http_costs(args, tokenizer) -> dict[str, float]:
    """Per-token CPU us in the HTTP process and of the step's transfer."""

    text = "The lighthouse keeper climbed the stairs and looked out over the grey sea. " * 40
    ids = tokenizer.encode(text)[: args.steps]
    params = SamplingParams(max_tokens=len(ids))
    state = RequestState("r", None, ids[:8], params, tokenizer)
    updates = iter([TokenUpdate("r", 0, token_id) for token_id in ids])
    detok = cpu_us(lambda: state.samples[0].add(next(updates)), len(ids))
    request = CompletionRequest(model="gemma-3-270m", prompt="p")
    context = _CompletionContext(request, SimpleNamespace(id="gemma-3-270m"), params)
    sample = SimpleNamespace(index=0, finish_reason=None, stop_reason=None)
    make_choice = lambda: context.choice(0, sample, " sea", None, False)
    full = cpu_us(lambda: sse(context.body_of([make_choice()])), 5000)
    chunk = cpu_us(lambda: context.chunk(make_choice()), 5000)
    step = [TokenUpdate(f"{i:032x}", 0, 1234, num_cached_tokens=16) for i in range(ROWS)]
    transfer = cpu_us(lambda: decode(encode(Updates(step))), 500) / ROWS
    return {
        "detokenize + stop check, SampleState.add (per token)": detok,
        "SSE chunk, whole body json.dumps (per token)": full,
        "SSE chunk, _CompletionContext.chunk (per token)": chunk,
        "engine->HTTP transfer, encode + decode (per token)": transfer,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=140)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_gguf_tokenizer(demo_model_path())
    vocab = len(tokenizer)
    print(
        f"rows={ROWS} prompt_len={args.prompt_len} output_len={args.output_len} vocab={vocab} "
        f"torch_threads={torch.get_num_threads()}"
    )
    for name, value in {**penalty_costs(args, vocab), **http_costs(args, tokenizer)}.items():
        print(f"{value:9.1f} us  {name}")
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
