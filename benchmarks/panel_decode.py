"""The 16-token int8 matmul (a c16 decode step's LM head and layers) before and after a change
to `kernels/ggml_q8.c`, same run.

At concurrency 16 a decode step multiplies 16 tokens' int8 activations with every weight; the
weight rows are decoded into 8-row panels of codes and multipliers (`decode_panel`) that the
tiles then reuse for all 16 tokens. This benchmark compiles the C kernels twice, from a git
revision (`--base`) and from the working tree (`work_stealing.build_kernels`), and times
`axon_q8_matmul_parts` at 16 tokens (and at 1, the one-token GEMVs) on the two LM heads of
`serve_vs_llama_server.py` (the demo's tied 262144 x 640 Q8_0 embedding, the Qwen3 files'
151936 x 1024 Q6_K head; too large for L2, read again every call) and on a Q4_K layer matrix
(3072 x 1024), the two builds taking turns, best of `--repeats`. 1 thread: CPU time; 2
threads: wall time. Each row also checks that both builds give the same bits.

Where the tree has `axon_q8_pack` (the int8 engine repacks Q4_K and Q6_K at load into the
tiles' 16-row units, read without decoding), its Q4_K / Q6_K rows multiply the packed weight,
as the engine does; `--no-pack` times the GGUF blocks instead.

    PYTHONPATH=src python benchmarks/panel_decode.py [--base 47af5f8] [--repeats 5] [--no-pack]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from axon.kernels import abi

sys.path.insert(0, str(Path(__file__).resolve().parent))
from work_stealing import build_kernels  # noqa: E402

Q8_0, Q4_K, Q6_K = 8, 12, 14
PACKED = {Q4_K: (112, 2432), Q6_K: (114, 3392)}  # ggml_q8.c's packed type, bytes a 16-row block
BLOCK = {Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}  # values, bytes
SCALES = {Q8_0: (0,), Q4_K: (0, 2), Q6_K: (208,)}  # fp16 offsets in a block


def random_weight(ggml_type: int, rows: int, cols: int, rng) -> np.ndarray:
    """Random codes with small fp16 scales (and mins): [rows, row_bytes] uint8."""
    values, size = BLOCK[ggml_type]
    raw = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    for offset in SCALES[ggml_type]:
        scale = rng.uniform(1e-3, 1e-2, size=(rows, cols // values, 1)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


def packed(lib, ggml_type: int, w: np.ndarray, cols: int) -> tuple[int, np.ndarray]:
    """w as the int8 engine keeps it (`ggml_q8.pack`): (packed type, bytes)."""
    packed_type, block_bytes = PACKED[ggml_type]
    shape = ((w.shape[0] + 15) // 16, cols // 256 * block_bytes)
    room = np.empty(shape[0] * shape[1] + 64, np.uint8)  # the kernel wants 64-byte alignment
    out = room[-room.ctypes.data % 64 :][: shape[0] * shape[1]].reshape(shape)
    abi.declare(lib, "axon_q8_pack")
    assert lib.axon_q8_pack(ggml_type, w.ctypes.data, w.shape[0], cols, out.ctypes.data) == 0
    return packed_type, out


def per_call_ms(lib, ggml_type: int, w: np.ndarray, rows: int, x: np.ndarray, y: np.ndarray,
                threads: int, calls: int) -> float:  # fmt: skip
    """Median ms of `calls` calls: CPU time at 1 thread, wall time otherwise."""
    types, ptrs = (ctypes.c_int * 1)(ggml_type), (ctypes.c_void_p * 1)(w.ctypes.data)
    rows = (ctypes.c_int64 * 1)(rows)
    clock = time.thread_time if threads == 1 else time.perf_counter
    times = []
    for _ in range(calls):
        begin = clock()
        status = lib.axon_q8_matmul_parts(
            1, types, ptrs, rows, x.shape[1], x.ctypes.data, x.shape[0], y.ctypes.data, y.shape[1],
            threads,
        )  # fmt: skip
        times.append(clock() - begin)
        assert status == 0, status
    return sorted(times)[calls // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="47af5f8", help="the revision to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 4, 1])
    parser.add_argument("--no-pack", action="store_true", help="the tree reads GGUF blocks too")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    shapes = [
        ("demo LM head Q8_0 262144x640", Q8_0, 262144, 640, 5),
        ("Qwen3 LM head Q6_K 151936x1024", Q6_K, 151936, 1024, 5),
        ("layer Q4_K 3072x1024", Q4_K, 3072, 1024, 60),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_kernels(args.base, Path(tmp)), "tree": build_kernels(None, Path(tmp))}
        pack = not args.no_pack and hasattr(libs["tree"], "axon_q8_pack")
        load = os.getloadavg()
        print(f"load average {load[0]:.1f} {load[1]:.1f}; base {args.base}; tree packs Q4_K / "
              f"Q6_K: {'yes' if pack else 'no'}")  # fmt: skip
        print()
        print("| matrix | tokens | threads | base ms | tree ms | base / tree | tree GMAC/s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, ggml_type, rows, cols, calls in shapes:
            w = random_weight(ggml_type, rows, cols, rng)  # once per shape, for every token count
            weights = dict.fromkeys(libs, (ggml_type, w))
            if pack and ggml_type in PACKED:
                weights["tree"] = packed(libs["tree"], ggml_type, w, cols)
            for tokens, threads in itertools.product(args.tokens, (1, 2)):
                x = np.random.default_rng(tokens).standard_normal((tokens, cols), np.float32)
                outputs = {lib: np.empty((tokens, rows), np.float32) for lib in libs}
                best = dict.fromkeys(libs, float("inf"))
                for _ in range(args.repeats):  # the builds take turns
                    for lib_name, lib in libs.items():
                        kind, data = weights[lib_name]
                        y = outputs[lib_name]
                        got = per_call_ms(lib, kind, data, rows, x, y, threads, calls)
                        best[lib_name] = min(best[lib_name], got)
                base, tree = (outputs[which].view(np.uint32) for which in ("base", "tree"))
                same = np.array_equal(base, tree)
                gmac = rows * cols * tokens / best["tree"] / 1e6
                print(f"| {name} | {tokens} | {threads} | {best['base']:.3f} | {best['tree']:.3f} "
                      f"| {best['base'] / best['tree']:.2f}x | {gmac:.0f} |"
                      + ("" if same else " (outputs differ!)"))  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
