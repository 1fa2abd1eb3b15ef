"""Decode speed of a q8_0 KV cache against float16 (and float32), in process, same run:

- kernel: CPU paged decode attention (kernels/cpu_ops.c) alone, reading a paged cache of each
  type (blocks of 16 slots scattered as the engine pages them), at Qwen3-0.6B's and gemma-3's
  head shapes, contexts of 1k-16k, batch 1 and 4, 1 and 2 threads; the median of interleaved
  repeats (cache types alternate, so a busy neighbour slows them alike); and prefill attention
  of a 1k and a 4k chunk (the causal triangle) the same way;
- engine: decode tokens/s of a GGUF (the demo gemma-3-270m unless --model) after a prompt of
  ~1k and ~4k tokens, one stream: the prompt is prefilled once (a prefix-cache entry), then
  runs again for 2 and for --tokens + 2 new tokens: the difference is --tokens decode steps;
  the two caches' engines alternate, the median of --repeats.

    PYTHONPATH=src python benchmarks/kv_cache_speed.py [--skip-engine] [--skip-kernel]

Prints the load average: on a shared machine only the ratios within one run compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from axon.kernels import cpu_ops
from axon.layers import kv_quant

BLOCK = 16
# (name, heads, kv_heads, head_dim)
HEADS = [("qwen3-0.6b 16/8x128", 16, 8, 128), ("gemma3 4/1x256", 4, 1, 256)]
CACHES = ("float32", "float16", "q8_0")


def paged_case(batch: int, heads: int, kv_heads: int, head_dim: int, context: int, seed=0):
    """q, float32 K / V caches, key slots (each sequence's blocks scattered), context lengths."""
    gen = torch.Generator().manual_seed(seed)
    blocks = batch * context // BLOCK
    k = torch.randn(blocks * BLOCK, kv_heads, head_dim, generator=gen)
    v = torch.randn(blocks * BLOCK, kv_heads, head_dim, generator=gen)
    order = torch.randperm(blocks, generator=gen).view(batch, -1)  # [B, blocks a sequence]
    slots = (order[:, :, None] * BLOCK + torch.arange(BLOCK)).view(batch, -1)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    return q, k, v, slots.contiguous(), torch.full((batch,), context)


def as_cache(cache: torch.Tensor, name: str) -> torch.Tensor:
    if name == "q8_0":
        return kv_quant.quantize_q8(cache)
    return cache.to(getattr(torch, name))


def time_kernel(shape, batch: int, context: int, threads: int, repeats: int) -> dict:
    """Median microseconds a call for each cache type, calls of the types interleaved."""
    _, heads, kv_heads, head_dim = shape
    q, k, v, slots, lens = paged_case(batch, heads, kv_heads, head_dim, context)
    caches = {name: (as_cache(k, name), as_cache(v, name)) for name in CACHES}
    times: dict[str, list[float]] = {name: [] for name in CACHES}
    torch.set_num_threads(threads)
    scale = head_dim**-0.5
    calls = max(1, int(2e7 // (batch * context * kv_heads * head_dim)))
    for _ in range(repeats):
        for name, (kc, vc) in caches.items():
            start = time.perf_counter()
            for _ in range(calls):
                cpu_ops.paged_decode_attention(q, kc, vc, slots, lens, scale, None, None)
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def kernel_table(repeats: int) -> list[str]:
    lines = [
        "| heads | batch | context | threads | float32 us | float16 us | q8_0 us "
        "| q8_0 vs float16 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in HEADS:
        for batch in (1, 4):
            for context in (1024, 4096, 16384):
                for threads in (1, 2):
                    t = time_kernel(shape, batch, context, threads, repeats)
                    lines.append(
                        f"| {shape[0]} | {batch} | {context} | {threads} | {t['float32']:.0f} "
                        f"| {t['float16']:.0f} | {t['q8_0']:.0f} "
                        f"| {t['float16'] / t['q8_0']:.2f}x |"
                    )
    return lines


def time_prefill(shape, context: int, threads: int, repeats: int) -> dict:
    """Median milliseconds of one prefill chunk of `context` tokens (the causal triangle) over
    a cache of each type, calls interleaved."""
    _, heads, kv_heads, head_dim = shape
    q, k, v, slots, _ = paged_case(1, heads, kv_heads, head_dim, context)
    q = torch.randn(context, heads, head_dim)
    chunks = torch.tensor([[0, context, context, 0]])
    caches = {name: (as_cache(k, name), as_cache(v, name)) for name in CACHES}
    times: dict[str, list[float]] = {name: [] for name in CACHES}
    torch.set_num_threads(threads)
    out = torch.empty_like(q)
    for _ in range(repeats):
        for name, (kc, vc) in caches.items():
            start = time.perf_counter()
            cpu_ops.paged_prefill_attention(
                q, kc, vc, chunks, slots.view(-1), head_dim**-0.5, None, None, out
            )
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def prefill_table(repeats: int) -> list[str]:
    lines = [
        "| heads | prefill tokens | threads | float32 ms | float16 ms | q8_0 ms "
        "| q8_0 vs float16 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in HEADS:
        for context in (1024, 4096):
            t = time_prefill(shape, context, 2, repeats)
            lines.append(
                f"| {shape[0]} | {context} | 2 | {t['float32']:.1f} | {t['float16']:.1f} "
                f"| {t['q8_0']:.1f} | {t['float16'] / t['q8_0']:.2f}x |"
            )
    return lines


def decode_seconds(llm, prompt: dict, tokens: int) -> float:
    """Seconds of `tokens` decode steps after `prompt` (a prefix-cache hit): a run for
    tokens + 2 new tokens less one for 2."""
    from axon import SamplingParams

    seconds = []
    for count in (2, tokens + 2):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=count, ignore_eos=True))
        seconds.append(time.perf_counter() - start)
    return seconds[1] - seconds[0]


def engine_rates(model: str, context: int, tokens: int, repeats: int) -> dict[str, float]:
    """Decode tokens/s after a `context`-token prompt with each cache type: both engines
    loaded, their timed runs alternating, the median of `repeats`."""
    from axon import LLM, SamplingParams

    prompt = {"prompt_token_ids": [2] + [(i * 7919) % 20000 + 300 for i in range(context)]}
    engines = {}
    for name in CACHES[1:]:
        engines[name] = LLM(
            model,
            max_model_len=context + tokens + 64,
            kv_cache_memory=(context + tokens + 256) * 40 * 2**10,
            kv_cache_dtype=name,
        )
        engines[name].generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for _ in range(repeats):
            for name, llm in engines.items():
                times[name].append(decode_seconds(llm, prompt, tokens))
    finally:
        for llm in engines.values():
            llm.engine.close()
    return {name: tokens / statistics.median(values) for name, values in times.items()}


def engine_table(model: str, tokens: int, repeats: int) -> list[str]:
    lines = ["| context | float16 tok/s | q8_0 tok/s | q8_0 vs float16 |", "|---:|---:|---:|---:|"]
    for context in (1024, 4096):
        rates = engine_rates(model, context, tokens, repeats)
        lines.append(
            f"| {context} | {rates['float16']:.1f} | {rates['q8_0']:.1f} "
            f"| {rates['q8_0'] / rates['float16']:.2f}x |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file (default: the demo gemma-3-270m Q4_K_M)")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    if not args.skip_kernel:
        print("\n".join(kernel_table(args.repeats)))
        print("\n".join(prefill_table(args.repeats)))
    if not args.skip_engine:
        if args.model is None:
            from axon.demo import demo_model_path

            args.model = str(demo_model_path())
        print("\n".join(engine_table(args.model, args.tokens, args.repeats)))
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
