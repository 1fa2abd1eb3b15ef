"""`axon serve` against the real `llama-server`, and ik_llama.cpp's server, on the same GGUF file:
what a user of the HTTP server feels (TTFT, ITL, TPOT, E2E, throughput) under 1, 4 and 16
concurrent clients.

Both servers run on the same file with 16 parallel slots of --ctx-per-slot tokens each and
--threads threads: llama-server `-c 16*ctx -np 16 -t T -tb T` (its `-c` is split evenly across
the slots), axon `--max-num-seqs 16 --max-model-len ctx` with a KV budget big enough that
axon's cap of max_num_seqs x max_model_len tokens (16 x ctx) is what binds, i.e. the same
number of KV tokens, and OMP_NUM_THREADS=T. llama-server is built from the sources vendored in
the llama-cpp-python sdist on first use (benchmarks/llama_server.py; 10+ minutes on 2 cores).
ik_llama.cpp's server (--peers; benchmarks/ik_llama.py, built from the ik-llama-cpp-python sdist)
runs the same way with `-rtr` (run-time repack) and `-no-fa` (its flash-attention kernel
asserted at 16 slots).

Both are driven by `axon bench serve`'s client and metrics (axon.bench.client, .metrics):
streamed /v1/completions with token-id prompts, `ignore_eos`, temperature 0, so every request
has exactly --input-len prompt and --output-len output tokens. Every request has its own random
prompt (fresh per level and per repeat, the same for both engines), so neither prefix cache
helps. Both servers stay up for the whole run; each level runs on one engine then the other,
the order swapped every repeat, and each figure is the best of --repeats (lowest latency,
highest throughput).

    PYTHONPATH=src python benchmarks/serve_vs_llama_server.py --quick   # demo model, 1 repeat
    PYTHONPATH=src python benchmarks/serve_vs_llama_server.py           # demo + Qwen3 Q8_0/Q4_K_M

Targets (issue 16): output tok/s at c16 >= 2.0x llama-server; at c1 TTFT p50 <= 1.0x and ITL
p50 <= 0.9x llama-server's; at c16 axon's TTFT p99 <= 2x its own TTFT p50 at c1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from llama_server import CACHE, wait_ready  # noqa: E402
from peers import PEERS, build_peers  # noqa: E402

METRICS = (  # (result key, label, higher is better)
    ("output_throughput", "output tok/s", True),
    ("request_throughput", "req/s", True),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_itl_ms", "ITL p50 ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("median_e2el_ms", "E2E p50 ms", False),
)
PEER_NAMES = tuple(PEERS)
# random.Random(-n) draws what Random(n) does: the warm-up's seed stays clear of the levels'.
WARMUP_SEED = 999_999


# ---- pure logic -----------------------------------------------------------------------------


def best_of(runs: list[dict]) -> dict:
    """Per metric, the best of the repeats' results: the highest throughput, the lowest
    latency (a metric missing from a run is skipped)."""
    best = {}
    for key, _, higher in METRICS:
        values = [run[key] for run in runs if run.get(key) is not None]
        if values:
            best[key] = max(values) if higher else min(values)
    return best


def evaluate_targets(results: dict) -> list[tuple[str, float, float, bool]]:
    """(target, measured, bound, met) per target of issue 16; `results[engine][concurrency]` is
    that engine's best-of metrics at that level (levels 1 and 16 needed)."""
    axon, peer = results["axon"], results["llama-server"]
    checks = [
        ("c16 output tok/s >= 2.0x llama-server", "output_throughput", 16, 2.0, True),
        ("c1 TTFT p50 <= 1.0x llama-server", "median_ttft_ms", 1, 1.0, False),
        ("c1 ITL p50 <= 0.9x llama-server", "median_itl_ms", 1, 0.9, False),
    ]
    rows = []
    for name, key, level, bound, higher in checks:
        ratio = axon[level][key] / peer[level][key]
        rows.append((name, ratio, bound, ratio >= bound if higher else ratio <= bound))
    own = axon[16]["p99_ttft_ms"] / axon[1]["median_ttft_ms"]
    rows.append(("c16 TTFT p99 <= 2x axon's c1 TTFT p50", own, 2.0, own <= 2.0))
    return rows


def random_token_prompts(
    count: int, input_len: int, vocab: tuple[int, int], seed: int
) -> list[list[int]]:
    """`count` distinct prompts of `input_len` token ids drawn from [vocab[0], vocab[1])."""
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(input_len)] for _ in range(count)]


