"""Serving benchmark: a streaming client against `axon serve`, with vLLM's metric definitions.

The script starts `axon serve MODEL_DIR --port 0 ...` itself (or talks to a running server with
`--url`), waits until `/v1/models` lists the model, and then, for each concurrency level
(default 1, 4, 16), sends N `/v1/completions` requests with at most that many in flight (a
semaphore, as `vllm bench serve --max-concurrency` does with an infinite request rate). Each
request is

    {"prompt": [token ids], "max_tokens": OUTPUT_LEN, "ignore_eos": true, "temperature": 0,
     "stream": true, "stream_options": {"include_usage": true}}

The random model has no tokenizer, so prompts are random token ids and the streamed text is
empty; every SSE chunk that has `choices` counts as a content chunk (vLLM's client does the
same: "text could be empty here"), and the output token count comes from the final usage chunk.

The requests, their timestamps and the metrics are `axon bench serve`'s (axon.bench.client
and axon.bench.metrics: vLLM's `benchmark_serving` definitions, the client's `perf_counter`):

- TTFT: arrival of the first content chunk - request send;
- E2E:  arrival of the last content chunk - request send;
- TPOT: (E2E - TTFT) / (output_tokens - 1), per request;
- ITL:  gaps between successive content chunks, pooled over all requests (a chunk carrying
  several tokens is one gap, as in vLLM);
- output tok/s: total output tokens / wall time of the whole level.

This script adds what only a run against a server it starts itself can: the random model, the
server's own histograms and the offline twin below. To benchmark any OpenAI-compatible server
(axon, llama-server, vLLM) with random or dataset prompts, a plot and JSON results, use
`axon bench serve --base-url URL` instead.

Mean, median and p99 (linear interpolation, numpy's default) are reported in ms. Between
levels the script scrapes the server's `/metrics` and prints the server-side histograms
(`axon:time_to_first_token_seconds` and friends, sum / count over the level) next to the
client's numbers, so the HTTP + queueing share of the latency can be seen.

When the script started the server itself it also runs, right after each level, an offline
reference in this process: `LLM.generate` on the same prompts with `max_num_seqs` = the
concurrency (the engine's own continuous batching, no HTTP), and reports serve / offline
output tok/s (`--no-offline` skips it). The server stays up but idle meanwhile (it uses no CPU
when idle), so the two run back to back on the same machine state; this holds the weights
twice in memory (2 x 1.6 GB for the default model).

    PYTHONPATH=src python benchmarks/serve.py --quick       # smoke run (about a minute)
    PYTHONPATH=src python benchmarks/serve.py               # full run: concurrency 1 4 16
    PYTHONPATH=src python benchmarks/serve.py --url http://127.0.0.1:8000 --model NAME

The model is the Qwen3-shaped random checkpoint of `benchmarks/offline_throughput.py`
(hidden 1024, 8 layers, 16/8 heads, head_dim 64, intermediate 3072, vocab 151936, fp32),
written once to ~/.cache/axon-bench/qwen3-1024x8 and reused (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from axon.bench.client import BenchPrompt, RequestConfig
from axon.bench.client import run_level as bench_level
from axon.bench.metrics import RequestResult, level_metrics

BENCH_DIR = Path(__file__).resolve().parent
SRC_DIR = BENCH_DIR.parent / "src"
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "axon-bench" / "qwen3-1024x8"  # offline_throughput's
DEFAULT_SERVED_NAME = "qwen3-bench"
DEFAULT_NUM_REQUESTS = 32
DEFAULT_NUM_REQUESTS_C1 = 8  # concurrency 1 is sequential: fewer requests keep the run short


# ---- model ----------------------------------------------------------------------------------


def ensure_model(model_dir: Path, seed: int) -> Path:
    """The random Qwen3 checkpoint, built by offline_throughput.py's function when missing."""
    if (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors")):
        return model_dir
    sys.path.insert(0, str(BENCH_DIR))
    from offline_throughput import ensure_model as build  # imports torch: only when needed

    return build(model_dir, seed)


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


# ---- workload -------------------------------------------------------------------------------


def make_prompts(
    n: int, prompt_range: tuple[int, int], vocab: int, seed: int, level: int
) -> list[list[int]]:
    """`n` random token-id prompts. The lengths are the same sequence at every level (seeded by
    `seed`); the ids differ per level, so no level hits the prefix cache of another."""
    lengths = random.Random(seed)
    ids = random.Random(f"{seed}-{level}")
    return [[ids.randrange(vocab) for _ in range(lengths.randint(*prompt_range))] for _ in range(n)]


# ---- the server -----------------------------------------------------------------------------


class ServerProcess:
    """`axon serve` as a subprocess in its own session; its stderr is kept (and logged)."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path | None):
        self.command = command
        self.log: list[str] = []
        self._log_file = open(log_path, "w") if log_path else None  # noqa: SIM115
        self._url_found = threading.Event()
        self.process = subprocess.Popen(
            command,
            env=env,
            cwd=BENCH_DIR.parent,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # a peer logs raw token bytes: a strict decode would kill the reader, and the
            # server would then block on a full pipe
            encoding="utf-8",
            errors="replace",
            start_new_session=True,
        )
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            if self._log_file is not None:
                self._log_file.write(line)
                self._log_file.flush()
            if "listening on http://" in line:
                self._url_found.set()

    def base_url(self, deadline_s: float) -> str:
        if not self._url_found.wait(deadline_s):
            raise RuntimeError("axon serve never said where it listens:\n" + self.log_text())
        url = re.search(r"listening on (http://\S+)", self.log_text()).group(1)
        return url.replace("0.0.0.0", "127.0.0.1")

    def log_text(self) -> str:
        return "".join(self.log)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"axon serve exited ({self.process.returncode}):\n" + self.log_text()
            )

    def stop(self, grace_s: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL to the whole group if it has not exited within `grace_s`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.process.returncode


def serve_command(args: argparse.Namespace, model_dir: Path, max_model_len: int) -> list[str]:
    kv_memory = args.kv_cache_memory or args.max_num_seqs * max_model_len * kv_bytes_per_token(
        model_dir
    )
    command = [sys.executable, "-m", "axon", "serve", str(model_dir), "--port", "0"]
    command += ["--served-model-name", args.model, "--dtype", "float32"]
    command += ["--max-model-len", str(max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    command += ["--kv-cache-memory", str(kv_memory), "--log-level", args.server_log_level]
    return command + list(args.server_arg)


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
    return env


def listed_models(base_url: str, headers: dict) -> list[str]:
    models = httpx.get(base_url + "/v1/models", headers=headers, timeout=5).json()
    return [m.get("id") for m in models.get("data", [])]


def wait_until_listed(
    base_url: str, model: str | None, headers: dict, deadline_s: float, server=None
) -> None:
    """Polls /v1/models until it lists `model` (None: any model)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server is not None:
            server.check_alive()
            if "startup load of" in server.log_text():  # serve.py logs a failed load so
                raise RuntimeError("the model load failed:\n" + server.log_text())
        try:
            listed = listed_models(base_url, headers)
            if (model is None and listed) or model in listed:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    what = f"{model!r} was not" if model else "no model was"
    raise RuntimeError(f"{what} listed by {base_url}/v1/models within {deadline_s:.0f}s")


# ---- server metrics -------------------------------------------------------------------------

SERVER_HISTOGRAMS = (
    "axon:time_to_first_token_seconds",
    "axon:inter_token_latency_seconds",
    "axon:e2e_request_latency_seconds",
)
_SAMPLE_RE = re.compile(r"([^{\s]+)(?:\{(.*)\})? (\S+)")


def scrape(base_url: str, model: str, headers: dict) -> dict[str, float]:
    """{sample name: value} of `model`'s histogram _sum / _count samples on /metrics."""
    try:
        text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return {}
    wanted = {f"{h}{suffix}" for h in SERVER_HISTOGRAMS for suffix in ("_sum", "_count")}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE_RE.fullmatch(line)
        if line.startswith("#") or match is None or match.group(1) not in wanted:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if labels.get("model_name", model) == model:
            samples[match.group(1)] = float(match.group(3))
    return samples


def histogram_delta(before: dict, after: dict, name: str) -> tuple[float, float]:
    """(sum, count) of histogram `name` observed between two scrapes."""
    total = after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)
    count = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
    return total, count


