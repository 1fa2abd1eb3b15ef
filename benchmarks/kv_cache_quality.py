r"""How far an 8-bit KV cache (kv_cache_dtype="q8_0", llama.cpp's q8_0 layout) moves the
next-token distribution at long contexts: axon with a q8_0 (and a float16) cache against axon
with a float32 cache, on the same GGUF, the same token ids, the last --scored positions of
windows of 1k, 8k, 16k... tokens of real English prose.

Text: the prose paragraphs of the Python Language Reference's topics (activation_quality.py's
`prose_paragraphs`, every topic of Lib/pydoc_data/topics.py in name order: about 50k tokens),
tokenized with the model's tokenizer; a window of context N is BOS + the first N text tokens.
Each window is one step (a batched prefill through the real scheduler and runner, as
activation_quality.py's `all_position_logits`): every key is written to the cache, then read
back from it by the prefill attention (in place, quantized for q8_0), so the last positions see
N quantized keys and values. Activations are float32 (--activations int8 for the demo's own
path) in every engine, so the cache is the only difference.

Reported per context and engine (vs the float32 cache): top-1 agreement (argmax equal), KL
divergence in nats (mean, p99, max over the scored positions), the KV bytes a token, and each
engine's perplexity on the scored tokens.

    PYTHONPATH=src python benchmarks/kv_cache_quality.py                    # 1k, 8k, 16k
    PYTHONPATH=src python benchmarks/kv_cache_quality.py --contexts 1024 --scored 512 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activation_quality import pair_figures, prose_paragraphs  # noqa: E402

REFERENCE = "float32"
ROWS_PER_CHUNK = 64  # scored rows compared at once (float64 [64, V])


def prose_tokens(tokenizer, count: int) -> list[int]:
    """BOS + `count` tokens of prose from every pydoc topic in name order; raises ValueError
    when there is less."""
    from pydoc_data.topics import topics

    head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    stream: list[int] = []
    for name in sorted(topics):
        if len(stream) > count:
            break
        text = "\n\n".join(prose_paragraphs(topics[name]))
        if text:
            stream.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
    if len(stream) <= count:
        raise ValueError(f"only {len(stream)} prose tokens for a context of {count}")
    return head + stream[: count + 1 - len(head)]


def last_logits(llm, tokens: list[int], scored: int) -> np.ndarray:
    """Logits [scored, V] of the last `scored` positions of `tokens`, computed in one step."""
    from axon import SamplingParams

    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seq = core.add_request("kv-cache-quality", tokens, params)[0]
    try:
        out = core.scheduler.schedule()
        if [(s.seq_id, n) for s, n in out.scheduled] != [(seq.seq_id, len(tokens))]:
            raise RuntimeError("the window is not one step: raise max_num_batched_tokens")
        batch = core.runner.prepare(out)
        batch.logits_indices = torch.arange(len(tokens) - scored, len(tokens))
        return core.runner.forward_logits(batch).float().cpu().numpy()  # [scored, V]
    finally:
        core.abort(["kv-cache-quality"])


def engine_logits(model: Path, windows: dict, scored: int, kv_dtype: str, activations: str):
    """{context: logits [scored, V]} for every window with a `kv_dtype` cache; (that, forward
    seconds, KV bytes a token)."""
    from axon import LLM

    longest = max(windows)
    llm = LLM(
        str(model),
        max_model_len=longest + 16,
        max_num_batched_tokens=longest + 16,
        kv_cache_memory=(longest + 64) * 40 * 2**10,  # enough for gemma-3-270m in float32
        enable_prefix_caching=False,
        activation_precision=activations,
        kv_cache_dtype=kv_dtype,
    )
    logits, seconds = {}, 0.0
    try:
        for context, tokens in windows.items():
            start = time.perf_counter()
            logits[context] = last_logits(llm, tokens[:-1], scored)
            seconds += time.perf_counter() - start
        bytes_per_token = llm.engine.runner.plan.bytes_per_token
    finally:
        llm.engine.close()
        del llm
        gc.collect()
    return logits, seconds, bytes_per_token


def compare(reference: np.ndarray, other: np.ndarray, targets: list[int]) -> tuple[dict, float]:
    """pair_figures of (reference || other) over the rows, and other's perplexity on targets."""
    kls, agree, nll = [], [], []
    targets_t = torch.tensor(targets)
    for start in range(0, reference.shape[0], ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        p = torch.log_softmax(torch.from_numpy(reference[rows].astype(np.float64)), dim=-1)
        q = torch.log_softmax(torch.from_numpy(other[rows].astype(np.float64)), dim=-1)
        kls.append((p.exp() * (p - q)).sum(-1))
        agree.append(p.argmax(-1) == q.argmax(-1))
        nll.append(-q.gather(1, targets_t[rows, None]).squeeze(1))
    return pair_figures((REFERENCE, "other"), kls, agree), float(torch.cat(nll).mean().exp())


def measure(args) -> dict:
    from axon.engine.llm import load_tokenizer

    if args.model is not None:
        model = Path(args.model)
    else:
        from axon.demo import demo_model_path

        model = demo_model_path()
    stream = prose_tokens(load_tokenizer(str(model)), max(args.contexts))
    windows = {context: stream[: context + 1] for context in args.contexts}
    runs = {}
    for kv_dtype in (REFERENCE, *args.caches):
        runs[kv_dtype] = engine_logits(model, windows, args.scored, kv_dtype, args.activations)
    rows = []
    for context, tokens in windows.items():
        targets = tokens[-args.scored :]
        reference = runs[REFERENCE][0][context]
        for kv_dtype in args.caches:
            figures, perplexity = compare(reference, runs[kv_dtype][0][context], targets)
            _, ref_perplexity = compare(reference, reference, targets)
            rows.append(
                {
                    **figures,
                    "other": kv_dtype,
                    "context": context,
                    "perplexity": perplexity,
                    "reference_perplexity": ref_perplexity,
                    "bytes_per_token": runs[kv_dtype][2],
                }
            )
    return {
        "model": model.name,
        "activations": args.activations,
        "scored": args.scored,
        "rows": rows,
        "reference_bytes_per_token": runs[REFERENCE][2],
        "forward_seconds": {name: round(run[1], 1) for name, run in runs.items()},
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),  # 1, 5, 15 min (shared CPUs)
    }