def table_row(cells: list) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def format_table(name: str, results: dict, levels: list[int]) -> str:
    """A markdown table: one row per (metric, concurrency), axon, each peer, axon / each peer."""
    peers = [engine for engine in results if engine != "axon"]
    head = ["metric", "c", "axon", *peers, *(f"axon / {p}" for p in peers)]
    lines = [f"#### {name}", "", table_row(head), "|" + "---|" * len(head)]
    for key, label, _ in METRICS:
        for level in levels:
            a = results["axon"][level].get(key)
            values = [results[p][level].get(key) for p in peers]
            ratios = [f"{a / b:.2f}x" if a and b else "-" for b in values]
            cells = [f"{v or 0:.1f}" for v in (a, *values)]
            lines.append(table_row([label, level, *cells, *ratios]))
    if 1 in levels and 16 in levels and "llama-server" in results:
        lines += ["", "| target | measured | bound | |", "|---|---|---|---|"]
        for target, value, bound, met in evaluate_targets(results):
            lines.append(f"| {target} | {value:.2f}x | {bound:g}x | {'pass' if met else 'MISS'} |")
    return "\n".join(lines)


# ---- servers --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def axon_command(model: Path, port: int, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "axon", "serve", str(model), "--port", str(port)]
    command += ["--served-model-name", "axon", "--max-num-seqs", str(args.slots)]
    command += ["--max-model-len", str(args.ctx_per_slot), "--kv-cache-memory", "8G"]
    command += ["--activation-precision", args.activation_precision]
    return command + ["--log-level", args.axon_log_level]


def server_env(threads: int) -> dict:
    """The servers' environment: `threads` OpenMP threads, this checkout's axon first."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(BENCH.parent / "src"), env.get("PYTHONPATH")])
    )
    return env


def launch(
    commands: dict, ports: dict, env: dict, logs: dict[str, Path], start_timeout: float
) -> dict:
    """{engine: (ServerProcess, base url)} for each command, in order, each ready before the
    next starts (prints their start-up seconds); on a failure the ones started are stopped."""
    from serve import ServerProcess, wait_until_listed

    servers = {}
    try:
        for engine, command in commands.items():
            start = time.perf_counter()
            process = ServerProcess(command, env, logs[engine])
            url = f"http://127.0.0.1:{ports[engine]}"
            servers[engine] = (process, url)
            if engine == "axon":
                wait_until_listed(url, "axon", {}, start_timeout, process)
            else:
                wait_ready(url + "/health", process.process, start_timeout)
            print(f"  {engine} ready in {time.perf_counter() - start:.1f} s", flush=True)
    except BaseException:
        for process, _ in servers.values():
            process.stop(grace_s=20)
        raise
    return servers


def start_servers(
    model: Path, binaries: dict[str, Path], args: argparse.Namespace, log_dir: Path
) -> dict:
    """{engine: (ServerProcess, base url)} for axon and each peer in `binaries`, all ready."""
    ports = {engine: free_port() for engine in ("axon", *binaries)}
    commands = {"axon": axon_command(model, ports["axon"], args)}
    for peer, binary in binaries.items():
        shape = (args.ctx_per_slot, args.slots, args.threads)
        commands[peer] = PEERS[peer].command(binary, model, ports[peer], *shape)
    logs = {engine: log_dir / f"{model.stem}-{engine}.log" for engine in commands}
    return launch(commands, ports, server_env(args.threads), logs, args.start_timeout)


# ---- the run --------------------------------------------------------------------------------


def make_prompt_source(url: str, model: Path):
    """A function (count, input_len, seed) -> token-id prompts: random common words tokenized by
    axon's /tokenize when the file has a real vocabulary, else random ids (the Qwen3-shaped
    files' placeholder vocabulary turns words into <unk>)."""
    import httpx

    from axon.bench.prompts import ServerTokenizer, random_prompts

    client = httpx.Client(base_url=url, timeout=60)
    tokenizer = ServerTokenizer.probe(client, "axon")
    if tokenizer is not None and 0 not in (tokenizer.encode("the of and to in") or [0]):

        def from_words(count: int, input_len: int, seed: int) -> list[list[int]]:
            prompts = random_prompts(tokenizer, count, input_len, 1, seed=seed, send_token_ids=True)
            return [prompt.prompt for prompt in prompts]

        return from_words
    import gguf

    vocab = len(gguf.GGUFReader(str(model)).fields["tokenizer.ggml.tokens"].data)
    return lambda count, input_len, seed: random_token_prompts(count, input_len, (3, vocab), seed)


