"""`/health` latency while `axon serve` produces a big answer (issue 32 point 3).

Starts `axon serve MODEL` itself (default: the demo's gemma-3-270m GGUF in axon's model cache),
takes an idle baseline of `/health`, then sends the issue's chat request

    {"n": 128, "max_tokens": 300, "logprobs": true, "top_logprobs": 20, "ignore_eos": true}

once whole and once streamed (about 55 MB of JSON each), probing `/health` all the while. The
probes are open-loop: one is due every 20 ms and each is timed from when it was due, so a stall
of the event loop delays every probe due in it (a closed-loop prober would send one probe per
stall and hide the rest). It prints p50 / p99 / max per phase, and the answer's size and time (read
in a child process, so that the prober shares no GIL with it).

    PYTHONPATH=src python benchmarks/health_under_load.py
    PYTHONPATH=src python benchmarks/health_under_load.py --n 64 --max-tokens 64
    PYTHONPATH=src python benchmarks/health_under_load.py --tiny   # the test suite's model
    PYTHONPATH=src python benchmarks/health_under_load.py --model DIR -- --dtype float32

On 2 shared cores the gemma engine takes minutes per answer (n: 128 decodes at a few steps a
second), which spreads the HTTP process's work thin; `--tiny` serves the fault suite's 2-layer
random Qwen3 (written to a temporary folder), whose engine outruns the HTTP process, so that
process's own stalls are what the probes see.

Arguments after `--` go to `axon serve` as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

GEMMA = Path.home() / ".cache/axon/models/gemma-3-270m-q4_k_m.gguf"
PROBE_EVERY_S = 0.02


def tiny_model(folder: Path) -> str:
    """The test suite's tiny Qwen3 with its tokenizer, written into `folder`."""
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "tests")]
    from tests.server.conftest import write_tiny_qwen3  # lazy: torch, transformers, pytest

    return str(write_tiny_qwen3(folder / "tiny"))


def start_server(model: str, max_num_seqs: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "axon", "serve", model, "--port", "0", "--no-demo"]
    args += ["--served-model-name", "m", "--max-num-seqs", str(max_num_seqs)]
    args += ["--max-model-len", "1024", "--log-level", "warning", *extra]
    process = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    for line in process.stderr:
        sys.stderr.write(line)
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            threading.Thread(target=process.stderr.read, daemon=True).start()  # drain
            return process, found.group(1).replace("0.0.0.0", "127.0.0.1")
    raise SystemExit("axon serve exited before listening")


def wait_loaded(base_url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            models = httpx.get(base_url + "/v1/models", timeout=5).json()["data"]
            if any(m["id"] == "m" for m in models):
                return
        except (httpx.HTTPError, KeyError):
            pass
        time.sleep(0.5)
    raise SystemExit("the model never loaded")


async def probe_health(base_url: str, running) -> list[float]:
    """`/health` latencies (s), a probe due every PROBE_EVERY_S while `running()` holds."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:

        async def probe(due: float) -> None:
            (await client.get("/health")).raise_for_status()
            latencies.append(time.monotonic() - due)

        probes, start, count = [], time.monotonic(), 0
        while running():
            due = start + count * PROBE_EVERY_S
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            probes.append(asyncio.create_task(probe(due)))
            count += 1
        await asyncio.gather(*probes)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# The big request runs in a process of its own: reading 64 MB of small SSE chunks through httpx
# is enough Python work to delay the prober's own event loop if they shared a GIL.
_CLIENT = """
import json, sys, time, httpx
url, body = sys.argv[1], json.loads(sys.stdin.read())
start, size = time.monotonic(), 0
with httpx.stream("POST", url, json=body, timeout=1800) as r:
    for chunk in r.iter_raw():
        size += len(chunk)
print(json.dumps({"status": r.status_code, "bytes": size, "seconds": time.monotonic() - start}))
"""


def big_answer(base_url: str, body: dict, result: dict, done: threading.Event) -> None:
    """The big request, in a child process; keeps its status, size and time."""
    try:
        url = base_url + "/v1/chat/completions"
        child = subprocess.run(
            [sys.executable, "-c", _CLIENT, url], input=json.dumps(body),
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        result.update(json.loads(child.stdout))
    finally:
        done.set()


def for_seconds(seconds: float):
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() < deadline


def measure(base_url: str, body: dict) -> tuple[list[float], dict]:
    result: dict = {}
    done = threading.Event()
    thread = threading.Thread(target=big_answer, args=(base_url, body, result, done))
    thread.start()
    latencies = asyncio.run(probe_health(base_url, lambda: not done.is_set()))
    thread.join()
    return latencies, result


def row(name: str, latencies: list[float], result: dict | None = None) -> str:
    p50, p99 = percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3
    text = f"{name:<10} {len(latencies):>7} {p50:>8.1f} {p99:>8.1f} {max(latencies) * 1e3:>8.1f}"
    if result:
        text += f" {result['bytes'] / 1e6:>8.1f} {result['seconds']:>7.1f} {result['status']:>6}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(GEMMA))
    parser.add_argument("--tiny", action="store_true", help="the test suite's tiny Qwen3")
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--top-logprobs", type=int, default=20)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--only", choices=["whole", "streamed"], default=None)
    parser.add_argument("serve_args", nargs="*", help="after --: more `axon serve` arguments")
    args = parser.parse_args()
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "n": args.n,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": args.top_logprobs,
    }
    with tempfile.TemporaryDirectory() as folder:
        model = tiny_model(Path(folder)) if args.tiny else args.model
        extra = ["--dtype", "float32", "--kv-cache-memory", "256M"] if args.tiny else []
        run(model, body, args, extra + args.serve_args)


def run(model: str, body: dict, args, serve_args: list[str]) -> None:
    process, base_url = start_server(model, max(64, args.n), serve_args)
    try:
        wait_loaded(base_url)
        httpx.post(base_url + "/v1/chat/completions", json={**body, "n": 2, "max_tokens": 4},
                   timeout=300)  # fmt: skip
        asyncio.run(probe_health(base_url, for_seconds(0.5)))  # the prober's warm-up
        rows = [row("idle", asyncio.run(probe_health(base_url, for_seconds(args.idle_s))))]
        for stream in (False, True):
            name = "streamed" if stream else "whole"
            if args.only in (None, name):
                rows.append(row(name, *measure(base_url, {**body, "stream": stream})))
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    print(f"\nn={args.n} max_tokens={args.max_tokens} top_logprobs={args.top_logprobs}")
    print(f"{'phase':<10} {'probes':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}", end="")
    print(f" {'MB':>8} {'s':>7} {'status':>6}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
