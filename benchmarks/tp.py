"""Tensor parallelism on CPU: the all-reduce (gloo's TCP loop vs the shared-memory one) and
batch-1 decode of a Qwen3-shaped random model at TP=1 and TP=2 with each, in one run.

1. All-reduce latency: two rank processes joined as an engine joins them; for [T, hidden] fp32
   tensors (T = 1 .. 512) each rank times the same calls through gloo (`dist.all_reduce`) and
   through the shared-memory segment; rank 0's median per call is printed.
2. Decode: one prompt, greedy, `ignore_eos`; the decode-only rate (new - 1) / (t(new) - t(1))
   subtracts the prefill and first token. TP=1, then TP=2 with AXON_TP_ALLREDUCE=gloo, then
   TP=2 with shm (the default), each the best of `--repeats`.

    PYTHONPATH=src python benchmarks/tp.py                 # small model (hidden 512, 6 layers)
    PYTHONPATH=src python benchmarks/tp.py --shape core    # the offline-throughput model

Nothing is downloaded: the model is random (seed 0), written by transformers to
~/.cache/axon-bench/ and reused. Two ranks on a 2-core machine shared with other processes are
tensor parallelism's worst case (the ranks compete with each other and with everything else for
the two cores): read the ratios, and the all-reduce latencies, not the absolute rates.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "small": dict(
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "core": dict(
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}
TOKENS = (1, 8, 64, 512)
CACHE = Path.home() / ".cache" / "axon-bench"


def ensure_model(shape: str) -> Path:
    """Write the random Qwen3 checkpoint with transformers once; reuse it afterwards."""
    model_dir = CACHE / f"qwen3-tp-{shape}"
    if (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors")):
        return model_dir
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPES[shape], dtype="float32")).eval()
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    del model
    gc.collect()
    return model_dir


# ---- all-reduce latency ---------------------------------------------------------------------


def _latency_rank(rank: int, store_path: str, hidden: int, calls: int, results) -> None:
    import torch.distributed as dist

    from axon.distributed import parallel_state as ps

    torch.set_num_threads(1)
    largest = max(TOKENS) * hidden * 4
    ps.init_tp_group(store_path, rank, 2, torch.device("cpu"), 120.0, largest)
    timings = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden)
        for name, reduce in (("gloo", dist.all_reduce), ("shm", ps.tp_all_reduce)):
            reduce(x)  # warm-up
            samples = []
            for _ in range(calls):
                start = time.perf_counter()
                reduce(x)
                samples.append(time.perf_counter() - start)
            timings[(name, tokens)] = statistics.median(samples)
            timings[(name, tokens, "min")] = min(samples)
    results.put(pickle.dumps((rank, ps.tp_allreduce_path(), timings)))
    results.close()
    results.join_thread()
    os._exit(0)


def measure_latency(hidden: int, calls: int) -> dict:
    """Median seconds per all-reduce, {(backend, tokens): s}, as rank 0 saw them."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="axon-tp-bench-") as tmp:
        args = (os.path.join(tmp, "store"), hidden, calls, results)
        procs = [ctx.Process(target=_latency_rank, args=(r, *args)) for r in (0, 1)]
        for proc in procs:
            proc.start()
        got = dict(pickle.loads(results.get(timeout=600))[0::2] for _ in procs)
        for proc in procs:
            proc.join(30)
    return got[0]


# ---- decode ---------------------------------------------------------------------------------