# ---- the client: axon.bench ----------------------------------------------------------------


def run_level(
    base_url: str,
    model: str,
    headers: dict,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
) -> tuple[float, list[RequestResult]]:
    """Sends every prompt, at most `concurrency` in flight; returns (wall s, results)."""
    config = RequestConfig(base_url, "completions", model, temperature=0.0, ignore_eos=True)
    bench_prompts = [BenchPrompt(prompt, len(prompt), output_len) for prompt in prompts]
    progress = tqdm(total=len(prompts), desc=f"c={concurrency}", disable=not sys.stderr.isatty())
    with progress:
        return asyncio.run(
            bench_level(config, headers, bench_prompts, concurrency, progress=progress)
        )


# ---- statistics -----------------------------------------------------------------------------


@dataclass
class LevelReport:
    concurrency: int
    num_requests: int
    completed: int
    wall_s: float
    total_input_tokens: int
    total_output_tokens: int
    output_tok_s: float
    request_s: float
    ttft: dict
    tpot: dict
    itl: dict
    e2e: dict
    chunks_per_token: float
    cached_prompt_tokens: int
    load_avg_1m: float
    client_cpu_s: float = 0.0
    server: dict = field(default_factory=dict)
    offline: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def report(concurrency: int, wall: float, results: list[RequestResult]) -> LevelReport:
    metrics = level_metrics(results, wall, percentiles=(99,))
    ok = [r for r in results if r.success]
    output_tokens = metrics["total_output_tokens"]

    def three(name: str) -> dict[str, float]:  # None (no values) reads as nan in the tables
        values = {stat: metrics[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p99")}
        return {stat: math.nan if value is None else value for stat, value in values.items()}

    return LevelReport(
        concurrency=concurrency,
        num_requests=metrics["num_prompts"],
        completed=metrics["completed"],
        wall_s=wall,
        total_input_tokens=metrics["total_input_tokens"],
        total_output_tokens=output_tokens,
        output_tok_s=metrics["output_throughput"],
        request_s=metrics["request_throughput"],
        ttft=three("ttft"),
        tpot=three("tpot"),
        itl=three("itl"),
        e2e=three("e2el"),
        chunks_per_token=sum(r.chunks for r in ok) / output_tokens if output_tokens else math.nan,
        cached_prompt_tokens=sum(r.cached_tokens for r in ok),
        load_avg_1m=os.getloadavg()[0],
        errors=sorted({r.error for r in results if not r.success})[:5],
    )


def fmt3(stats: dict) -> str:
    return f"{stats['mean']:.1f} / {stats['median']:.1f} / {stats['p99']:.1f}"


def markdown_tables(reports: list[LevelReport]) -> str:
    lines = [
        "| concurrency | requests | wall (s) | output tok/s | TTFT ms mean / median / p99 "
        "| TPOT ms mean / median / p99 | ITL ms mean / median / p99 "
        "| E2E ms mean / median / p99 |",
        "| ---: | ---: | ---: | ---: | --- | --- | --- | --- |",
    ]
    for r in reports:
        requests = (
            f"{r.completed}"
            if r.completed == r.num_requests
            else (f"{r.completed}/{r.num_requests}")
        )
        lines.append(
            f"| {r.concurrency} | {requests} | {r.wall_s:.1f} | {r.output_tok_s:.1f} "
            f"| {fmt3(r.ttft)} | {fmt3(r.tpot)} | {fmt3(r.itl)} | {fmt3(r.e2e)} |"
        )
    lines += [
        "",
        "| concurrency | server TTFT mean ms (sum / count) | client TTFT mean ms "
        "| server ITL mean ms | server E2E mean ms | client E2E mean ms | chunks / token "
        "| cached prompt tokens | client CPU s | offline tok/s | serve / offline | 1-min load |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in reports:
        s = r.server
        ttft = (
            f"{1000 * s['ttft_sum'] / s['ttft_count']:.1f} "
            f"({s['ttft_sum']:.3f} s / {s['ttft_count']:.0f})"
            if s.get("ttft_count")
            else "n/a"
        )
        itl = f"{1000 * s['itl_sum'] / s['itl_count']:.1f}" if s.get("itl_count") else "n/a"
        e2e = f"{1000 * s['e2e_sum'] / s['e2e_count']:.1f}" if s.get("e2e_count") else "n/a"
        off = r.offline
        offline = f"{off['output_tok_s']:.1f}" if off else "n/a"
        ratio = f"{r.output_tok_s / off['output_tok_s']:.2f}" if off else "n/a"
        lines.append(
            f"| {r.concurrency} | {ttft} | {r.ttft['mean']:.1f} | {itl} | {e2e} "
            f"| {r.e2e['mean']:.1f} | {r.chunks_per_token:.2f} | {r.cached_prompt_tokens} "
            f"| {r.client_cpu_s:.1f} | {offline} | {ratio} | {r.load_avg_1m:.2f} |"
        )
    return "\n".join(lines)


# ---- offline reference ----------------------------------------------------------------------


def offline_reference(
    args: argparse.Namespace,
    model_dir: Path,
    max_model_len: int,
    concurrency: int,
    prompts: list[list[int]],
) -> dict:
    """`LLM.generate` on one level's prompts with max_num_seqs = the concurrency, in-process."""
    import torch

    from axon.engine.llm import LLM
    from axon.sampling_params import SamplingParams

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    start = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=concurrency,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=concurrency * max_model_len * kv_bytes_per_token(model_dir),
    )
    load_s = time.perf_counter() - start
    warm = make_prompts(args.warmup or 1, (16, 32), args.vocab_size, args.seed + 1, -1)
    llm.generate([{"prompt_token_ids": p} for p in warm], params(4))
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(args.output_len))
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "load_s": load_s,
        "load_avg_1m": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
    }
    print(
        f"offline c={concurrency}: {tokens} tokens in {wall:.1f}s -> {tokens / wall:.1f} tok/s "
        f"(engine load {load_s:.1f}s, 1-min load {result['load_avg_1m']:.2f})",
        flush=True,
    )
    del llm, outs
    gc.collect()
    return result


