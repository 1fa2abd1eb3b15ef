"""Soak: minutes of mixed traffic against `axon serve`, one engine SIGKILLed midway; every request
must end with an answer or a clear error (issue 12, point 17).

The script starts `axon serve` with no model (the demo model, gemma-3-270m Q4_K_M), loads a
second model through `POST /models/load` (the tiny random Qwen3 of tests/server/conftest.py,
ChatML template, written once to ~/.cache/axon/models/soak-tiny-chat) and then, for
`--minutes`, keeps `--concurrency` async clients busy with a seeded mix of requests, all to
127.0.0.1:

    completion / completion_stream / completion_n   /v1/completions on the demo model (n 2-3)
    chat / chat_stream (n 2) / structured           /v1/chat/completions on the demo model
                                                    (structured: response_format json_schema)
    disconnect                                      a long stream closed after 3 chunks
    bad_request                                     malformed or invalid bodies (expect 4xx)
    tiny_chat / tiny_completion                     the second model, streaming or not

Halfway through, the demo model's engine process (the server's multiprocessing child) gets
SIGKILL; the script polls `GET /models` until the model is `loaded` again (recovery time) and
counts the second model's answers meanwhile. Each request is classified:

    completed   2xx with a whole body (every choice finished), or a stream ending in [DONE]
                with no error event; for bad_request, a 4xx in OpenAI's error envelope
    failed      an HTTP error status (4xx, or 503) with OpenAI's error envelope, or an SSE
                error event
    lost        the connection dropped without an error, a truncated body or stream, a 5xx
                other than a 503 with an envelope, or a 2xx for a bad request
    hung        no answer within `--deadline` seconds

A client that gets a 429 or 503 waits its Retry-After (at most 5 s) before its next request. It
prints that table per kind with p50/p99 latency of the completed requests, the RSS of the HTTP
process and of each engine (sampled every 5 s; start, each minute, end), the recovery time,
/health latency every 0.5 s (a stalled event loop), the load average (other processes may share
the machine), and the server log lines around every lost or hung request. Then it stops the
server with SIGTERM and checks it exits 0 within the grace period and leaves no engine behind.
Exit status 1 when any request was lost or hung, or the server did not stop cleanly.

    .venv/bin/python benchmarks/soak.py --minutes 3
    .venv/bin/python benchmarks/soak.py --minutes 2 --client-keepalive 4   # see docs/reliability.md

Results and what they showed: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
DEMO = "gemma-3-270m"
TINY = "tiny-chat"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GRACE_S = 20.0  # axon serve's default --shutdown-grace
KILL_AT = 0.5  # fraction of the traffic time
SAMPLE_EVERY_S = 5.0
RETRY_CAP_S = 5.0  # the longest Retry-After a client honours before its next request
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three laws of motion are",
    "A good recipe for bread needs",
    "In 1969, the first",
)
QUESTIONS = ("Say hello.", "Name three colours.", "What is 2 + 2?", "Write a haiku about rain.")
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


# ---- the server and its processes -----------------------------------------------------------


class Server:
    """`axon serve` in its own session; every stderr line is kept with its arrival time."""

    def __init__(self, port: int, log_path: Path):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO / "src"), env.get("PYTHONPATH")])
        )
        env.pop("AXON_API_KEY", None)
        command = [sys.executable, "-m", "axon", "serve", "--host", "127.0.0.1"]
        self.process = subprocess.Popen(
            [*command, "--port", str(port), "--shutdown-grace", str(GRACE_S)],
            env=env,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.log: list[tuple[float, str]] = []
        self.log_path = log_path
        self._listening = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        with open(self.log_path, "w") as out:
            for line in self.process.stderr:
                self.log.append((time.time(), line.rstrip("\n")))
                out.write(line)
                out.flush()
                if "listening on http://" in line:
                    self._listening.set()

    def base_url(self, timeout_s: float) -> str:
        if not self._listening.wait(timeout_s) or self.process.poll() is not None:
            raise RuntimeError("axon serve did not start; its log: " + str(self.log_path))
        text = "\n".join(line for _, line in self.log)
        return re.search(r"listening on (http://\S+)", text).group(1)

    def lines_between(self, start: float, end: float, limit: int = 12) -> list[str]:
        lines = [line for t, line in self.log if start <= t <= end]
        return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])

    def stop(self, grace_s: float) -> tuple[int | None, float]:
        """SIGTERM; (exit code or None when it outlived `grace_s`, seconds it took). A server
        that outlives the grace is killed with its whole group."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            code = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        return code, time.monotonic() - started


