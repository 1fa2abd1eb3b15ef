"""Speculative decoding in process, by CPU time: axon with and without n-gram drafts on the
workloads of benchmarks/speculative.py (edit, summary, free), at 1, 4 and 16 concurrent
streams, one thread.

The served benchmark (speculative.py) needs a quiet machine; this one counts the process's CPU
time (one thread: every kernel runs on the calling thread), so a busy machine moves it little.
Two engines of the chat demo (default activation precision) take turns on each batch of
prompts (SmolLM2's ChatML framing, greedy, --max-tokens tokens): a level of S streams runs
max(--min-prompts, --rounds * S) distinct prompts of a workload, S at a time through one
`LLM.generate` call (all S decode together, as S concurrent requests would). A row per level
and workload: output tokens per CPU-second of each engine, their ratio, the drafts accepted and
the row cost the engine measured. The engine's own step timer (the adaptive rule's row cost
and drafting cost) reads the thread's CPU time too (--engine-clock cpu, the default), so that
what it measures on a busy machine is what it would measure on a quiet one.

    PYTHONPATH=src python benchmarks/speculative_cpu.py [--streams 1 4 16] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative_prompts import WORKLOADS, workload_prompts  # noqa: E402

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(message: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{message}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def use_cpu_clock() -> None:
    """The engine's step and drafting timers read the thread's CPU time, not the wall clock."""
    from axon.engine import speculation
    from axon.runner import model_runner

    clock = types.SimpleNamespace(perf_counter=time.thread_time)
    model_runner.time = clock
    speculation.time = clock


def run_level(engines: dict, workload: str, streams: int, args: argparse.Namespace) -> str:
    """One table row: both engines on the same prompts, `streams` at a time, taking turns."""
    from axon import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    count = max(args.min_prompts, args.rounds * streams)
    prompts = [chatml(p) for p in workload_prompts(workload, count, True, 0)]
    batches = [prompts[i : i + streams] for i in range(0, count, streams)]
    totals = {name: [0.0, 0] for name in engines}
    spec = engines["axon ngram"]
    before = spec.get_stats()
    for i, batch in enumerate(batches):
        for name in list(engines)[:: 1 if i % 2 == 0 else -1]:
            start = time.process_time()
            outputs = engines[name].generate(batch, params)
            totals[name][0] += time.process_time() - start
            totals[name][1] += sum(len(out.outputs[0].token_ids) for out in outputs)
    after = spec.get_stats()
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    base, ngram = (tokens / seconds for seconds, tokens in totals.values())
    row_cost = spec.engine.speculator.row_cost
    return (
        f"| {workload} | {streams} | {base:.1f} | {ngram:.1f} | {ngram / base:.3f}x | "
        f"{accepted / max(drafted, 1):.1%} ({accepted}/{drafted}) | {row_cost:.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--workloads", nargs="+", default=["edit", "summary", "free"], choices=WORKLOADS
    )
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2, help="batches of each level")
    parser.add_argument("--min-prompts", type=int, default=3, help="per workload and level")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--engine-clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from axon import LLM
    from axon.demo import chat_demo_model_path

    if args.engine_clock == "cpu":
        use_cpu_clock()
    model = str(chat_demo_model_path())
    settings = dict(max_model_len=4096, adaptive_threads=False, max_num_seqs=16)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}  # fmt: skip
    print(
        "| workload | streams | axon tok/CPU-s | axon ngram tok/CPU-s | ratio "
        "| accepted / drafted | row cost |"
    )
    print("|---|---|---|---|---|---|---|")
    for streams in args.streams:
        # Fresh engines a level: the row cost each measures is that level's.
        engines = {
            "axon": LLM(model=model, **settings),
            "axon ngram": LLM(model=model, **settings, speculative_config=ngram),
        }
        for workload in args.workloads:
            print(run_level(engines, workload, streams, args), flush=True)


if __name__ == "__main__":
    main()