# ---- main -----------------------------------------------------------------------------------


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8000): start none")
    p.add_argument(
        "--model",
        help=f"served model id (default: {DEFAULT_SERVED_NAME}, or with "
        "--url the first one /v1/models lists)",
    )
    p.add_argument("--api-key", default=os.environ.get("AXON_API_KEY"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument(
        "--num-requests",
        type=int,
        help=f"requests per level (default: {DEFAULT_NUM_REQUESTS}, "
        f"{DEFAULT_NUM_REQUESTS_C1} at concurrency 1)",
    )
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before the levels")
    p.add_argument("--max-num-seqs", type=int, help="server flag (default: largest concurrency)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, help="bytes (default: room for every sequence)")
    p.add_argument("--server-log", type=Path, help="write the server's stderr here")
    p.add_argument("--server-log-level", default="warning")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra `axon serve` argument (repeat)"
    )
    p.add_argument("--load-timeout", type=float, default=900.0)
    p.add_argument(
        "--offline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="offline LLM.generate reference after the server stops (default: on unless --url)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--quick", action="store_true", help="smoke run: few, short requests")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_len = (16, 64)
        args.output_len = min(args.output_len, 8)
        args.warmup = min(args.warmup, 1)
    if args.offline is None:
        args.offline = args.url is None
    args.max_num_seqs = args.max_num_seqs or max(args.concurrency)
    return args


def requests_at(args: argparse.Namespace, concurrency: int) -> int:
    if args.num_requests:
        return args.num_requests
    if args.quick:
        return 2 if concurrency == 1 else concurrency
    return DEFAULT_NUM_REQUESTS_C1 if concurrency == 1 else DEFAULT_NUM_REQUESTS


def main(argv=None) -> int:
    args = parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model_dir = args.model_dir.expanduser()
    max_model_len = -(-(args.prompt_len[1] + args.output_len) // 16) * 16
    workloads = {
        c: make_prompts(requests_at(args, c), tuple(args.prompt_len), args.vocab_size, args.seed, c)
        for c in args.concurrency
    }
    info = {
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, python {platform.python_version()}",
        "workload": f"per level {', '.join(f'c={c}: {len(w)}' for c, w in workloads.items())} "
        f"requests; prompt {args.prompt_len[0]}-{args.prompt_len[1]} random token ids, "
        f"output {args.output_len} tokens, greedy, ignore_eos, seed {args.seed}",
    }
    server = None
    if args.url:
        base_url = args.url.rstrip("/")
        wait_until_listed(base_url, args.model, headers, args.load_timeout)
        args.model = args.model or listed_models(base_url, headers)[0]
    else:
        args.model = args.model or DEFAULT_SERVED_NAME
        model_dir = ensure_model(model_dir, args.seed)
        command = serve_command(args, model_dir, max_model_len)
        info["server"] = " ".join(command[1:])
        print(f"starting: {' '.join(command)}", flush=True)
        start = time.perf_counter()
        server = ServerProcess(command, server_env(), args.server_log)
    for key, value in info.items():
        print(f"{key}: {value}", flush=True)

    reports: list[LevelReport] = []
    try:
        if server is not None:
            base_url = server.base_url(120.0)
            wait_until_listed(base_url, args.model, headers, args.load_timeout, server)
            print(f"server ready at {base_url} in {time.perf_counter() - start:.1f}s", flush=True)
        if args.warmup:
            warm = make_prompts(args.warmup, (16, 32), args.vocab_size, args.seed + 1, -1)
            run_level(base_url, args.model, headers, warm, 4, 1)
        for concurrency, prompts in workloads.items():
            before = scrape(base_url, args.model, headers)
            cpu0 = time.process_time()
            wall, results = run_level(
                base_url, args.model, headers, prompts, args.output_len, concurrency
            )
            after = scrape(base_url, args.model, headers)
            rep = report(concurrency, wall, results)
            rep.client_cpu_s = time.process_time() - cpu0
            for key, name in zip(("ttft", "itl", "e2e"), SERVER_HISTOGRAMS):
                rep.server[f"{key}_sum"], rep.server[f"{key}_count"] = histogram_delta(
                    before, after, name
                )
            reports.append(rep)
            print(
                f"c={concurrency}: {rep.completed}/{rep.num_requests} ok, "
                f"{rep.total_output_tokens} tokens in {wall:.1f}s -> {rep.output_tok_s:.1f} "
                f"tok/s; TTFT mean {rep.ttft['mean']:.1f} ms, TPOT mean {rep.tpot['mean']:.1f} "
                f"ms; server TTFT histogram sum {rep.server['ttft_sum']:.3f} s / count "
                f"{rep.server['ttft_count']:.0f}; 1-min load {rep.load_avg_1m:.2f}"
                + (f"; errors: {rep.errors}" if rep.errors else ""),
                flush=True,
            )
            if args.offline:  # right after the level, the server idle: same machine state
                rep.offline = offline_reference(
                    args, model_dir, max_model_len, concurrency, prompts
                )
        final = scrape(base_url, args.model, headers)
        print(
            "server /metrics at the end (warm-up included): axon:time_to_first_token_seconds "
            f"sum {final.get('axon:time_to_first_token_seconds_sum', math.nan):.3f} s, count "
            f"{final.get('axon:time_to_first_token_seconds_count', math.nan):.0f}",
            flush=True,
        )
    finally:
        if server is not None:
            code = server.stop()
            print(f"server stopped with SIGTERM: exit status {code}", flush=True)

    print()
    print(markdown_tables(reports))
    if args.json:
        args.json.write_text(
            json.dumps({"info": info, "levels": [asdict(r) for r in reports]}, indent=2)
        )
    failed = any(r.completed != r.num_requests for r in reports)
    return 1 if failed or not reports else 0


if __name__ == "__main__":
    sys.exit(main())