def measure(url: str, name: str, prompts: list[list[int]], output_len: int, level: int) -> dict:
    """One level on one server: `axon bench serve`'s metrics; raises if a request failed or
    came back short."""
    from axon.bench.client import BenchPrompt, RequestConfig, run_level
    from axon.bench.metrics import level_metrics

    config = RequestConfig(url, "completions", name, temperature=0.0, ignore_eos=True)
    requests = [BenchPrompt(ids, len(ids), output_len) for ids in prompts]
    # a connection per request, on both engines (see run_level's keep_alive)
    duration, results = asyncio.run(run_level(config, {}, requests, level, keep_alive=False))
    metrics = level_metrics(results, duration)
    if metrics["failed"] or metrics["total_output_tokens"] != len(prompts) * output_len:
        errors = sorted({r.error for r in results if not r.success})[:3]
        raise RuntimeError(f"{name} at c{level}: {metrics['total_output_tokens']} tokens, {errors}")
    return metrics


def requests_at(level: int, rounds: int = 2, minimum: int = 6) -> int:
    """Requests sent at concurrency `level`: `rounds` per slot in use, at least `minimum`."""
    return max(minimum, rounds * level)


def compare_file(model: Path, binaries: dict[str, Path], args: argparse.Namespace) -> dict:
    """Every server on `model`; {engine: {level: best-of metrics}} plus every run's figures."""
    print(f"{model.name} (axon --activation-precision {args.activation_precision}):", flush=True)
    servers = start_servers(model, binaries, args, args.log_dir)
    engines = tuple(servers)
    try:
        source = make_prompt_source(servers["axon"][1], model)
        for engine, (_, url) in servers.items():  # unmeasured: first requests, every batch size
            measure(url, engine, source(args.slots, 16, WARMUP_SEED), 8, args.slots)
        runs = {engine: {level: [] for level in args.concurrency} for engine in engines}
        for repeat in range(args.repeats):
            order = engines if repeat % 2 == 0 else engines[::-1]
            for level in args.concurrency:
                count = requests_at(level, args.rounds, args.min_requests)
                prompts = source(count, args.input_len, 1000 * repeat + level)
                for engine in order:
                    metrics = measure(servers[engine][1], engine, prompts, args.output_len, level)
                    runs[engine][level].append(metrics)
                    print(
                        f"  r{repeat} c{level:<2} {engine:12} {metrics['output_throughput']:7.1f}"
                        f" tok/s  TTFT p50 {metrics['median_ttft_ms']:7.1f} ms  ITL p50 "
                        f"{metrics['median_itl_ms']:6.1f} ms   load {os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
    finally:
        for process, _ in servers.values():
            process.stop(grace_s=20)
    best = {
        engine: {level: best_of(runs[engine][level]) for level in runs[engine]} for engine in runs
    }
    return {"model": str(model), "best": best, "runs": runs}


def model_files(args: argparse.Namespace) -> list[Path]:
    """The GGUF files: --model, else the demo model, plus (without --quick) the Qwen3-shaped
    Q8_0 and Q4_K_M of benchmarks/gguf_vs_llamacpp.py (made there once, reused)."""
    if args.model:
        return [Path(m) for m in args.model]
    from axon.demo import demo_model_path

    if args.quick:
        return [demo_model_path()]
    from gguf_vs_llamacpp import ensure_llamacpp, quantize
    from qwen3_gguf import write_qwen3_f16

    f16 = write_qwen3_f16(CACHE / "qwen3-1024x8-f16.gguf")
    llama_python = ensure_llamacpp(CACHE / "llamacpp-venv")
    qwen3 = [
        quantize(llama_python, f16, CACHE / f"qwen3-1024x8-{t}.gguf", t) for t in ("Q8_0", "Q4_K_M")
    ]
    return [demo_model_path(), *qwen3]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="GGUF file(s) (default: see above)")
    parser.add_argument("--quick", action="store_true", help="the demo model, one repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--ctx-per-slot", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per slot in use")
    parser.add_argument("--min-requests", type=int, default=6, help="per level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--peers",
        nargs="+",
        choices=PEER_NAMES,
        default=list(PEER_NAMES),
        help="the peer servers beside axon (llama-server is the one issue 16's targets name)",
    )
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--axon-log-level", default="info")
    parser.add_argument(
        "--activation-precision",
        choices=("float32", "int8"),
        default="float32",
        help="axon's --activation-precision (int8: 8-bit activations, as llama.cpp computes)",
    )
    parser.add_argument("--log-dir", type=Path, default=CACHE / "serve-vs-llama-server-logs")
    parser.add_argument("--json", type=Path, help="write every run's figures here too")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    binaries = build_peers(args.peers)
    files = model_files(args)
    results = []
    for model in files:
        results.append(compare_file(model, binaries, args))
        print(format_table(model.name, results[-1]["best"], args.concurrency), flush=True)
        print(f"(uptime load: {' '.join(f'{x:.2f}' for x in os.getloadavg())})", flush=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"log_dir": str(args.log_dir), "json": str(args.json)},
                    "results": results,
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
