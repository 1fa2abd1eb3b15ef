r"""How far 8-bit activations move the next-token distribution: axon's int8 path and
llama.cpp, each against axon's exact (float32-activation) path, on the same GGUF, the same
token ids, every position of a few windows of real English prose.

Text: the prose paragraphs (indented code, grammar and tables dropped) of a few topics of the
Python Language Reference that ships with every CPython as `Lib/pydoc_data/topics.py`,
tokenized with the model's tokenizer; window i is BOS + the next --window-len text tokens, and
every one of its --window-len positions is scored (the distribution over the token after it).

Each engine computes the logits of every position of a window in one step (a batched prefill):
- exact: axon's float32 path (`LLM(model, activation_precision="float32")`): the engine's
  own scheduler, runner and model forward (the real `ModelRunner.prepare` / `forward_logits`),
  asked for every row's logits;
- int8: the same with `LLM(model, activation_precision="int8")` (K / V kept in float16, its
  default `kv_cache_dtype`), and int8-f32kv with a float32 KV cache;
- llama.cpp: llama-cpp-python's C API, one llama_decode per window with every logit kept
  (benchmarks/activation_quality_llamacpp.py, run by the --llamacpp-venv python); its defaults
  (F16 KV cache, flash attention), or with `llamacpp-f32kv` an F32 cache and no flash attention.
Logits travel as float32 .npy files (a window of the demo model is 512 x 262144 x 4 bytes).

Reported per pair (reference || other): top-1 agreement (argmax equal), KL divergence of the
next-token distribution in nats (mean, p99, max over positions), and each engine's perplexity
on the text.

    PYTHONPATH=src python benchmarks/activation_quality.py               # the demo model
    PYTHONPATH=src python benchmarks/activation_quality.py --json --windows 8
    PYTHONPATH=src python benchmarks/activation_quality.py \
        --engines exact,int8,llamacpp,llamacpp-f32kv                 # the table of the docs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
CACHE = Path.home() / ".cache" / "axon-bench"
# Prose-heavy chapters of the Language Reference, in the order text is taken from them
# ("naming" and "exceptions" are left out: they repeat sections of "execmodel").
TOPICS = ("execmodel", "import", "types", "truth")
PAIRS = (
    ("exact", "int8"),
    ("exact", "int8-f32kv"),
    ("exact", "llamacpp"),
    ("exact", "llamacpp-f32kv"),
    ("int8", "llamacpp"),
)
ROWS_PER_CHUNK = 64  # rows of a window compared at once (float64 [64, V])


# ---- text -----------------------------------------------------------------------------------


def prose_paragraphs(text: str) -> list[str]:
    """The paragraphs of a pydoc topic that are prose: code examples, grammar productions and
    tables are indented, headings are underlined; both are dropped."""
    kept = []
    for block in text.split("\n\n"):
        lines = [line for line in block.strip("\n").splitlines() if line.strip()]
        if not lines or lines[0].startswith((" ", "\t")):
            continue
        if len(lines) == 2 and set(lines[1]) <= set("=-*~^"):
            continue  # a heading
        if len(" ".join(lines).split()) < 8:
            continue  # a list item or a fragment, not a sentence
        kept.append(" ".join(line.strip() for line in lines))
    return kept


def text_windows(tokenizer, count: int, length: int) -> tuple[list[list[int]], list[str]]:
    """`count` windows of `length` + 1 tokens, BOS then text taken in order from TOPICS (the
    model reads the first `length`, every one of them scored against the token after it);
    returns them and the topics used. Raises ValueError when the topics are too short."""
    from pydoc_data.topics import topics

    head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    take = length + 1 - len(head)  # text tokens per window
    stream: list[int] = []
    used = []
    for name in TOPICS:
        if len(stream) >= count * take:
            break
        text = "\n\n".join(prose_paragraphs(topics[name]))
        stream.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
        used.append(name)
    if len(stream) < count * take:
        raise ValueError(f"only {len(stream)} prose tokens for {count} windows of {length}")
    return [head + stream[i * take : (i + 1) * take] for i in range(count)], used


# ---- axon -----------------------------------------------------------------------------------


def all_position_logits(llm, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), V] of every position of `tokens`, from axon's engine in one step:
    the scheduler schedules the prompt, the runner prepares its batch as for any prefill and
    runs its forward, with every row (not only the last) asked for logits."""
    from axon import SamplingParams

    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seq = core.add_request("activation-quality", tokens, params)[0]
    try:
        out = core.scheduler.schedule()
        if [(s.seq_id, n) for s, n in out.scheduled] != [(seq.seq_id, len(tokens))]:
            raise RuntimeError("the window is not one step: raise max_num_batched_tokens")
        batch = core.runner.prepare(out)
        batch.logits_indices = torch.arange(len(tokens), device=batch.input_ids.device)
        return core.runner.forward_logits(batch).float().cpu().numpy()  # [T, V]
    finally:
        core.abort(["activation-quality"])  # frees its blocks; the step is never sampled