def format_report(result: dict) -> str:
    lines = [
        f"model: {result['model']}; activations {result['activations']}; the last "
        f"{result['scored']} positions of each context scored; reference: a float32 cache "
        f"({result['reference_bytes_per_token']} B/token)",
        "",
        "| context | cache | B/token | top-1 agreement | mean KL (nats) | p99 KL | max KL "
        "| perplexity (f32 cache) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['context']} | {row['other']} | {row['bytes_per_token']} "
            f"| {100 * row['top1_agreement']:.2f}% | {row['kl_mean']:.6f} | {row['kl_p99']:.5f} "
            f"| {row['kl_max']:.4f} | {row['perplexity']:.3f} ({row['reference_perplexity']:.3f}) |"
        )
    lines.append("")
    lines.append(f"forward seconds: {result['forward_seconds']}; load average: {result['load']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file (default: the demo gemma-3-270m Q4_K_M)")
    parser.add_argument(
        "--contexts", default="1024,8192,16384", type=lambda s: [int(x) for x in s.split(",")]
    )
    parser.add_argument("--scored", type=int, default=256, help="last positions scored")
    parser.add_argument(
        "--caches", default="float16,q8_0", type=lambda s: s.split(","), help="vs float32"
    )
    parser.add_argument("--activations", default="float32", choices=("float32", "int8"))
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = measure(args)
    print(json.dumps(result, indent=2) if args.json else format_report(result))


if __name__ == "__main__":
    main()
