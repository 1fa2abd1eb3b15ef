"""Times the int8-activation GGUF matmul (kernels/ggml_q8.c) against the exact float path
(kernels/ggml_cpu.c: the batch kernel up to 64 tokens, the panel kernel past it), same run.

Run: PYTHONPATH=src python benchmarks/int8_matmul.py [--rows 3072] [--cols 1024] [--threads 2]
Prints `uptime` first: on a shared machine only the ratios of one run compare.

--cold: one token against `--copies` distinct copies of the weight taken in turn (80 copies of
3072 x 1024 are well past a 32 MiB L3), so every call streams its weight from memory as batch-1
decode does; prints the weight bytes read per second, exact and int8, at 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from axon.kernels import abi, ggml_cpu

T = GGMLQuantizationType
SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_K: (0, 2)}
SCALE_OFFSETS |= {T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2)}


def random_raw(qtype: T, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random codes with sane fp16 scales: [rows, row_bytes] uint8."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scale = np.float16(rng.uniform(1e-3, 1e-2, (raw.shape[0], 1))).view(np.uint8)
        raw[:, offset : offset + 2] = scale
    return torch.from_numpy(raw.reshape(rows, -1))


def per_call_us(fns, clock, budget_s: float = 0.6) -> list[float]:
    """Each fn's fastest batch time per call in microseconds, the fns taking turns batch by
    batch (a shared machine's load drifts: turns give each the same chances)."""
    for fn in fns:
        fn()
    runs, best = 1, [float("inf")] * len(fns)
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s:
        for i, fn in enumerate(fns):
            begin = clock()
            for _ in range(runs):
                fn()
            best[i] = min(best[i], (clock() - begin) / runs)
        if max(best) < 2e-3:
            runs *= 2
    return [b * 1e6 for b in best]


def kernels(weights: ggml_cpu.GGMLWeights, x: torch.Tensor, out: torch.Tensor, threads: int):
    """(exact, int8) callables for one C call each with `threads` threads."""
    args = (len(weights.parts), weights._types, weights._ptrs, weights._rows, weights.cols)
    tail = (x.data_ptr(), x.shape[0], out.data_ptr(), out.stride(0), threads)
    exact_lib = q8_lib = abi.library()
    exact = exact_lib.axon_ggml_matmul_parts
    if x.shape[0] > 64:
        exact = exact_lib.axon_ggml_matmul_panels
    return (lambda: exact(*args, *tail)), (lambda: q8_lib.axon_q8_matmul_parts(*args, *tail))


def cold_gb_s(copies: list[ggml_cpu.GGMLWeights], threads: int, rounds: int = 5):
    """(exact, int8) GB/s of weight bytes over passes through every copy, the two taking turns
    pass by pass (a pass over all the copies evicts the other's): the fastest pass of each."""
    x, out = torch.randn(1, copies[0].cols), torch.empty(1, copies[0].rows)
    calls = [kernels(weights, x, out, threads) for weights in copies]
    clock = time.thread_time if threads == 1 else time.perf_counter
    nbytes = sum(raw.numel() for weights in copies for _, raw in weights.parts)
    best = [float("inf")] * 2
    for _ in range(rounds):
        for i in range(2):
            begin = clock()
            for pair in calls:
                pair[i]()
            best[i] = min(best[i], clock() - begin)
    return [nbytes / seconds / 1e9 for seconds in best]


def cold(args: argparse.Namespace) -> None:
    """The --cold table: GB/s for exact and int8 per type and thread count."""
    print(f"W [{args.rows} x {args.cols}], 1 token, {args.copies} distinct copies")
    print("1 thread: thread CPU time; 2 threads: wall time")
    print(f"{'type':6} {'threads':>7} {'exact GB/s':>10} {'int8 GB/s':>10} {'int8/exact':>10}")
    for name in args.types:
        qtype = T[name]
        copies = [
            ggml_cpu.GGMLWeights(
                [(int(qtype), random_raw(qtype, args.rows, args.cols, s))], args.cols
            )
            for s in range(args.copies)
        ]
        for threads in (1, 2):
            exact, int8 = cold_gb_s(copies, threads)
            print(f"{name:6} {threads:7d} {exact:10.1f} {int8:10.1f} {int8 / exact:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=3072)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    parser.add_argument("--cold", action="store_true", help="one token, weights from memory")
    parser.add_argument("--copies", type=int, default=80)
    args = parser.parse_args()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if args.cold:
        cold(args)
        print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        return
    # One thread: the calling thread's CPU time, which a descheduled thread does not accrue.
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    kind = "thread CPU" if args.threads == 1 else "wall"
    print(f"W [{args.rows} x {args.cols}], {args.threads} thread(s); {kind} time per call")
    print(f"{'type':6} {'tokens':>6} {'exact us':>10} {'int8 us':>10} {'exact/int8':>10}")
    for name in args.types:
        qtype = T[name]
        weights = ggml_cpu.GGMLWeights(
            [(int(qtype), random_raw(qtype, args.rows, args.cols))], args.cols
        )
        for tokens in args.tokens:
            x = torch.randn(tokens, args.cols)
            out = torch.empty(tokens, args.rows)
            exact, int8 = kernels(weights, x, out, args.threads)
            exact_us, int8_us = per_call_us([exact, int8], clock)
            print(
                f"{name:6} {tokens:6d} {exact_us:10.1f} {int8_us:10.1f} {exact_us / int8_us:10.2f}"
            )
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