def children(pid: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in task.read_text().split()]
    return pids


def engine_pids(server_pid: int) -> set[int]:
    """The server's engine processes: its multiprocessing spawn children (not the resource
    tracker, which is a spawn child too but runs resource_tracker)."""
    engines = set()
    for pid in children(server_pid):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if "spawn_main" in cmdline:
                engines.add(pid)
    return engines


def rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def machine_note() -> str:
    """Load average and the busiest processes: whether the machine was shared."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    ps = subprocess.run(
        ["ps", "-eo", "pcpu,etimes,comm", "--sort=-pcpu", "--no-headers"],
        capture_output=True,
        text=True,
    ).stdout.splitlines()[:4]
    busy = "; ".join(" ".join(line.split()) for line in ps)
    return f"{os.cpu_count()} CPUs, load average {load}; top (%cpu elapsed_s name): {busy}"


# ---- the workload ---------------------------------------------------------------------------


@dataclass
class Spec:
    kind: str
    model: str
    path: str
    body: dict | bytes
    stream: bool = False
    n: int = 1
    expect_error: bool = False
    disconnect_after: int | None = None  # SSE chunks to read before hanging up


def _chat(rng: random.Random, model: str, max_tokens: int | None = None) -> dict:
    question = "tell me a story" if model == TINY else rng.choice(QUESTIONS)
    return {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens or rng.randint(8, 48),
        "temperature": 0.8,
    }


def _completion(rng: random.Random, model: str, max_tokens: int | None = None) -> dict:
    prompt = "w10 w11 w12 hello world" if model == TINY else rng.choice(PROMPTS)
    max_tokens = max_tokens or rng.randint(8, 48)
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8}


def _streaming(body: dict) -> dict:
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def _completion_n(rng: random.Random) -> Spec:
    n = rng.choice([2, 3])
    return Spec("", DEMO, COMPLETIONS, {**_completion(rng, DEMO), "n": n}, n=n)


def _structured(rng: random.Random) -> Spec:
    body = _chat(rng, DEMO, 48)
    body["messages"][0]["content"] = "Is the sky blue? Answer in JSON."
    body["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": SCHEMA},
    }
    return Spec("", DEMO, CHAT, body)


def _disconnect(rng: random.Random) -> Spec:
    body = _streaming(_completion(rng, DEMO, 256))
    return Spec("", DEMO, COMPLETIONS, body, stream=True, disconnect_after=3)


def _tiny_chat(rng: random.Random) -> Spec:
    body, stream = _chat(rng, TINY), rng.random() < 0.5
    return Spec("", TINY, CHAT, _streaming(body) if stream else body, stream=stream)


def _bad_request(rng: random.Random) -> Spec:
    """One of a few ordinary client mistakes, each a 4xx in the error envelope."""
    hi = [{"role": "user", "content": "hi"}]
    path, body = rng.choice(
        [
            (COMPLETIONS, {"model": DEMO, "prompt": "x", "max_tokens": -1}),
            (COMPLETIONS, {"model": DEMO, "prompt": "x", "n": 0}),
            (COMPLETIONS, {"model": "no-such-model", "prompt": "x"}),
            (COMPLETIONS, {"model": DEMO, "prompt": "x", "max_tokens": 10**6}),  # > max_model_len
            (COMPLETIONS, b'{"model": "gemma-3-270m", "prompt": '),
            (CHAT, {"model": DEMO, "messages": "not a list"}),
            (CHAT, {"model": DEMO, "messages": hi, "temperature": "hot"}),
        ]
    )
    return Spec("", DEMO, path, body, expect_error=True)


KINDS = {  # kind: (weight in the mix, a request of that kind)
    "completion": (4, lambda rng: Spec("", DEMO, COMPLETIONS, _completion(rng, DEMO))),
    "completion_stream": (
        4,
        lambda rng: Spec("", DEMO, COMPLETIONS, _streaming(_completion(rng, DEMO)), stream=True),
    ),
    "completion_n": (2, _completion_n),
    "chat": (2, lambda rng: Spec("", DEMO, CHAT, _chat(rng, DEMO))),
    "chat_stream": (
        2,
        lambda rng: Spec("", DEMO, CHAT, {**_streaming(_chat(rng, DEMO)), "n": 2}, True, 2),
    ),
    "structured": (1, _structured),
    "disconnect": (2, _disconnect),
    "bad_request": (2, _bad_request),
    "tiny_chat": (3, _tiny_chat),
    "tiny_completion": (2, lambda rng: Spec("", TINY, COMPLETIONS, _completion(rng, TINY))),
}


def make_spec(rng: random.Random) -> Spec:
    kinds = list(KINDS)
    kind = rng.choices(kinds, [KINDS[k][0] for k in kinds])[0]
    return dataclasses.replace(KINDS[kind][1](rng), kind=kind)


# ---- one request ----------------------------------------------------------------------------


@dataclass
class Result:
    kind: str
    model: str
    start: float  # time.time()
    end: float
    outcome: str  # completed | failed | lost | hung
    detail: str = ""
    retry_after: float = 0.0  # the Retry-After of a 429 or 503


def _envelope(text: str) -> dict | None:
    with contextlib.suppress(ValueError, AttributeError):
        error = json.loads(text)["error"]
        if isinstance(error, dict) and "message" in error and "type" in error:
            return error
    return None


def classify_status(spec: Spec, status: int, text: str) -> tuple[str, str]:
    """The outcome of a non-2xx answer, or of any answer to a bad request."""
    error = _envelope(text)
    detail = f"HTTP {status}" + (f" {error.get('code') or error['type']}" if error else "")
    clear = error is not None and (status < 500 or status == 503)
    if spec.expect_error and clear and status != 503:  # 503: the model is away; checked later
        return "completed", detail
    if clear:
        return "failed", f"{detail}: {error['message'][:120]}"
    return "lost", f"{detail}: {text[:200]}"


def check_body(spec: Spec, text: str) -> tuple[str, str]:
    """A whole 2xx body: JSON whose n choices all finished; structured content must parse."""
    try:
        choices = json.loads(text)["choices"]
    except (ValueError, KeyError, TypeError):
        return "lost", f"truncated or invalid body: {text[:200]}"
    if len(choices) != spec.n or any(c.get("finish_reason") is None for c in choices):
        return (
            "lost",
            f"{len(choices)} choices, finish reasons {[c.get('finish_reason') for c in choices]}",
        )
    if spec.kind == "structured" and choices[0]["finish_reason"] == "stop":
        try:
            answer = json.loads(choices[0]["message"]["content"])
            if set(answer) != {"answer", "sure"}:
                return "lost", f"content violates the schema: {answer}"
        except ValueError:
            return "lost", f"content is not JSON: {choices[0]['message']['content'][:200]}"
    return "completed", choices[0].get("finish_reason") or ""


async def read_stream(spec: Spec, response: httpx.Response) -> tuple[str, str]:
    """Reads SSE events until [DONE] (or `disconnect_after` chunks, then hangs up)."""
    chunks, error = 0, None
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            return ("failed", f"SSE error: {error}") if error else ("completed", f"{chunks} chunks")
        event = json.loads(payload)
        if "error" in event:
            error = str(event["error"].get("message", event["error"]))[:120]
            continue
        chunks += 1
        if spec.disconnect_after is not None and chunks >= spec.disconnect_after:
            return "completed", f"hung up after {chunks} chunks"
    if error:
        return "failed", f"SSE error, stream closed without [DONE]: {error}"
    return "lost", f"stream ended after {chunks} chunks with no [DONE] and no error event"


async def send(client: httpx.AsyncClient, spec: Spec) -> tuple[str, str, float]:
    """(outcome, detail, seconds the server asked to wait before retrying)."""
    raw = spec.body if isinstance(spec.body, bytes) else json.dumps(spec.body).encode()
    headers = {"content-type": "application/json"}
    try:
        async with client.stream("POST", spec.path, content=raw, headers=headers) as response:
            if response.status_code >= 300 or spec.expect_error:
                text = (await response.aread()).decode(errors="replace")
                retry_after = float(response.headers.get("retry-after") or 0)
                return *classify_status(spec, response.status_code, text), retry_after
            if spec.stream:
                return *await read_stream(spec, response), 0.0
            return *check_body(spec, (await response.aread()).decode(errors="replace")), 0.0
    except httpx.HTTPError as exc:  # dropped connection, protocol error
        cause = exc.__cause__ or exc.__context__  # ConnectionResetError: the server's RST
        return "lost", f"{type(exc).__name__}: {exc} ({cause!r})", 0.0


async def run_one(client: httpx.AsyncClient, spec: Spec, deadline_s: float) -> Result:
    start = time.time()
    try:
        outcome, detail, retry_after = await asyncio.wait_for(send(client, spec), deadline_s)
    except TimeoutError:
        outcome, detail, retry_after = "hung", f"no answer within {deadline_s:.0f} s", 0.0
    return Result(spec.kind, spec.model, start, time.time(), outcome, detail, retry_after)


# ---- the run --------------------------------------------------------------------------------


@dataclass
class Run:
    server: Server
    base_url: str
    engines: dict[str, int]  # model -> engine pid
    results: list[Result] = field(default_factory=list)
    rss: list[tuple[float, dict[str, float | None]]] = field(default_factory=list)
    kill_at: float | None = None
    noticed_at: float | None = None  # /models first showed the model not loaded
    recovered_at: float | None = None
    statuses_seen: list[str] = field(default_factory=list)
    started: float = 0.0  # time.time() when the traffic began
    health: list[tuple[float, float]] = field(default_factory=list)  # (sent at, seconds)


async def worker(run: Run, client: httpx.AsyncClient, rng: random.Random, until: float, args):
    while time.time() < until:
        spec = make_spec(rng)
        result = await run_one(client, spec, args.deadline)
        run.results.append(result)
        # As OpenAI's clients do: wait as asked (at most RETRY_CAP_S) before the next request.
        await asyncio.sleep(min(result.retry_after, RETRY_CAP_S))


async def model_status(client: httpx.AsyncClient, model: str) -> str | None:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        models = (await client.get("/models", timeout=5)).json()
        return next((m["status"] for m in models if m["id"] == model), "absent")
    return None


async def kill_and_watch(run: Run, client: httpx.AsyncClient, at: float, limit_s: float) -> None:
    """SIGKILL the demo model's engine at `at`, then poll /models until it is loaded again."""
    await asyncio.sleep(max(0.0, at - time.time()))
    pid = run.engines[DEMO]
    if pid not in engine_pids(run.server.process.pid):
        raise RuntimeError(f"engine {pid} of {DEMO} is not a child of the server any more")
    os.kill(pid, signal.SIGKILL)
    run.kill_at = time.time()
    while time.time() < run.kill_at + limit_s:
        status = await model_status(client, DEMO)
        if not run.statuses_seen or run.statuses_seen[-1] != status:
            run.statuses_seen.append(status)
        if status != "loaded" and run.noticed_at is None:
            run.noticed_at = time.time()
        if status == "loaded" and run.noticed_at is not None:
            run.recovered_at = time.time()
            return
        await asyncio.sleep(0.1)


