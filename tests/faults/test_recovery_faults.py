"""Recovery that fails, a stopped engine under /metrics, and what the logs and errors say
(issue 32 point 6), with real engine processes: a model whose file is gone when its engine is
killed is retried with backoff (recovering, with the attempt) and serves again once the file is
back, or ends `failed` with the reason; a SIGSTOPped engine leaves /metrics fast and keeps its
gauges; a killed engine's requests name the signal; `?api_key=` never reaches the access log.
One server for the module, each model in its own copy of the checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import time
from pathlib import Path

import httpx
import pytest

from tests.faults.fleet import Fleet, _inline_table, stop_fleet
from tests.server.conftest import spawn_serve, write_tiny_qwen3

pytestmark = pytest.mark.slow  # a server with engines killed, stopped and failing to start
ATTEMPTS = 3
BACKOFF_S = 1.0  # attempts at 0, +1 s, +2 s
STEP_TIMEOUT_S = 30.0  # far longer than a SIGSTOP here: the watchdog must not step in
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recovery")
    write_tiny_qwen3(root / "tiny-r")
    shutil.copytree(root / "tiny-r", root / "tiny-f")
    return {name: root / name for name in ("tiny-r", "tiny-f")}


@pytest.fixture(scope="module")
def fleet(dirs):
    specs = [{"model_id": str(path), "served_model_name": name} for name, path in dirs.items()]
    env = {
        "AXON_DEFAULT_MODELS": "[" + ", ".join(map(_inline_table, specs)) + "]",
        "AXON_ENGINE_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S),
        "AXON_RECOVERY_ATTEMPTS": str(ATTEMPTS),
        "AXON_RECOVERY_BACKOFF_S": str(BACKOFF_S),
    }
    args = ["--port", "0", "--no-demo", "--max-model-len", "2048", "--dtype", "float32"]
    args += ["--kv-cache-memory", "32M", "--log-level", "info"]  # info: the access log
    running = spawn_serve(args, env, kind=Fleet, stdout_too=True)
    try:
        for name in dirs:
            running.wait_loaded(name, 180)
        yield running
    finally:
        stop_fleet(running)


def _poll(what, deadline_s: float, step_s: float = 0.05):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(step_s)
    raise AssertionError(f"not within {deadline_s}s")


def test_the_access_log_never_holds_a_query_secret(fleet):
    url = fleet.base_url + "/v1/models?api_key=sk-SECRET-1&Token=tok-SECRET-2&limit=1"
    assert httpx.get(url, timeout=10).status_code == 200
    line = _poll(lambda: next((x for x in fleet.log if "GET /v1/models?" in x), None), 10)
    assert "api_key=REDACTED" in line and "Token=REDACTED" in line and "limit=1" in line
    assert "SECRET" not in "".join(fleet.log)


def _scrape(fleet) -> tuple[float, str]:
    started = time.monotonic()
    text = httpx.get(fleet.base_url + "/metrics", timeout=30).text
    return time.monotonic() - started, text


def test_metrics_answer_at_once_while_an_engine_is_stopped(fleet):
    idle = statistics.median(_scrape(fleet)[0] for _ in range(5))
    pid = fleet.engine_pid("tiny-r")
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(3.5)  # two heartbeats and a second: the engine is known silent
        elapsed, text = _scrape(fleet)
    finally:
        os.kill(pid, signal.SIGCONT)
    # The old scrape waited out its 2 s bound on the stopped engine and dropped its gauges.
    assert elapsed < 1.0 + 10 * idle, (elapsed, idle)
    assert 'axon:num_requests_running{model_name="tiny-r"}' in text
    assert 'axon:model_state{model_name="tiny-r",state="unresponsive"} 1.0' in text
    assert 'axon:model_state{model_name="tiny-f",state="loaded"} 1.0' in text
    loaded = 'axon:model_state{model_name="tiny-r",state="loaded"} 1.0'
    _poll(lambda: loaded in _scrape(fleet)[1], 10, step_s=0.5)


def _stream_error(fleet, model: str, started) -> str:
    """Opens a long stream on `model`, calls `started()` once its first chunk came, and
    returns the error event that ends it."""
    body = {"model": model, "prompt": "w10 w11", "max_tokens": 1900, "ignore_eos": True}
    url = fleet.base_url + "/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if started is not None:
                started()
                started = None
            if '"error"' in line:
                return line
    raise AssertionError("the stream ended without an error")


def test_a_failed_recovery_is_retried_until_the_file_is_back(fleet, dirs):
    weights, aside = dirs["tiny-r"] / WEIGHTS, dirs["tiny-r"] / (WEIGHTS + ".aside")
    pid = fleet.engine_pid("tiny-r")

    def break_and_kill() -> None:
        weights.rename(aside)  # every recovery start fails while it is away
        os.kill(pid, signal.SIGKILL)

    error = _stream_error(fleet, "tiny-r", break_and_kill)
    assert "killed by SIGKILL" in error, error  # never "exit code None"
    info = _poll(lambda: _recovering_with_error(fleet, "tiny-r"), 120)
    aside.rename(weights)
    assert info["recovery_attempt"] >= 1 and info["recovery_attempts"] == ATTEMPTS
    assert f"of {ATTEMPTS} failed" in info["error"], info
    fleet.wait_loaded("tiny-r", 120)
    assert fleet.complete("tiny-r").status_code == 200
    assert fleet.models()["tiny-r"]["error"] is None


def _recovering_with_error(fleet, model: str) -> dict | None:
    info = fleet.models().get(model)
    assert info is not None, "the model was dropped after a failed recovery"
    return info if info["status"] == "recovering" and info["error"] else None


def test_a_recovery_that_keeps_failing_ends_failed_with_the_reason(fleet, dirs):
    (dirs["tiny-f"] / WEIGHTS).unlink()
    os.kill(fleet.engine_pid("tiny-f"), signal.SIGKILL)
    seen = set()

    def failed() -> dict | None:
        info = fleet.models().get("tiny-f")
        assert info is not None, f"tiny-f was dropped (statuses seen: {seen})"
        seen.add((info["status"], info.get("recovery_attempt")))
        return info if info["status"] == "failed" else None

    info = _poll(failed, 180)
    assert ("recovering", 2) in seen or ("recovering", 3) in seen, seen
    assert info["recovery_attempt"] == ATTEMPTS and f"{ATTEMPTS} of {ATTEMPTS}" in info["error"]
    refused = fleet.complete("tiny-f")
    assert refused.status_code == 503 and "failed" in refused.json()["error"]["message"]
    health = httpx.get(fleet.base_url + "/health", timeout=10).json()["models"]
    assert next(m for m in health if m["id"] == "tiny-f")["status"] == "failed"
    unloaded = httpx.post(fleet.base_url + "/models/unload", json={"model_id": "tiny-f"})
    assert unloaded.status_code == 200 and "tiny-f" not in fleet.models()