def decode_rate(model_dir: Path, tp: int, backend: str, args) -> tuple[float, float]:
    """(batch-1 decode tok/s, `args.streams`-stream decode tok/s), best of `args.repeats`, the
    prefill and first token subtracted."""
    from axon import LLM, SamplingParams

    os.environ["AXON_TP_ALLREDUCE"] = backend
    torch.set_num_threads(args.threads if tp == 1 else args.tp_threads)
    llm = LLM(
        str(model_dir), dtype="float32", tensor_parallel_size=tp, max_model_len=1024,
        max_num_seqs=max(args.streams, 1),
    )  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(args.prompt_len)] for _ in range(args.streams)]

    def run(batch: list[list[int]], max_tokens: int) -> float:
        llm.engine.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in batch], params)
        return time.perf_counter() - start

    def rate(batch: list[list[int]]) -> float:
        best = 0.0
        for _ in range(args.repeats):
            t_one, t_full = run(batch, 1), run(batch, args.new_tokens)
            best = max(best, len(batch) * (args.new_tokens - 1) / max(t_full - t_one, 1e-9))
        return best

    try:
        run(prompts[:1], 4)  # warm-up
        return rate(prompts[:1]), rate(prompts)
    finally:
        if tp > 1:
            llm.engine.close()
        gc.collect()


# ---- report ---------------------------------------------------------------------------------


def print_latency(latency: dict, hidden: int) -> None:
    print(f"\n### All-reduce latency, [T, {hidden}] fp32, 2 ranks (median and fastest call)\n")
    print("| T | bytes | gloo (us) | shm (us) | gloo / shm | fastest: gloo | fastest: shm |")
    print("|---|---|---|---|---|---|---|")
    for tokens in TOKENS:
        gloo, shm = latency[("gloo", tokens)], latency[("shm", tokens)]
        size = tokens * hidden * 4
        fast_gloo, fast_shm = latency[("gloo", tokens, "min")], latency[("shm", tokens, "min")]
        print(
            f"| {tokens} | {size:,} | {gloo * 1e6:,.0f} | {shm * 1e6:,.0f} | {gloo / shm:.1f}x "
            f"| {fast_gloo * 1e6:,.0f} | {fast_shm * 1e6:,.0f} |"
        )


def print_decode(rates: dict, latency: dict, layers: int, streams: int) -> None:
    # Per decode step: 2 reduces per layer + the vocab-parallel embedding's, and the LM head's
    # gather (about the same size at batch 1).
    calls = 2 * layers + 2
    print("\n### Decode (tok/s, best of the repeats)\n")
    print(f"| run | batch 1 | vs TP=1 | {streams} streams | vs TP=1 | all-reduce per step (est.) |")
    print("|---|---|---|---|---|---|")
    (one, many) = rates["tp1"]
    for key, label in (("tp1", "TP=1"), ("gloo", "TP=2, gloo"), ("shm", "TP=2, shm")):
        per_step = "-" if key == "tp1" else f"{calls * latency[(key, 1)] * 1e3:.2f} ms"
        single, multi = rates[key]
        print(
            f"| {label} | {single:.1f} | {single / one:.2f}x | {multi:.1f} | {multi / many:.2f}x "
            f"| {per_step} |"
        )
    print(f"\nTP=2 shm / TP=2 gloo, batch 1: {rates['shm'][0] / rates['gloo'][0]:.2f}x")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--calls", type=int, default=300, help="all-reduces per size")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16, help="concurrent decode streams")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="TP=1")
    parser.add_argument("--tp-threads", type=int, default=max(1, torch.get_num_threads() // 2))
    parser.add_argument("--skip-decode", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    print(
        f"# benchmarks/tp.py --shape {args.shape}: {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, python {sys.version.split()[0]}"
    )
    print(
        "Two ranks on a 2-core machine shared with other processes are the worst case for "
        "tensor parallelism: the ranks compete with each other and the other processes."
    )
    latency = measure_latency(shape["hidden_size"], args.calls)
    print_latency(latency, shape["hidden_size"])
    if args.skip_decode:
        return 0
    model_dir = ensure_model(args.shape)
    rates = {"tp1": decode_rate(model_dir, 1, "shm", args)}
    rates["gloo"] = decode_rate(model_dir, 2, "gloo", args)
    rates["shm"] = decode_rate(model_dir, 2, "shm", args)
    print(f"\nthreads: TP=1 {args.threads}, each TP=2 rank {args.tp_threads}")
    print_decode(rates, latency, shape["num_hidden_layers"], args.streams)
    return 0


if __name__ == "__main__":
    sys.exit(main())
