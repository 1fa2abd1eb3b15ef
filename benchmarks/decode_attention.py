"""Times CPU paged decode attention (kernels/cpu_ops.c, axon_paged_decode_attention) against
the kernel it replaced (one (sequence, query head) pair at a time: the kernels built from git
revision `--base`, as benchmarks/work_stealing.py builds them), same run, same inputs, each at
1 and 2 threads.

Run: PYTHONPATH=src python benchmarks/decode_attention.py [--budget 0.6] [--base 57e9e60]
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

from axon.kernels import abi
from int8_matmul import per_call_us  # sibling scripts (benchmarks/ is on sys.path)
from work_stealing import build_kernels

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


def old_kernel(revision: str) -> ctypes.CDLL:
    """The kernels library at `revision` (its attention: the replaced kernel)."""
    lib = build_kernels(revision, Path(tempfile.mkdtemp()))
    lib.axon_paged_decode_attention.argtypes = (  # the new one's, less its kv_f16 flag
        abi.SIGNATURES["axon_paged_decode_attention"][1][:-1]
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


def caller(function, case, threads: int, *extra):
    """A no-argument call of `function` on `case` with `threads` threads (then `extra`, the new
    kernel's kv_f16 flag); returns (call, out)."""
    q, k_cache, v_cache, key_slots, lens = case
    batch, heads, head_dim = q.shape
    width = key_slots.shape[1]
    scratch = torch.empty(threads * heads * width)
    out = torch.empty_like(q)
    args = (
        q.data_ptr(), heads * head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
        key_slots.data_ptr(), width, lens.data_ptr(), batch, heads, k_cache.shape[1],
        head_dim, head_dim**-0.5, 0.0, 0, out.data_ptr(), scratch.data_ptr(), threads, *extra,
    )  # fmt: skip

    def call():
        function(*args)
        return scratch  # the call keeps its scratch alive

    return call, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.6, help="seconds per shape")
    parser.add_argument("--base", default="57e9e60", help="revision with the replaced kernel")
    args = parser.parse_args()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    old, new = old_kernel(args.base).axon_paged_decode_attention, abi.library()
    new = new.axon_paged_decode_attention
    print(f"{'shape':16} {'batch':>5} {'ctx':>5} {'thr':>3} {'old us':>9} {'new us':>9} "
          f"{'old/new':>7}  max|diff|")  # fmt: skip
    for name, batch, heads, kv_heads, head_dim, context in SHAPES:
        case = paged_case(batch, heads, kv_heads, head_dim, context)
        for threads in (1, 2):
            old_call, old_out = caller(old, case, threads)
            new_call, new_out = caller(new, case, threads, 0)  # a float32 cache
            old_us, new_us = per_call_us([old_call, new_call], time.perf_counter, args.budget)
            diff = float((old_out - new_out).abs().max())
            print(f"{name:16} {batch:5} {context:5} {threads:3} {old_us:9.1f} {new_us:9.1f} "
                  f"{old_us / new_us:7.2f}  {diff:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
