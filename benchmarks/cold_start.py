"""Cold start of `axon serve` with no model (the demo models; the chat demo, SmolLM2-135M-Instruct
Q4_1, loads first): seconds from spawning the command to its first successful chat completion.

Each run starts `axon serve --port 0`, reads the port from its "listening on" line, then sends a
one-token chat completion every 50 ms until one answers 200, and stops the server (SIGTERM). The
breakdown is the arrival time of each milestone line in the server's log (stderr), relative to
the spawn; `cpu` is the CPU seconds of the server and its engine together, start to exit, and
`http cpu` / `engine cpu` those of each process up to the first answer (read from /proc then).
The machine may be shared, so CPU time is the steadier measure; the load average is printed
with the numbers.

    .venv/bin/python benchmarks/cold_start.py --runs 3            # warm starts (caches as they are)
    .venv/bin/python benchmarks/cold_start.py --runs 3 --fresh    # run 1 with an empty cache dir

`--fresh` points AXON_CACHE_DIR at a new temporary directory, so the first run is a first-ever
start (demo model assembled, C kernels compiled, tokenizers built from the GGUFs) and the later
runs reuse what it cached. Results: docs/performance.md, "Cold start".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from axon.demo import CHAT_DEMO_MODEL_ID

# (label, pattern of the log line that marks it); the first match of each counts.
MILESTONES = (
    ("http listening", r"axon: listening on"),
    ("tokenizer ready", r"tokenizer of .* loaded"),
    ("kernels compiled", r"compiled the C kernels"),
    ("weights loaded", r"engine\[\d+\] weights:"),
    ("model loaded", r"model .* loaded from"),
    ("activation ready", r"activation ready"),
)


def axon_command() -> list[str]:
    """`axon` next to this interpreter (the venv's console script), else `python -m axon`."""
    script = Path(sys.executable).with_name("axon")
    return [str(script)] if script.exists() else [sys.executable, "-m", "axon"]


class LogReader(threading.Thread):
    """Collects the server's stderr lines with their arrival time (seconds after `start`)."""

    def __init__(self, stream, start: float):
        super().__init__(daemon=True)
        self.stream, self.start_time = stream, start
        self.lines: list[tuple[float, str]] = []
        self.port: int | None = None
        self.port_seen = threading.Event()

    def run(self) -> None:
        for raw in self.stream:
            line = raw.rstrip("\n")
            self.lines.append((time.monotonic() - self.start_time, line))
            found = re.search(r"listening on http://\S+:(\d+)", line)
            if found and self.port is None:
                self.port = int(found.group(1))
                self.port_seen.set()
        self.port_seen.set()


def first_completion(port: int, deadline: float) -> float:
    """Polls a one-token chat completion until it answers 200; returns time.monotonic() then."""
    body = json.dumps(
        {
            "model": CHAT_DEMO_MODEL_ID,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "temperature": 0,
        }
    ).encode()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    while time.monotonic() < deadline:
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                if response.status == 200:
                    response.read()
                    return time.monotonic()
        except urllib.error.HTTPError as exc:
            if exc.code not in (404, 503):  # loading: not found yet, or not ready
                raise RuntimeError(f"{exc.code}: {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise TimeoutError("no successful completion before the deadline")


def one_start(env: dict, timeout: float) -> dict:
    """Starts the server once; returns {total, cpu, milestones: {label: s}, log: [...]}."""
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    process = subprocess.Popen(
        [*axon_command(), "serve", "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    reader = LogReader(process.stderr, start)
    reader.start()
    try:
        if not reader.port_seen.wait(timeout) or reader.port is None:
            raise RuntimeError("the server never said where it listens")
        answered = first_completion(reader.port, start + timeout) - start
        cpu_at_answer = _process_cpu(process.pid, reader.lines)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        reader.join(5)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (usage.ru_utime - usage_before.ru_utime) + (usage.ru_stime - usage_before.ru_stime)
    return {
        "total": answered,
        "cpu": cpu,
        **cpu_at_answer,
        "milestones": _milestones(reader.lines),
        "log": reader.lines,
    }


def _process_cpu(server_pid: int, lines: list[tuple[float, str]]) -> dict[str, float]:
    """{"http_cpu", "engine_cpu"}: CPU seconds (user + system) each process has used so far;
    the engine's pid is the one its log lines carry."""
    engine = next((m for _, line in lines if (m := re.search(r"engine\[(\d+)\]", line))), None)
    pids = {"http_cpu": server_pid, "engine_cpu": int(engine.group(1)) if engine else None}
    return {key: _cpu_seconds(pid) for key, pid in pids.items()}


def _cpu_seconds(pid: int | None) -> float:
    """utime + stime of `pid` from /proc (nan when it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _milestones(lines: list[tuple[float, str]]) -> dict[str, float]:
    found: dict[str, float] = {}
    for label, pattern in MILESTONES:
        hit = next((at for at, line in lines if re.search(pattern, line)), None)
        if hit is not None:
            found[label] = hit
    return found


def report(runs: list[dict], fresh: bool) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average (1/5/15 min) at the end: {load}; CPUs: {os.cpu_count()}")
    print(
        f"{'run':<12}{'first answer s':>15}{'cpu s':>7}{'http cpu':>9}{'engine cpu':>11}"
        "   breakdown (s after spawn)"
    )
    for index, run in enumerate(runs, 1):
        kind = "first-ever" if fresh and index == 1 else "warm"
        steps = ", ".join(f"{label} {at:.1f}" for label, at in run["milestones"].items())
        print(
            f"{index} {kind:<10}{run['total']:>15.2f}{run['cpu']:>7.1f}{run['http_cpu']:>9.1f}"
            f"{run['engine_cpu']:>11.1f}   {steps}"
        )
    warm = [run["total"] for run in runs[1 if fresh else 0 :]]
    if warm:
        print(f"warm starts: median {statistics.median(warm):.2f} s, best {min(warm):.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="starts to time (default 3)")
    parser.add_argument("--fresh", action="store_true", help="run 1 with an empty cache dir")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per start (600)")
    parser.add_argument("--verbose", action="store_true", help="print every log line, timed")
    args = parser.parse_args()
    env = dict(os.environ)
    fresh_dir = tempfile.mkdtemp(prefix="axon-cold-start-") if args.fresh else None
    if fresh_dir:
        env["AXON_CACHE_DIR"] = fresh_dir
    runs = []
    try:
        for _ in range(args.runs):
            runs.append(one_start(env, args.timeout))
            print(f"run {len(runs)}: {runs[-1]['total']:.2f} s", flush=True)
            for at, line in runs[-1]["log"] if args.verbose else ():
                print(f"  {at:7.2f}  {line}")
    finally:
        if fresh_dir:
            shutil.rmtree(fresh_dir, ignore_errors=True)
    report(runs, args.fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
