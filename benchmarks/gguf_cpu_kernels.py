"""Times the candidate CPU matmul paths for GGUF weights (4096 x 4096, 2 threads).

Run: PYTHONPATH=src python benchmarks/gguf_cpu_kernels.py   (results in the GGUF notes)
Weights rotate over several matrices so reads come mostly from DRAM, as in decode.
"""

# ruff: noqa: B023  (each lambda is timed inside the iteration that defines it)

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from axon.kernels.ggml_dequant import dequantize_rows_ref
from axon.kernels.ggml_int4 import int4_matmul, repack_int4

T = GGMLQuantizationType
N = K = 4096
MATS = 8


def bench(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn(0)
    start = time.perf_counter()
    for i in range(reps):
        fn(i % MATS)
    return (time.perf_counter() - start) / reps * 1e3


def k_quant_raw(ggml_type: int, seed: int) -> torch.Tensor:
    """Random valid blocks (codes random, fp16 super-block scales sane)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    raw = rng.integers(0, 256, (N * K // block, size), dtype=np.uint8)
    scale = np.float16(rng.uniform(1e-3, 1e-2, (raw.shape[0], 1))).view(np.uint8)
    offset = {T.Q6_K: 208, T.Q4_K: 0, T.Q5_K: 0}[T(ggml_type)]
    raw[:, offset : offset + 2] = scale
    if offset == 0:
        raw[:, 2:4] = scale
    return torch.from_numpy(raw.reshape(N, -1))


def main() -> None:
    torch.set_num_threads(2)
    dense = torch.randn(N, K) * 0.02
    q8 = [torch.from_numpy(quants.quantize(dense.numpy() + i, T.Q8_0)) for i in range(MATS)]
    q4k = [k_quant_raw(T.Q4_K, i) for i in range(MATS)]
    q6k = [k_quant_raw(T.Q6_K, i) for i in range(MATS)]
    bf16 = [dense.bfloat16() + i for i in range(MATS)]
    fp32 = [dense + i for i in range(MATS)]
    int4 = [repack_int4(raw, T.Q4_K, N) for raw in q4k]
    q6k_int4 = [repack_int4(raw, T.Q6_K, N) for raw in q6k]
    q5k_int4 = [repack_int4(k_quant_raw(T.Q5_K, i), T.Q5_K, N) for i in range(MATS)]
    q8_int4 = [repack_int4(raw, T.Q8_0, N) for raw in q8]
    int8 = [torch.randint(-127, 127, (N, K), dtype=torch.int8) for _ in range(MATS)]
    int8_scale = torch.rand(N, dtype=torch.bfloat16)
    for batch in (1, 16, 256):
        x = torch.randn(batch, K)
        xb = x.bfloat16()
        rows = {
            "fp32 dense F.linear": lambda i: F.linear(x, fp32[i]),
            "bf16 dense F.linear (bf16 act)": lambda i: F.linear(xb, bf16[i]),
            "Q4_K -> int4 kernel": lambda i: int4_matmul(x, int4[i]),
            "Q8_0 -> int4 hi/lo split (2K)": lambda i: int4_matmul(x, q8_int4[i]),
            "Q5_K -> int4 hi/lo split (2K)": lambda i: int4_matmul(x, q5k_int4[i]),
            "Q6_K -> int4 hi/lo split (2K)": lambda i: int4_matmul(x, q6k_int4[i]),
            "Q8_0 -> int8 per-channel (lossy)": lambda i: torch.ops.aten._weight_int8pack_mm(
                xb, int8[i], int8_scale
            ),
            "Q6_K dequant on the fly + fp32": lambda i: F.linear(
                x, dequantize_rows_ref(q6k[i], T.Q6_K, K)
            ),
            "Q4_K dequant on the fly + fp32": lambda i: F.linear(
                x, dequantize_rows_ref(q4k[i], T.Q4_K, K)
            ),
            "Q4_K dequant on the fly + bf16": lambda i: F.linear(
                xb, dequantize_rows_ref(q4k[i], T.Q4_K, K).bfloat16()
            ),
        }
        for name, fn in rows.items():
            print(
                f"B={batch:4d}  {name:34s} {bench(fn, 10 if batch < 64 else 4):8.2f} ms", flush=True
            )


if __name__ == "__main__":
    main()