def sample_rss(run: Run) -> None:
    """One RSS sample; an engine that replaced a dead one is attributed to its model."""
    current = engine_pids(run.server.process.pid)
    new = current - set(run.engines.values())
    for model, pid in run.engines.items():
        if pid not in current and len(new) == 1:
            run.engines[model] = new.pop()
    row = {"http": rss_mb(run.server.process.pid)}
    row.update({f"{model} engine": rss_mb(pid) for model, pid in run.engines.items()})
    run.rss.append((time.time(), row))


async def sampler(run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        sample_rss(run)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
    sample_rss(run)


async def health_probe(run: Run, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
    """GET /health every 0.5 s: how long the HTTP process's event loop takes to answer."""
    while not stop.is_set():
        sent = time.time()
        with contextlib.suppress(httpx.HTTPError):
            await client.get("/health", timeout=60)
        run.health.append((sent, time.time() - sent))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def engines_idle(client: httpx.AsyncClient, timeout_s: float = 10.0) -> str:
    """Requests still running or waiting in the engines once the traffic has ended."""
    deadline, busy = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            text = (await client.get("/metrics", timeout=5)).text
            pattern = r"^axon:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$"
            busy = sum(float(v) for v in re.findall(pattern, text, re.M))
            if busy == 0:
                return "0 requests running or waiting in the engines"
        await asyncio.sleep(0.5)
    return f"{busy} requests still running or waiting in the engines after {timeout_s:.0f} s"


async def traffic(run: Run, args) -> str:
    limits = httpx.Limits(
        max_connections=args.concurrency + 8, keepalive_expiry=args.client_keepalive
    )
    timeout = httpx.Timeout(args.deadline + 30)
    async with httpx.AsyncClient(base_url=run.base_url, limits=limits, timeout=timeout) as client:
        started = run.started = time.time()
        until = started + args.minutes * 60
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler(run, stop))
        probing = asyncio.create_task(health_probe(run, client, stop))
        killer = asyncio.create_task(
            kill_and_watch(run, client, started + KILL_AT * args.minutes * 60, 300)
        )
        workers = [
            worker(run, client, random.Random(f"{args.seed}-{i}"), until, args)
            for i in range(args.concurrency)
        ]
        await asyncio.gather(*workers)
        await killer
        idle = await engines_idle(client)
        stop.set()
        await sampling
        await probing
        return idle


# ---- setup ----------------------------------------------------------------------------------


def tiny_chat_model() -> Path:
    """The tests' tiny random Qwen3 with a ChatML template (tests/server/conftest.py), written
    once into axon's model cache, one of the directories `POST /models/load` may read."""
    from axon.kernels.build import cache_dir

    directory = cache_dir() / "models" / "soak-tiny-chat"
    if (directory / "tokenizer_config.json").exists():
        return directory
    path = REPO / "tests" / "server" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_soak_conftest", path)
    conftest = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = conftest  # its dataclasses look their module up there
    spec.loader.exec_module(conftest)
    directory.mkdir(parents=True, exist_ok=True)
    return conftest.write_tiny_qwen3(directory)


def wait_loaded(base_url: str, model: str, server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"axon serve exited; its log: {server.log_path}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            models = httpx.get(base_url + "/models", timeout=5).json()
            if any(m["id"] == model and m["status"] == "loaded" for m in models):
                return
        time.sleep(0.5)
    raise RuntimeError(f"{model} was not loaded within {timeout_s:.0f} s")


def start(args, model_dir: Path) -> Run:
    """The server with both models loaded, and which engine process serves which."""
    server = Server(args.port, args.log)
    try:
        return _load_both(server, model_dir)
    except BaseException:
        server.stop(GRACE_S)  # never leave a server behind
        raise


def _load_both(server: Server, model_dir: Path) -> Run:
    base_url = server.base_url(120)
    wait_loaded(base_url, DEMO, server, 600)  # the first use assembles the GGUF file
    demo_engines = engine_pids(server.process.pid)
    if len(demo_engines) != 1:
        raise RuntimeError(f"expected one engine process, found {demo_engines}")
    body = {"model_id": str(model_dir), "served_model_name": TINY, "dtype": "float32"}
    body.update({"max_model_len": 2048, "kv_cache_memory": "16M"})
    response = httpx.post(base_url + "/models/load", json=body, timeout=300)
    if response.status_code != 200:
        raise RuntimeError(f"loading {TINY} failed: HTTP {response.status_code} {response.text}")
    (tiny_engine,) = engine_pids(server.process.pid) - demo_engines
    return Run(server, base_url, {DEMO: demo_engines.pop(), TINY: tiny_engine})


# ---- the report -----------------------------------------------------------------------------

OUTCOMES = ("completed", "failed", "lost", "hung")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def outcome_table(results: list[Result]) -> list[str]:
    lines = ["| kind | sent | completed | failed | lost | hung | p50 ms | p99 ms |"]
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in [*KINDS, "all"]:
        rows = [r for r in results if kind in ("all", r.kind)]
        counts = [sum(r.outcome == o for r in rows) for o in OUTCOMES]
        latencies = [1000 * (r.end - r.start) for r in rows if r.outcome == "completed"]
        p50, p99 = (
            (f"{percentile(latencies, 0.5):.0f}", f"{percentile(latencies, 0.99):.0f}")
            if latencies
            else ("-", "-")
        )
        cells = [kind, str(len(rows)), *map(str, counts), p50, p99]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def failure_summary(results: list[Result]) -> list[str]:
    """The failed requests grouped by what the server said (the text before the message)."""
    groups: dict[str, int] = {}
    for r in results:
        if r.outcome == "failed":
            key = f"{r.model}: {r.detail.split(':')[0]}"
            groups[key] = groups.get(key, 0) + 1
    return [f"  {count:5d} x {key}" for key, count in sorted(groups.items())]


def recovery_lines(run: Run, started: float) -> list[str]:
    if run.kill_at is None:
        return ["no engine was killed"]
    lines = [
        f"SIGKILL of the {DEMO} engine at t={run.kill_at - started:.1f} s; /models showed: "
        + " -> ".join(s or "(no answer in 5 s)" for s in run.statuses_seen)
    ]
    if run.recovered_at is None:
        lines.append("NOT RECOVERED within 300 s")
    else:
        noticed = run.noticed_at - run.kill_at
        lines.append(
            f"recovery (kill -> loaded): {run.recovered_at - run.kill_at:.1f} s "
            f"(not loaded seen after {noticed:.2f} s)"
        )
    in_flight = [r for r in run.results if r.model == DEMO and r.start < run.kill_at < r.end]
    if in_flight:
        outcomes = {o: sum(r.outcome == o for r in in_flight) for o in OUTCOMES}
        last = max(r.end for r in in_flight) - run.kill_at
        lines.append(
            f"{DEMO} requests in flight at the kill: {len(in_flight)} {outcomes}, "
            f"the last ended {last:.2f} s after it"
        )
    until = run.recovered_at or max(r.end for r in run.results)
    outage = [r for r in run.results if r.model == TINY and run.kill_at <= r.start <= until]
    done = sum(r.outcome == "completed" for r in outage)
    lines.append(f"{TINY} during the outage: {done} of {len(outage)} requests completed")
    return lines


def health_lines(run: Run) -> list[str]:
    """/health latency, and every probe slower than a second (the event loop was stalled)."""
    if not run.health:
        return []
    latencies = [1000 * seconds for _, seconds in run.health]
    lines = [
        f"/health every 0.5 s: {len(latencies)} probes, p50 {percentile(latencies, 0.5):.0f} ms, "
        f"p99 {percentile(latencies, 0.99):.0f} ms, max {max(latencies):.0f} ms"
    ]
    slow = [(t - run.started, seconds) for t, seconds in run.health if seconds > 1.0]
    lines += [f"  /health took {seconds:.1f} s at t={t:.1f} s" for t, seconds in slow]
    return lines


def rss_table(run: Run, started: float) -> list[str]:
    """RSS at the start, at each whole minute and at the end of the traffic."""
    if not run.rss:
        return []
    labels = list(run.rss[-1][1])
    picks = [run.rss[0]]
    minute = 1
    for sample in run.rss[1:-1]:
        if sample[0] - started >= 60 * minute:
            picks.append(sample)
            minute += 1
    picks.append(run.rss[-1])
    lines = ["| t (s) | " + " | ".join(f"{label} RSS MB" for label in labels) + " |"]
    lines.append("| ---: |" + " ---: |" * len(labels))
    for t, row in picks:
        cells = [f"{row[label]:.0f}" if row.get(label) else "-" for label in labels]
        lines.append(f"| {t - started:.0f} | " + " | ".join(cells) + " |")
    return lines


def problem_lines(run: Run, started: float) -> list[str]:
    """Every lost or hung request, with the server log lines written while it ran."""
    lines = []
    for r in run.results:
        if r.outcome in ("lost", "hung"):
            lines.append(
                f"{r.outcome.upper()} {r.kind} ({r.model}) t={r.start - started:.1f}"
                f"-{r.end - started:.1f} s: {r.detail}"
            )
            lines += [
                f"    log: {line}" for line in run.server.lines_between(r.start - 5, r.end + 2)
            ]
    return lines


def report(run: Run, idle: str, machine_start: str) -> list[str]:
    sent, started = len(run.results), run.started
    lines = [f"machine at start: {machine_start}", f"machine at end:   {machine_note()}", ""]
    lines += outcome_table(run.results) + [""]
    lines.append(f"{sent} requests in {time.time() - started:.0f} s; failed-with-error by cause:")
    lines += failure_summary(run.results) or ["  none"]
    lines += [""] + recovery_lines(run, started) + [f"after the traffic: {idle}"]
    lines += health_lines(run) + [""]
    lines += rss_table(run, started) + [""]
    lines += problem_lines(run, started)
    return lines


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="traffic time (default 5)")
    parser.add_argument("--port", type=int, default=0, help="port to serve on (default: any)")
    parser.add_argument("--concurrency", type=int, default=16, help="clients (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--deadline", type=float, default=120.0, help="s before a request is hung")
    parser.add_argument(
        "--client-keepalive",
        type=float,
        default=5.0,
        help="s an idle pooled connection is reused for (default 5: httpx's, as OpenAI's SDK)",
    )
    parser.add_argument("--log", type=Path, help="server log file (default: a temporary file)")
    args = parser.parse_args(argv)
    if args.log is None:
        args.log = Path(tempfile.gettempdir()) / f"axon-soak-{os.getpid()}.log"
    return args


def stop_server(run: Run) -> tuple[list[str], bool]:
    """SIGTERM the server; (report lines, whether it exited 0 in time leaving no engine)."""
    engines = engine_pids(run.server.process.pid)
    code, took = run.server.stop(GRACE_S + 10)  # the grace, plus the engines' own shutdown
    orphans = [pid for pid in engines if Path(f"/proc/{pid}").exists()]
    clean = code == 0 and not orphans
    line = f"SIGTERM: server exit code {code} after {took:.1f} s"
    line += f"; engine processes left behind: {orphans or 'none'}"
    return [line], clean


def main(argv=None) -> int:
    args = parse_args(argv)
    machine_start = machine_note()
    print(
        f"soak: {args.minutes:g} min, concurrency {args.concurrency}, seed {args.seed}; "
        f"server log {args.log}",
        flush=True,
    )
    run = start(args, tiny_chat_model())
    try:
        print(f"serving at {run.base_url}; engines {run.engines}", flush=True)
        idle = asyncio.run(traffic(run, args))
        lines = report(run, idle, machine_start)
    finally:
        shutdown, clean = stop_server(run)
    print("\n".join(lines + shutdown))
    bad = sum(r.outcome in ("lost", "hung") for r in run.results)
    verdict = "PASS" if bad == 0 and clean else "FAIL"
    print(f"{verdict}: {bad} lost or hung; server stopped cleanly: {clean}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