def axon_logits(model: Path, windows: list[list[int]], out_dir: Path, name: str, **engine_args):
    """Writes `out_dir/<name>-<i>.npy` for each window's inputs; returns (paths, seconds of the
    forwards). Raises ValueError when the engine refuses `engine_args`."""
    from axon import LLM

    length = max(len(w) for w in windows) - 1
    llm = LLM(
        str(model),
        max_model_len=length + 16,
        max_num_batched_tokens=max(2048, length),
        kv_cache_memory=64 << 20,
        enable_prefix_caching=False,  # every window computed whole, in its one step
        **engine_args,
    )
    paths, seconds = [], 0.0
    try:
        for index, window in enumerate(windows):
            start = time.perf_counter()
            logits = all_position_logits(llm, window[:-1])
            seconds += time.perf_counter() - start
            paths.append(out_dir / f"{name}-{index}.npy")
            np.save(paths[-1], logits)
    finally:
        llm.engine.close()
        del llm
        gc.collect()
    return paths, seconds


# ---- llama.cpp ------------------------------------------------------------------------------


def llamacpp_logits(venv: Path, model: Path, windows, out_dir: Path, threads: int, name: str):
    """The same through llama.cpp (benchmarks/activation_quality_llamacpp.py in `venv`), with
    an F32 KV cache and no flash attention for `name` "llamacpp-f32kv"; returns (paths,
    seconds of the decodes)."""
    sys.path.insert(0, str(BENCH))
    from gguf_vs_llamacpp import ensure_llamacpp

    python = ensure_llamacpp(venv)
    job = {
        "model": str(model),
        "threads": threads,
        "windows": [w[:-1] for w in windows],
        "out_dir": str(out_dir),
        "name": name,
        "kv_f32": name == "llamacpp-f32kv",
    }
    result = subprocess.run(
        [str(python), str(BENCH / "activation_quality_llamacpp.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=True,
    )
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    return [Path(p) for p in reply["files"]], reply["seconds"]


# ---- comparison -----------------------------------------------------------------------------


def log_prob_chunks(path: Path):
    """Float64 log-softmax of a saved [T, V] logits file, ROWS_PER_CHUNK rows at a time."""
    logits = np.load(path, mmap_mode="r")
    for start in range(0, logits.shape[0], ROWS_PER_CHUNK):
        rows = torch.from_numpy(np.array(logits[start : start + ROWS_PER_CHUNK], np.float64))
        yield torch.log_softmax(rows, dim=-1)


def score(paths: dict[str, list[Path]], windows: list[list[int]]) -> tuple[list[dict], dict]:
    """One pass over every engine's logits (each file normalized once): for each pair of PAIRS
    present, top-1 agreement and KL(reference || other) in nats (mean, p99, max) over every
    position; and each engine's perplexity on the text (the window's next tokens)."""
    names = list(paths)
    pairs = [(ref, other) for ref, other in PAIRS if ref in paths and other in paths]
    kls: dict = {pair: [] for pair in pairs}
    agree: dict = {pair: [] for pair in pairs}
    nll: dict = {name: [] for name in names}
    for index, window in enumerate(windows):
        targets = torch.tensor(window[1:])
        chunks = zip(*(log_prob_chunks(paths[name][index]) for name in names))
        for start, rows in zip(range(0, len(targets), ROWS_PER_CHUNK), chunks):
            log_probs = dict(zip(names, rows))
            chunk_targets = targets[start : start + len(rows[0]), None]
            for name in names:
                nll[name].append(-log_probs[name].gather(1, chunk_targets).squeeze(1))
            for ref, other in pairs:
                p, q = log_probs[ref], log_probs[other]
                kls[ref, other].append((p.exp() * (p - q)).sum(-1))
                agree[ref, other].append(p.argmax(-1) == q.argmax(-1))
    return [pair_figures(pair, kls[pair], agree[pair]) for pair in pairs], {
        name: float(torch.cat(nll[name]).mean().exp()) for name in names
    }


def pair_figures(pair: tuple[str, str], kls: list, agree: list) -> dict:
    kl, top1 = torch.cat(kls), torch.cat(agree)
    return {
        "reference": pair[0],
        "other": pair[1],
        "positions": int(kl.numel()),
        "top1_agreement": float(top1.double().mean()),
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
    }


# ---- report ---------------------------------------------------------------------------------

LABELS = {
    "exact": "axon exact",
    "int8": "axon int8",
    "int8-f32kv": "axon int8 F32 KV",
    "llamacpp": "llama.cpp",
    "llamacpp-f32kv": "llama.cpp F32 KV",
}


def format_report(result: dict) -> str:
    """The side-by-side table (markdown) and the run's facts."""
    lines = [
        f"model: {result['model']}",
        f"text: {result['text']}; {result['windows']} windows x {result['window_len']} tokens "
        f"= {result['positions']} scored positions",
        "",
        "| vs reference | top-1 agreement | mean KL (nats) | p99 KL | max KL |",
        "|---|---:|---:|---:|---:|",
    ]
    for pair in result["pairs"]:
        lines.append(
            f"| {LABELS[pair['other']]} vs {LABELS[pair['reference']]} "
            f"| {100 * pair['top1_agreement']:.2f}% | {pair['kl_mean']:.5f} "
            f"| {pair['kl_p99']:.5f} | {pair['kl_max']:.4f} |"
        )
    lines.append("")
    lines.append(
        "perplexity on the text: "
        + ", ".join(f"{LABELS[k]} {v:.3f}" for k, v in result["perplexity"].items())
    )
    for name, reason in result["unavailable"].items():
        lines.append(f"{LABELS[name]}: not measured ({reason})")
    seconds = ", ".join(f"{LABELS[k]} {v:.1f} s" for k, v in result["forward_seconds"].items())
    lines.append(f"forward time (all windows): {seconds}; load average: {result['load']}")
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------


def run_engines(args, model: Path, windows, out_dir: Path) -> tuple[dict, dict, dict]:
    """(engine -> logits files, engine -> forward seconds, engine -> why it was not run)."""
    paths, seconds, unavailable = {}, {}, {}
    if "exact" in args.engines:
        paths["exact"], seconds["exact"] = axon_logits(
            model, windows, out_dir, "exact", activation_precision="float32"
        )
    int8_engines = {"int8": {}, "int8-f32kv": {"kv_cache_dtype": "float32"}}
    for name, extra in int8_engines.items():
        if name not in args.engines:
            continue
        try:
            paths[name], seconds[name] = axon_logits(
                model, windows, out_dir, name, activation_precision="int8", **extra
            )
        except ValueError as exc:  # an axon without the option refuses the argument
            unavailable[name] = str(exc).split("; known")[0]
    for name in ("llamacpp", "llamacpp-f32kv"):
        if name in args.engines:
            paths[name], seconds[name] = llamacpp_logits(
                args.llamacpp_venv, model, windows, out_dir, args.threads, name
            )
    return paths, seconds, unavailable


def measure(args, out_dir: Path) -> dict:
    from axon.engine.llm import load_tokenizer

    if args.model is not None:
        model = Path(args.model)
    else:
        from axon.demo import demo_model_path

        model = demo_model_path()
    windows, used = text_windows(load_tokenizer(str(model)), args.windows, args.window_len)
    paths, seconds, unavailable = run_engines(args, model, windows, out_dir)
    pairs, perplexities = score(paths, windows)
    return {
        "model": model.name,
        "text": f"Lib/pydoc_data/topics.py of Python {sys.version.split()[0]} "
        f"(prose of topics {', '.join(used)})",
        "windows": args.windows,
        "window_len": args.window_len,
        "positions": args.windows * args.window_len,
        "pairs": pairs,
        "perplexity": perplexities,
        "unavailable": unavailable,
        "forward_seconds": seconds,
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),  # 1, 5, 15 min (shared CPUs)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file (default: the demo gemma-3-270m Q4_K_M)")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window-len", type=int, default=512, help="scored positions each")
    parser.add_argument(
        "--engines",
        default="exact,int8,llamacpp",
        type=lambda s: s.split(","),
        help="of exact, int8 (its default float16 KV cache), int8-f32kv, llamacpp, "
        "llamacpp-f32kv (F32 KV cache, no flash attention)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's")
    parser.add_argument("--llamacpp-venv", type=Path, default=CACHE / "llamacpp-venv")
    parser.add_argument("--keep", type=Path, help="keep the logits .npy files in this folder")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        result = measure(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="axon-activation-quality-") as tmp:
            result = measure(args, Path(tmp))
    print(json.dumps(result, indent=2) if args.json else format_report(result))


if __name__ == "__main__":
    main()
