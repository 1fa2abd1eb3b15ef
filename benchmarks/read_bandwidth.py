"""The machine's memory read bandwidth, the ceiling for batch-1 decode (every weight byte is read
once per token): a plain vectorized read loop in C over a buffer far larger than the caches, at
1 .. N threads, next to torch's `sum` over the same bytes.

    python benchmarks/read_bandwidth.py [--mib 512] [--threads 1 2]

Needs a C compiler and an x86 CPU with AVX2. Prints GB/s (10^9 bytes per second), best of 5.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <omp.h>
#include <immintrin.h>
/* Sum every byte of buf as 8-bit lanes (the result is meaningless; reading is the point). */
int64_t read_all(const uint8_t *buf, size_t n, int threads) {
    int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const size_t id = omp_get_thread_num(), count = omp_get_num_threads();
        const size_t lo = n / count * id / 128 * 128, hi = n / count * (id + 1) / 128 * 128;
        __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
        for (size_t i = lo; i < hi; i += 128) {
            a = _mm256_add_epi8(a, _mm256_load_si256((const __m256i *)(buf + i)));
            b = _mm256_add_epi8(b, _mm256_load_si256((const __m256i *)(buf + i + 32)));
            c = _mm256_add_epi8(c, _mm256_load_si256((const __m256i *)(buf + i + 64)));
            d = _mm256_add_epi8(d, _mm256_load_si256((const __m256i *)(buf + i + 96)));
        }
        a = _mm256_add_epi8(_mm256_add_epi8(a, b), _mm256_add_epi8(c, d));
        total += _mm256_extract_epi8(a, 0);
    }
    return total;
}
"""


def build() -> ctypes.CDLL:
    with tempfile.TemporaryDirectory(prefix="axon-bw-") as tmp:
        workdir = Path(tmp)
        (workdir / "bw.c").write_text(SOURCE)
        compiler = os.environ.get("CC", "cc")
        flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
        subprocess.run([compiler, *flags, "bw.c", "-o", "bw.so"], cwd=workdir, check=True)
        lib = ctypes.CDLL(str(workdir / "bw.so"))  # stays loaded after the file is removed
    lib.read_all.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.read_all.restype = ctypes.c_int64
    return lib


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    args = parser.parse_args()
    lib = build()
    buf = torch.ones(args.mib << 20, dtype=torch.uint8)  # 64-byte aligned by torch's allocator
    floats = buf.view(torch.float32)
    print("| threads | C read loop GB/s | torch.sum GB/s |")
    print("| --- | --- | --- |")
    for threads in dict.fromkeys(args.threads):
        torch.set_num_threads(threads)
        c = best_seconds(lambda n=threads: lib.read_all(buf.data_ptr(), buf.numel(), n))
        t = best_seconds(lambda: floats.sum())
        print(f"| {threads} | {buf.numel() / c / 1e9:.1f} | {buf.numel() / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
