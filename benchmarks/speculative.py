"""Speculative decoding, served: axon without and with `--speculative-config` against llama.cpp's
`llama-server` plain and with its speculative modes, on the same GGUF file, for three workloads
(benchmarks/speculative_prompts.py: `edit`, whose answer repeats most of the prompt, `summary`,
`free` generation; `mixed`, edit and free prompts by turns, on request) at 1, 4 and 16
concurrent streams.

Every server runs on its own (one at a time: the others are stopped), with 16 slots of
--ctx-per-slot tokens and --threads threads, as benchmarks/serve_vs_llama_server.py starts them.
Requests are streamed chat completions (a file without a chat template: completions of the
base-model framing), greedy, to EOS or --max-tokens, each with its own prompt, sent by
`axon bench serve`'s client (axon.bench.client). Per level: decode tok/s per stream (1000 /
TPOT p50, the batch-1 figure at 1 stream), output tok/s of all streams (prefill included), and
the drafted tokens' acceptance (axon's usage details, llama-server's `timings`). Ratios: against
axon without speculation (decode at 1 stream, output tok/s at 4 and 16), and an axon
speculative row against the best llama-server speculative row of the same level.

Variants (rows), each skipped with the reason when it cannot run:
- `axon`; `axon ngram` (`{"method": "ngram", "num_speculative_tokens": K, ...}`, --ngram-*);
  `axon draft` with --draft-model (`"method": "draft_model"`);
- `llama-server`; `llama-server <type>` for each --llama-spec-type (its n-gram modes, defaults
  as it ships them); `llama-server draft-simple` (-md DRAFT) with --draft-model, when the draft's
  vocabulary is the model's.

    PYTHONPATH=src python benchmarks/speculative.py --quick          # smoke: c1, few tokens
    PYTHONPATH=src python benchmarks/speculative.py --json spec.json # the full table
    PYTHONPATH=src python benchmarks/speculative.py --draft-quant Q2_K  # + draft-model rows
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from llama_server import CACHE, build_llama_server, wait_ready  # noqa: E402
from serve_vs_llama_server import axon_command, best_of, free_port  # noqa: E402
from speculative_prompts import WORKLOADS, workload_prompts  # noqa: E402
from speculative_report import format_table, summarize_targets  # noqa: E402

LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-mod", "ngram-cache")


@dataclass(frozen=True)
class Variant:
    name: str
    engine: str  # "axon" or "llama-server"
    flags: tuple[str, ...] = ()
    speculative: bool = False


def axon_variants(args: argparse.Namespace, draft: Path | None) -> list[Variant]:
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.ngram_min,
        "prompt_lookup_max": args.ngram_max,
    }
    rows = [Variant("axon", "axon")]
    rows.append(Variant("axon ngram", "axon", spec_flag(ngram), True))
    if draft is not None:
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k}
        rows.append(Variant("axon draft", "axon", spec_flag(config), True))
    return rows


def spec_flag(config: dict) -> tuple[str, ...]:
    return ("--speculative-config", json.dumps(config))


def llama_variants(
    args: argparse.Namespace, model: Path, draft: Path | None
) -> tuple[list[Variant], list[str]]:
    """(llama-server's rows, notes on rows left out)."""
    rows, notes = [Variant("llama-server", "llama-server")], []
    for spec_type in args.llama_spec_types:
        rows.append(
            Variant(f"llama-server {spec_type}", "llama-server", ("--spec-type", spec_type), True)
        )
    if draft is not None:
        why = vocabulary_mismatch(model, draft)
        if why:
            notes.append(f"llama-server draft-simple left out: {why}")
        else:
            flags = ("--spec-type", "draft-simple", "-md", str(draft))
            flags += ("--spec-draft-n-max", str(args.k))
            rows.append(Variant("llama-server draft-simple", "llama-server", flags, True))
    return rows, notes


def vocabulary_mismatch(model: Path, draft: Path) -> str | None:
    """Why `draft` cannot draft for `model` (another vocabulary), or None."""
    import gguf

    def tokens(path: Path) -> list:
        return list(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents())

    ours, theirs = tokens(model), tokens(draft)
    if ours != theirs:
        return (
            f"{draft.name}'s vocabulary ({len(theirs)} tokens) is not {model.name}'s ({len(ours)})"
        )
    return None


def has_chat_template(model: Path) -> bool:
    import gguf

    return "tokenizer.chat_template" in gguf.GGUFReader(str(model)).fields


# ---- servers --------------------------------------------------------------------------------


def start(variant: Variant, model: Path, binary: Path, args: argparse.Namespace):
    """(ServerProcess, base url) of `variant`, ready; raises when it does not come up."""
    from serve import ServerProcess, wait_until_listed

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.axon_src), env.get("PYTHONPATH")]))
    log = args.log_dir / f"{model.stem}-{variant.name.replace(' ', '-')}.log"
    if variant.engine == "axon":
        command = axon_command(model, port, args) + list(variant.flags)
    else:
        from llama_server import server_command

        command = server_command(binary, model, port, args.ctx_per_slot, args.slots, args.threads)
        command += list(variant.flags)
    began = time.perf_counter()
    process = ServerProcess(command, env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        if variant.engine == "axon":
            wait_until_listed(url, "axon", {}, args.start_timeout, process)
        else:
            wait_ready(url + "/health", process.process, args.start_timeout)
    except BaseException:
        process.stop(grace_s=5)
        raise
    print(f"  {variant.name} ready in {time.perf_counter() - began:.1f} s", flush=True)
    return process, url


def measure(
    url: str, name: str, prompts: list[str], max_tokens: int, chat: bool, level: int
) -> dict:
    """One level: `axon bench serve`'s metrics of `prompts` sent `level` at a time."""
    from axon.bench.client import BenchPrompt, RequestConfig, run_level
    from axon.bench.metrics import level_metrics

    endpoint = "chat" if chat else "completions"
    config = RequestConfig(url, endpoint, name, temperature=0.0, ignore_eos=False)
    requests = [BenchPrompt(prompt, 0, max_tokens) for prompt in prompts]
    duration, results = asyncio.run(run_level(config, {}, requests, level, keep_alive=False))
    metrics = level_metrics(results, duration)
    if metrics["failed"]:
        errors = sorted({r.error for r in results if not r.success})[:3]
        raise RuntimeError(f"{name} at c{level}: {metrics['failed']} failed: {errors}")
    return metrics


def run_variant(variant: Variant, model: Path, binary: Path, args, seed: int) -> dict:
    """{workload: {level: metrics}} of one variant (its server up for this call only)."""
    chat = has_chat_template(model)
    served = "axon" if variant.engine == "axon" else "llama-server"
    process, url = start(variant, model, binary, args)
    results: dict = {}
    try:
        warm = workload_prompts("free", args.slots, chat, seed=-1)
        measure(url, served, warm, 8, chat, args.slots)  # unmeasured: every batch size once
        for workload in args.workloads:
            results[workload] = {}
            for level in args.concurrency:
                count = max(args.min_requests, args.rounds * level)
                prompts = workload_prompts(workload, count, chat, seed=seed * 1000 + level)
                metrics = measure(url, served, prompts, args.max_tokens, chat, level)
                results[workload][level] = metrics
                print(progress_line(variant.name, workload, level, metrics), flush=True)
    finally:
        process.stop(grace_s=20)
    return results


def progress_line(name: str, workload: str, level: int, m: dict) -> str:
    tpot = m.get("median_tpot_ms")
    per_stream = f"{1000 / tpot:6.1f}" if tpot else "     -"
    drafted = m.get("total_draft_tokens") or 0
    accepted = f"{m['total_accepted_tokens'] / drafted:5.1%}" if drafted else "    -"
    return (
        f"  {name:28} {workload:8} c{level:<2} {per_stream} tok/s/stream "
        f"{m['output_throughput']:7.1f} tok/s  accepted {accepted}  load {os.getloadavg()[0]:.2f}"
    )


def compare(model: Path, binary: Path, args: argparse.Namespace) -> dict:
    """Every variant on `model`, best of --repeats: {"best": {variant: {workload: {level:
    metrics}}}, "runs": every run's, "notes": rows left out and why}."""
    draft = args.draft_model
    if args.draft_quant:
        from llama_server import requantize

        draft = requantize(model, args.draft_quant)
    llama_rows, notes = llama_variants(args, model, draft)
    variants = [
        v for v in axon_variants(args, draft) + llama_rows if v.name in args.only or not args.only
    ]
    runs: dict = {v.name: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in variants:
            try:
                runs[variant.name].append(run_variant(variant, model, binary, args, repeat))
            except (RuntimeError, TimeoutError) as exc:
                notes.append(f"{variant.name}: did not run ({str(exc).splitlines()[0][:200]})")
                print(f"  {notes[-1]}", flush=True)
    best = {}
    for name, results in runs.items():
        if results:
            best[name] = {
                w: {lv: best_spec(results, w, lv) for lv in results[0][w]} for w in results[0]
            }
    speculative = {v.name for v in variants if v.speculative}
    return {
        "model": str(model),
        "best": best,
        "runs": runs,
        "notes": notes,
        "speculative": sorted(speculative),
    }


def best_spec(results: list[dict], workload: str, level: int) -> dict:
    """The best-of metrics of a level, with the acceptance of the run of highest throughput."""
    levels = [r[workload][level] for r in results]
    chosen = max(levels, key=lambda m: m["output_throughput"])
    keys = ("total_draft_tokens", "total_accepted_tokens")
    return {**best_of(levels), **{key: chosen.get(key, 0) for key in keys}}


def cpu_name() -> str:
    from serve import cpu_name as name

    return name()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", action="append", type=Path, help="GGUF file(s) (default: the chat demo)"
    )
    parser.add_argument("--draft-model", type=Path, help="a GGUF draft (axon draft, draft-simple)")
    parser.add_argument(
        "--draft-quant",
        metavar="TYPE",
        help="draft with the model requantized to TYPE (e.g. Q2_K) by llama-quantize",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke: 1 stream, 24 tokens, one repeat"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--ctx-per-slot", type=int, default=1536)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream per level")
    parser.add_argument("--min-requests", type=int, default=4, help="per level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=["edit", "summary", "free"]
    )
    parser.add_argument(
        "--k", type=int, default=4, help="num_speculative_tokens (axon, draft-simple)"
    )
    parser.add_argument("--ngram-min", type=int, default=2, help="axon's prompt_lookup_min")
    parser.add_argument("--ngram-max", type=int, default=4, help="axon's prompt_lookup_max")
    parser.add_argument("--llama-spec-types", nargs="*", default=list(LLAMA_SPEC_TYPES))
    parser.add_argument("--only", nargs="+", default=[], help="run only these variants (by name)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--axon-log-level", default="info")
    parser.add_argument(
        "--activation-precision", choices=("auto", "float32", "int8"), default="auto"
    )
    parser.add_argument(
        "--axon-src",
        type=Path,
        default=BENCH.parent / "src",
        help="the axon source tree the axon servers run (default: this checkout's)",
    )
    parser.add_argument("--log-dir", type=Path, default=CACHE / "speculative-logs")
    parser.add_argument("--json", type=Path, help="write every run's figures here too")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.concurrency, args.max_tokens = 1, [1], 24
        args.rounds, args.min_requests = 1, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    binary = build_llama_server()
    if args.model is None:
        from axon.demo import chat_demo_model_path

        args.model = [chat_demo_model_path()]
    cpu = f"{cpu_name()}, {args.threads} threads"
    results = []
    for model in args.model:
        print(f"{model.name} ({cpu}):", flush=True)
        results.append(compare(model, binary, args))
        print(format_table(results[-1], args.concurrency, cpu), flush=True)
        print(summarize_targets(results[-1]), flush=True)
    if args.json:
        settings = vars(args) | {"log_dir": str(args.log_dir), "json": str(args.json)}
        payload = {"cpu": cpu, "args": settings, "results": results}
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
