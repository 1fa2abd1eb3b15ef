"""Speculative decoding in process, by CPU time: axon with and without n-gram drafts on the
workloads of benchmarks/speculative.py (edit, summary, free), one stream, one thread.

The served benchmark (speculative.py) needs a quiet machine; this one counts the main thread's
CPU time (with one thread every kernel runs on it), so a busy machine moves it little. Two
engines of the chat demo (default activation precision) take turns on each prompt (SmolLM2's
ChatML framing, greedy, --max-tokens tokens); a row per workload: tokens per CPU-second of
each, their ratio, the drafts accepted and the row cost the engine measured.

    PYTHONPATH=src python benchmarks/speculative_cpu.py [--max-tokens 160] [--prompts 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative_prompts import WORKLOADS, workload_prompts  # noqa: E402

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(message: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{message}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--prompts", type=int, default=3, help="per workload")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from axon import LLM, SamplingParams
    from axon.demo import chat_demo_model_path

    model, settings = str(chat_demo_model_path()), dict(max_model_len=4096, adaptive_threads=False)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}  # fmt: skip
    engines = {"axon": LLM(model=model, **settings),
               "axon ngram": LLM(model=model, **settings, speculative_config=ngram)}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(
        "| workload | axon tok/CPU-s | axon ngram tok/CPU-s | ratio | accepted / drafted "
        "| row cost |"
    )
    print("|---|---|---|---|---|---|")
    for workload in WORKLOADS:
        totals = {name: [0.0, 0] for name in engines}
        before = engines["axon ngram"].get_stats()
        for i, prompt in enumerate(workload_prompts(workload, args.prompts, True, 0)):
            for name in list(engines)[:: 1 if i % 2 == 0 else -1]:
                start = time.thread_time()
                (output,) = engines[name].generate([chatml(prompt)], params)
                totals[name][0] += time.thread_time() - start
                totals[name][1] += len(output.outputs[0].token_ids)
        after = engines["axon ngram"].get_stats()
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        base, spec = (tokens / seconds for seconds, tokens in totals.values())
        row_cost = engines["axon ngram"].engine.speculator.row_cost
        print(f"| {workload} | {base:.1f} | {spec:.1f} | {spec / base:.2f}x | "
              f"{accepted / max(drafted, 1):.1%} ({accepted}/{drafted}) | {row_cost:.3f} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
