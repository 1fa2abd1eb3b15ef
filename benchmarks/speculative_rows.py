"""What a verify row costs: one sequence's step at T = 1 + drafts rows, in process, broken down.

Speculative decoding pays when a step of T rows costs much less than T one-row steps. This loads
the chat demo (default activation precision: int8 on the CPU), prefills one sequence of
--context random tokens, and then times steps of T rows (T - 1 drafts of a fixed token, all
verified; the row cost is pinned at 0 so that every step drafts): the whole step, its forward,
the LM head inside it, the batch's preparation and the sampling with verification. Two paths
of a verify step take turns: `rows` (each draft a decode row: the C decode layers, what the
engine does) and `chunk` (the drafts a prefill chunk: the layers' PyTorch forward, as before).
A second table times the model's int8 matmuls alone, every layer's weights and then the LM head,
per T. Row counts and paths alternate within each repeat; the figures are medians. With
--threads 1 the clock is the thread's CPU time (robust on a shared machine), else wall time.

    PYTHONPATH=src python benchmarks/speculative_rows.py [--context 1000] [--repeats 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict

import torch

ROWS = (1, 2, 3, 5, 9)
MATMUL_ROWS = (1, 2, 3, 5, 8, 9, 16)


class FixedDrafter:
    """Drafts `n` copies of one token for every sequence."""

    n = 0

    def propose(self, seqs, max_tokens):
        return [[42] * min(self.n, limit) for limit in max_tokens]

    def release(self, seq_ids):
        pass


def timed(obj, name: str, key: str, clock, into: dict) -> None:
    """Wrap obj.name so that its time adds to into[key]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + clock() - start

    setattr(obj, name, wrapper)


def step_table(llm, args, clock) -> list[str]:
    from axon import SamplingParams
    from axon.runner import decode_batch

    engine = llm.engine
    drafter = engine.speculator.drafter = FixedDrafter()
    engine.speculator.row_cost = 0.0  # every step drafts
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(args.context)]
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    engine.add_request("rows", prompt, params)
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens < 2:
        engine.step()
    current: dict[str, float] = {}
    runner = engine.runner
    for obj, name, key in ((runner, "forward_logits", "forward"), (runner, "prepare", "prepare"),
                           (runner.model, "compute_logits", "lm_head"),
                           (engine, "_sample", "sample")):  # fmt: skip
        timed(obj, name, key, clock, current)
    rows_rule = decode_batch.is_decode_only
    paths = {
        "rows": rows_rule,
        "chunk": lambda out: all(n == 1 for _, n in out.scheduled) and rows_rule(out),
    }
    times = defaultdict(lambda: defaultdict(list))
    for repeat in range(args.repeats):
        for path in list(paths)[:: 1 if repeat % 2 else -1]:
            decode_batch.is_decode_only = paths[path]
            for rows in ROWS[:: 1 if repeat % 2 else -1]:
                if rows == 1 and path == "chunk":
                    continue  # a step without drafts is decode-only either way
                drafter.n, current["step"] = rows - 1, 0.0
                start = clock()
                engine.step()
                current["step"] = clock() - start
                for key, value in current.items():
                    times[path, rows][key].append(value)
                current.clear()
    decode_batch.is_decode_only = rows_rule
    keys = ("step", "forward", "lm_head", "prepare", "sample")
    one_row = statistics.median(times["rows", 1]["step"])
    lines = ["| path | rows | " + " | ".join(f"{k} ms" for k in keys) + " | cost of a row |"]
    lines.append("|---" * (len(keys) + 3) + "|")
    for (path, rows), got in sorted(times.items()):
        medians = [statistics.median(got[k]) * 1e3 for k in keys]
        row = (medians[0] / (one_row * 1e3) - 1) / (rows - 1) if rows > 1 else 0.0
        cells = " | ".join(f"{m:.2f}" for m in medians)
        lines.append(f"| {path} | {rows} | {cells} | {row:.3f} |")
    return lines


def matmul_table(llm, args, clock) -> list[str]:
    from axon.kernels import ggml_q8
    from axon.kernels.ggml_cpu import GGMLWeights

    weights = []
    for module in llm.engine.runner.model.modules():
        for value in module.__dict__.values():
            if isinstance(value, GGMLWeights) and value.int8 and value not in weights:
                weights.append(value)
    head = max(weights, key=lambda w: w.rows)
    groups = {"layers": [w for w in weights if w is not head], "head": [head]}
    times = defaultdict(list)
    for repeat in range(args.repeats):
        for rows in MATMUL_ROWS[:: 1 if repeat % 2 else -1]:
            for name, group in groups.items():
                inputs = [(torch.randn(rows, w.cols), torch.empty(rows, w.rows)) for w in group]
                start = clock()
                for w, (x, out) in zip(group, inputs):
                    ggml_q8.matmul(w, x, out)
                times[name, rows].append(clock() - start)
    one = statistics.median(times["layers", 1]) + statistics.median(times["head", 1])
    lines = ["| rows | layers' matmuls ms | LM head ms | cost of a row |", "|---|---|---|---|"]
    for rows in MATMUL_ROWS:
        layers, lm = (statistics.median(times[name, rows]) for name in groups)
        row = ((layers + lm) / one - 1) / (rows - 1) if rows > 1 else 0.0
        lines.append(f"| {rows} | {layers * 1e3:.2f} | {lm * 1e3:.2f} | {row:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1000, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--activation-precision", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from axon import LLM
    from axon.demo import chat_demo_model_path

    clock = time.thread_time if args.threads == 1 else time.perf_counter
    llm = LLM(
        model=str(chat_demo_model_path()), max_model_len=args.context + 4096,
        adaptive_threads=False, activation_precision=args.activation_precision,
        speculative_config={"method": "ngram", "num_speculative_tokens": max(ROWS) - 1},
    )  # fmt: skip
    print(f"{args.context} tokens of context, {args.threads} thread(s), {clock.__name__}")
    print("\n".join(step_table(llm, args, clock)), flush=True)
    print("\n".join(matmul_table(llm, args, clock)))


if __name__ == "__main__":
    main()
