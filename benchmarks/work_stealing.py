"""One-token GEMVs while another process wakes on the machine: static shares vs stolen shares.

At concurrency 1 the HTTP process wakes once per token (receive, detokenize, frame, send: a few
hundred microseconds of CPU) while the engine's two OpenMP threads run the next forward. Where
it lands on a thread's core, that thread's static share of every GEMV waits for it, and the other
thread waits at the barrier. `kernels/work_shares.h` lets a thread done with its own share take
units from the back of the others'.

This benchmark compiles the C kernels twice, from a git revision (`--base`, before the change:
static shares) and from the working tree, and times `axon_q8_matmul_parts` (int8 activations)
and `axon_ggml_matmul_parts` (exact) for one token on an LM-head-sized Q6_K matrix and a layer's
Q4_K matrices, with 2 threads, alternating the two builds, first on the quiet machine and then
with an interferer: a child process that every `--period-ms` busy-loops for `--burst-ms`
(the HTTP process's per-token CPU). It prints the time per GEMV and the ratios.

    PYTHONPATH=src python benchmarks/work_stealing.py [--base 6d74c51] [--repeats 5]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from axon.kernels import abi

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "src/axon/kernels"
FILES = ("ggml_cpu.c", "ggml_q8.c", "cpu_ops.c", "cpu_layer.c", "cpu_moe.c", "layout.c")
FILES += ("axon_kernels.h", "work_shares.h", "k_scales.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
Q4_K, Q6_K = 12, 14
BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}


def build_kernels(revision: str | None, out: Path) -> ctypes.CDLL:
    """The kernels library from `revision`'s sources (None: the working tree)."""
    src = out / (revision or "tree")
    src.mkdir(parents=True)
    for name in FILES:
        if revision is None:
            data = (ROOT / KERNELS / name).read_bytes()
        else:
            shown = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{revision}:{KERNELS}/{name}"],
                capture_output=True,
            )
            if shown.returncode != 0:
                continue  # a header that did not exist yet
            data = shown.stdout
        (src / name).write_bytes(data)
    sources = [str(p) for p in sorted(src.glob("*.c"))]
    target = src / "kernels.so"
    subprocess.run(["cc", *FLAGS, *sources, "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    return abi.declare(lib, "axon_q8_matmul_parts", "axon_ggml_matmul_parts")


def random_blocks(ggml_type: int, rows: int, cols: int, rng) -> np.ndarray:
    """Random codes with a small fixed fp16 scale (and min) in every block."""
    blocks = cols // 256
    raw = rng.integers(0, 256, size=(rows, blocks, BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if ggml_type == Q4_K:
        raw[:, :, 0:2] = scale
        raw[:, :, 2:4] = scale
    else:
        raw[:, :, 208:210] = scale
    return raw.reshape(rows, -1)


class Gemv:
    """One call's arguments: parts of (type, weight) over the same columns."""

    def __init__(self, parts: list[tuple[int, np.ndarray]], cols: int):
        self.parts, self.cols = parts, cols
        n = len(parts)
        self.types = (ctypes.c_int * n)(*(t for t, _ in parts))
        self.ptrs = (ctypes.c_void_p * n)(*(w.ctypes.data for _, w in parts))
        self.rows = (ctypes.c_int64 * n)(*(w.shape[0] for _, w in parts))
        self.x = np.random.default_rng(1).standard_normal(cols).astype(np.float32)
        self.y = np.empty(sum(w.shape[0] for _, w in parts), dtype=np.float32)

    def run(self, lib, int8: bool, threads: int) -> None:
        fn = lib.axon_q8_matmul_parts if int8 else lib.axon_ggml_matmul_parts
        x, y = self.x.ctypes.data, self.y.ctypes.data
        status = fn(len(self.parts), self.types, self.ptrs, self.rows, self.cols, x, 1, y,
                    self.y.shape[0], threads)  # fmt: skip
        assert status == 0, status


def interfere(period_s: float, burst_s: float, stop) -> None:
    """Every period, busy for burst (as the HTTP process is per token), then sleep."""
    while not stop.is_set():
        end = time.perf_counter() + burst_s
        while time.perf_counter() < end:
            pass
        time.sleep(max(0.0, period_s - burst_s))


def time_one(gemv: Gemv, lib, int8: bool, threads: int, calls: int) -> float:
    """Median ms per call over `calls` back-to-back calls."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        gemv.run(lib, int8, threads)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3, sum(times) / len(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="6d74c51", help="revision with static shares")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--period-ms", type=float, default=8.0)
    parser.add_argument("--burst-ms", type=float, default=0.5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    shapes = {
        "LM head Q6_K 151936x1024": Gemv([(Q6_K, random_blocks(Q6_K, 151936, 1024, rng))], 1024),
        "q,k,v Q4_K 4096x1024": Gemv(
            [(Q4_K, random_blocks(Q4_K, n, 1024, rng)) for n in (2048, 1024, 1024)], 1024
        ),
    }
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"static (base)": build_kernels(args.base, Path(tmp))}
        libs["stolen (tree)"] = build_kernels(None, Path(tmp))
        load = os.getloadavg()
        print(f"load average {load[0]:.1f} {load[1]:.1f}; {args.threads} threads; "
              f"interferer: {args.burst_ms} ms busy every {args.period_ms} ms")  # fmt: skip
        rows = []
        for interfered in (False, True):
            stop = mp.Event()
            child = None
            if interfered:
                child = mp.Process(
                    target=interfere, args=(args.period_ms / 1e3, args.burst_ms / 1e3, stop)
                )
                child.start()
            try:
                for shape, gemv in shapes.items():
                    for int8 in (True, False):
                        best = {name: (float("inf"), float("inf")) for name in libs}
                        for _ in range(args.repeats):  # alternating builds
                            for name, lib in libs.items():
                                got = time_one(gemv, lib, int8, args.threads, args.calls)
                                best[name] = min(best[name], got)
                        rows.append((interfered, shape, int8, best))
            finally:
                stop.set()
                if child is not None:
                    child.join()
        print()
        print("| interferer | matrix | activations | static p50 / mean ms | stolen p50 / mean ms"
              " | stolen / static (mean) |")  # fmt: skip
        print("|---|---|---|---:|---:|---:|")
        for interfered, shape, int8, best in rows:
            (s50, smean), (t50, tmean) = best["static (base)"], best["stolen (tree)"]
            mode = "int8" if int8 else "exact"
            print(f"| {'yes' if interfered else 'no'} | {shape} | {mode} | {s50:.3f} / {smean:.3f} "
                  f"| {t50:.3f} / {tmean:.3f} | {tmean / smean:.2f}x |")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
