"""The prefix cache's disk tier: what serving an N-token prefix from disk costs next to prefilling
it, on the demo GGUF model (gemma-3-270m Q4_K_M) or any model path.

For each prompt length N (random token ids, a one-token answer) it times, best of `--runs`:

- `prefill`: a cold engine (no disk tier) computing the prompt;
- `from disk`: a second engine on a directory a first engine filled (a restart), answering the
  same prompt: the N - 1 tokens' full blocks are read from disk before the step, one token is
  computed;
- `load`: the disk tier's own share of that (`PrefixTiers.prefetch`: the file reads, the checks and
  the copy into the KV cache), and per block;
- `save`: what the first engine's step loop spent handing the prompt's blocks to the writer
  thread (`PrefixTiers.save`: copying them out of the cache; the writing is the thread's).

The files are in the page cache (just written), as on a machine whose RAM holds the directory;
a first read from a cold SSD adds its read time. Each engine is built anew per run, so nothing
comes from the in-memory prefix cache; each has run one tiny prompt first, so neither number
holds an engine's first-step costs.

    .venv/bin/python benchmarks/prefix_disk_cache.py --lengths 512 2048 --runs 3
    .venv/bin/python benchmarks/prefix_disk_cache.py --model path/to/model --dtype float32
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from axon import LLM, SamplingParams
from axon.demo import demo_model_path
from axon.engine import prefix_tiers

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def timed(name: str) -> list[float]:
    """Wrap PrefixTiers's method `name` so each call's seconds are recorded in the returned list."""
    seconds: list[float] = []
    original = getattr(prefix_tiers.PrefixTiers, name)

    def wrapper(self, *args):
        start = time.perf_counter()
        original(self, *args)
        seconds.append(time.perf_counter() - start)

    setattr(prefix_tiers.PrefixTiers, name, wrapper)
    return seconds


def warmed(model: str, **engine_args) -> LLM:
    """An engine that has run a step already (its first step's one-off costs paid)."""
    llm = LLM(model, **engine_args)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], ONE_TOKEN)
    return llm


def generate(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], ONE_TOKEN)
    return time.perf_counter() - start


def measure(model: str, length: int, runs: int, engine_args: dict) -> dict:
    vocab = LLM(model, **engine_args).engine.runner.vocab_size
    prompt = [random.Random(length).randrange(10, vocab - 10) for _ in range(length)]
    prefill = min(generate(warmed(model, **engine_args), prompt) for _ in range(runs))
    prefetch_seconds, save_seconds = timed("prefetch"), timed("save")
    restored, loads, blocks = [], [], 0
    with tempfile.TemporaryDirectory() as directory:
        writer = warmed(model, prefix_cache_dir=directory, **engine_args)
        save_seconds.clear()
        generate(writer, prompt)
        save = sum(save_seconds)
        writer.engine.close()
        for _ in range(runs):
            reader = warmed(model, prefix_cache_dir=directory, **engine_args)
            prefetch_seconds.clear()
            restored.append(generate(reader, prompt))
            loads.append(sum(prefetch_seconds))
            block_size = reader.engine.block_manager.block_size
            blocks = reader.get_stats()["prefix_disk_hits"] // block_size
            reader.engine.close()
    return {
        "tokens": length,
        "prefill_ms": prefill * 1e3,
        "from_disk_ms": min(restored) * 1e3,
        "load_ms": min(loads) * 1e3,
        "blocks": blocks,
        "load_us_per_block": min(loads) / max(1, blocks) * 1e6,
        "save_ms": save * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the demo GGUF")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    model = args.model or str(demo_model_path())
    engine_args = {"dtype": args.dtype, "max_model_len": max(args.lengths) + 16}
    print(f"model {model}")
    print("tokens  prefill ms  from disk ms  load ms  blocks  load us/block  speedup  save ms")
    for length in args.lengths:
        row = measure(model, length, args.runs, engine_args)
        speedup = row["prefill_ms"] / row["from_disk_ms"]
        print(
            f"{row['tokens']:6d}  {row['prefill_ms']:10.1f}  {row['from_disk_ms']:12.1f}  "
            f"{row['load_ms']:7.1f}  {row['blocks']:6d}  {row['load_us_per_block']:13.0f}  "
            f"{speedup:6.1f}x  {row['save_ms']:7.1f}"
        )


if __name__ == "__main__":
    main()
