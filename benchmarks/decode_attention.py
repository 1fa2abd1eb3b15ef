"""Times CPU paged decode attention (kernels/cpu_ops.c, axon_paged_decode_attention) against
the kernel it replaced (one (sequence, query head) pair at a time, compiled below from a copy of
its source with the library's flags), same run, same inputs, each at 1 and 2 threads.

Run: PYTHONPATH=src python benchmarks/decode_attention.py [--budget 0.6]
Prints `uptime` first: on a shared machine only the ratios of one run compare. The cache is
paged as the engine pages it (blocks of 16 slots, each sequence's blocks scattered); every
sequence has the full context. Also checks that the two kernels agree.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from axon.kernels import build, cpu_ops
from int8_matmul import per_call_us  # the sibling script (benchmarks/ is on sys.path)

OLD_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

static float dot(const float *a, const float *b, int64_t n) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += a[i + l] * b[i + l];
    float s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
              ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void old_paged_decode_attention(const float *q, int64_t ldq, const float *k_cache,
                                const float *v_cache,
                                const int64_t *slots, int64_t width, const int64_t *lens,
                                int64_t batch, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, float scale, float softcap, int64_t window,
                                float *out, float *scratch, int threads) {
    const int64_t group = heads / kv_heads, pairs = batch * heads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t pair = 0; pair < pairs; pair++) {
        float *scores = scratch + (int64_t)omp_get_thread_num() * width;
        const int64_t b = pair / heads, h = pair % heads, kv = h / group;
        const int64_t len = lens[b], start = window > 0 && len > window ? len - window : 0;
        const float *qh = q + b * ldq + h * head_dim;
        float *o = out + pair * head_dim;
        float top = -INFINITY;
        for (int64_t p = start; p < len; p++) {
            const float *kp = k_cache + (slots[b * width + p] * kv_heads + kv) * head_dim;
            float s = dot(qh, kp, head_dim) * scale;
            if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
            scores[p] = s;
            top = s > top ? s : top;
        }
        float total = 0.0f;
        for (int64_t p = start; p < len; p++) total += scores[p] = expf(scores[p] - top);
        const float norm = 1.0f / total;
        memset(o, 0, head_dim * sizeof(float));
        for (int64_t p = start; p < len; p++) {
            const float *vp = v_cache + (slots[b * width + p] * kv_heads + kv) * head_dim;
            const float weight = scores[p] * norm;
            for (int64_t i = 0; i < head_dim; i++) o[i] += weight * vp[i];
        }
    }
}
"""

# (name, batch, heads, kv_heads, head_dim, context)
SHAPES = [
    ("qwen3 16/8x128", 16, 16, 8, 128, 256),
    ("qwen3 16/8x128", 16, 16, 8, 128, 1024),
    ("qwen3 16/8x128", 1, 16, 8, 128, 256),
    ("qwen3 16/8x128", 1, 16, 8, 128, 1024),
    ("gemma3 4/1x256", 16, 4, 1, 256, 256),
    ("gemma3 4/1x256", 16, 4, 1, 256, 1024),
    ("gemma3 4/1x256", 1, 4, 1, 256, 256),
    ("gemma3 4/1x256", 1, 4, 1, 256, 1024),
]
BLOCK = 16


def old_kernel() -> ctypes.CDLL:
    """The replaced kernel, built with the library's flags into a temporary directory."""
    folder = Path(tempfile.mkdtemp())
    source, target = folder / "old.c", folder / "old.so"
    source.write_text(OLD_SOURCE)
    subprocess.run(["cc", *build.FLAGS, str(source), "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    lib.old_paged_decode_attention.argtypes = (
        cpu_ops._library().axon_paged_decode_attention.argtypes
    )
    return lib


def paged_case(batch: int, heads: int, kv_heads: int, head_dim: int, context: int):
    """q [B, H, D], caches [slots, Hkv, D], key slots [B, context] on scattered blocks, lens."""
    gen = torch.Generator().manual_seed(0)
    blocks = batch * context // BLOCK
    order = torch.randperm(blocks, generator=gen)
    key_slots = (order.view(batch, -1, 1) * BLOCK + torch.arange(BLOCK)).reshape(batch, context)
    k_cache = torch.randn(blocks * BLOCK, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(blocks * BLOCK, kv_heads, head_dim, generator=gen)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.long)
    return q, k_cache, v_cache, key_slots, lens


def caller(function, case, threads: int):
    """A no-argument call of `function` on `case` with `threads` threads; returns (call, out)."""
    q, k_cache, v_cache, key_slots, lens = case
    batch, heads, head_dim = q.shape
    width = key_slots.shape[1]
    scratch = torch.empty(threads * heads * width)
    out = torch.empty_like(q)
    args = (
        q.data_ptr(), heads * head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
        key_slots.data_ptr(), width, lens.data_ptr(), batch, heads, k_cache.shape[1],
        head_dim, head_dim**-0.5, 0.0, 0, out.data_ptr(), scratch.data_ptr(), threads,
    )  # fmt: skip

    def call():
        function(*args)
        return scratch  # the call keeps its scratch alive

    return call, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.6, help="seconds per shape")
    args = parser.parse_args()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    old, new = old_kernel().old_paged_decode_attention, cpu_ops._library()
    new = new.axon_paged_decode_attention
    print(f"{'shape':16} {'batch':>5} {'ctx':>5} {'thr':>3} {'old us':>9} {'new us':>9} "
          f"{'old/new':>7}  max|diff|")  # fmt: skip
    for name, batch, heads, kv_heads, head_dim, context in SHAPES:
        case = paged_case(batch, heads, kv_heads, head_dim, context)
        for threads in (1, 2):
            old_call, old_out = caller(old, case, threads)
            new_call, new_out = caller(new, case, threads)
            old_us, new_us = per_call_us([old_call, new_call], time.perf_counter, args.budget)
            diff = float((old_out - new_out).abs().max())
            print(f"{name:16} {batch:5} {context:5} {threads:3} {old_us:9.1f} {new_us:9.1f} "
                  f"{old_us / new_us:7.2f}  {diff:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
