"""A real `axon serve` process: startup activation, API-key enforcement, two models loaded and
unloaded independently while requests run, and SIGTERM draining to exit status 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

KEY = "lifecycle-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
_SRC = Path(__file__).resolve().parents[2] / "src"
ENGINE_FLAGS = ["--kv-cache-memory", "4M", "--dtype", "float32", "--max-num-seqs", "4"]


@dataclass
class Node:
    process: subprocess.Popen
    url: str
    log: list[str]

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)


def start_node(args: list[str], env_extra: dict[str, str]) -> Node:
    """`axon serve ARGS` on a free loopback port; returns once it listens."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_SRC), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "axon", "serve", "--port", "0", "--log-level", "warning"]
    process = subprocess.Popen(
        [*command, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    log: list[str] = []
    listening = threading.Event()

    def read() -> None:
        for line in process.stderr:
            log.append(line)
            if "listening on http://" in line:
                listening.set()

    threading.Thread(target=read, daemon=True).start()
    if not listening.wait(120):
        process.kill()
        raise AssertionError("axon serve did not start:\n" + "".join(log))
    url = re.search(r"listening on (http://\S+)", "".join(log)).group(1)
    return Node(process, url, log)


def stop_node(node: Node) -> None:
    if node.process.poll() is None:
        node.process.send_signal(signal.SIGTERM)
        try:
            node.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait(10)


def wait_ready(http: httpx.Client, deadline_s: float = 120.0) -> dict:
    """Polls /health until the startup loads are done; returns the activation."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        activation = http.get("/health").json()["activation"]
        if activation["state"] == "ready":
            return activation
        time.sleep(0.1)
    raise AssertionError("activation never became ready")


def load_spec(model_dir: Path, name: str) -> dict:
    return {"model_id": str(model_dir), "served_model_name": name, "max_model_len": 256}


def complete(http: httpx.Client, model: str, max_tokens: int = 48) -> httpx.Response:
    body = {"model": model, "prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True}
    return http.post("/v1/completions", json=body, headers=AUTH)


@dataclass
class Traffic:
    """Requests to one model, back to back on a thread, each recorded as (start, end, status)."""

    http: httpx.Client
    model: str
    records: list[tuple[float, float, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Traffic:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        while not self.records:  # at least one finished before the test goes on
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            response = complete(self.http, self.model)
            tokens = response.json()["usage"]["completion_tokens"] if response.is_success else 0
            status = response.status_code if tokens in (0, 48) else -1
            self.records.append((start, time.monotonic(), status))

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)

    def overlapping(self, start: float, end: float) -> list[int]:
        return [status for s, e, status in self.records if s < end and e > start]


@pytest.fixture(scope="module")
def node(tiny_chat_model: Path):
    env = {
        "AXON_API_KEY": KEY,
        "AXON_DEFAULT_MODELS": '[{model_id = "/nonexistent/model"}]',
        "AXON_ALLOWED_LOCAL_MODEL_PATHS": str(tiny_chat_model),  # for the load over HTTP
    }
    args = [str(tiny_chat_model), "--served-model-name", "a", "--max-model-len", "256"]
    running = start_node([*args, *ENGINE_FLAGS], env)
    yield running
    stop_node(running)


def test_activation_after_bind(node: Node):
    with node.client() as http:
        activation = wait_ready(http)  # /health answered before (and while) loading
    assert activation["completed"] == ["a"]
    (failure,) = activation["failed"]
    assert failure["model_id"] == "/nonexistent/model" and "does not exist" in failure["error"]


def test_api_key_enforced(node: Node):
    with node.client() as http:
        wait_ready(http)
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code != 401
        for path in ("/models", "/discovery", "/v1/models"):
            assert http.get(path).status_code == 401
            assert http.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
            assert http.get(path, headers=AUTH).status_code == 200
        assert http.post("/models/unload", json={"model_id": "a"}).status_code == 401
        assert complete(http, "a").status_code == 200
        plain = {"model": "a", "prompt": "hello", "max_tokens": 2}
        assert http.post("/v1/completions", json=plain).status_code == 401


def test_two_models_load_and_unload_independently(node: Node, tiny_chat_model: Path):
    with node.client(headers=AUTH) as http:
        wait_ready(http)
        with Traffic(http, "a") as on_a:
            started = time.monotonic()
            response = http.post("/models/load", json=load_spec(tiny_chat_model, "b"))
            loaded = time.monotonic()
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "loaded"
        during_load = on_a.overlapping(started, loaded)
        assert len(during_load) >= 2 and set(during_load) == {200}, on_a.records
        assert {r[2] for r in on_a.records} == {200}
        models = {m["id"]: m["status"] for m in http.get("/models").json()}
        assert models == {"a": "loaded", "b": "loaded"}

        long_a = threading.Thread(target=lambda: results.append(complete(http, "a", 200)))
        results: list[httpx.Response] = []
        with Traffic(http, "b") as on_b:
            long_a.start()
            time.sleep(0.05)  # the long request is in flight when the unload starts
            started = time.monotonic()
            response = http.post("/models/unload", json={"model_id": "a"})
            unloaded = time.monotonic()
            long_a.join(60)
        assert response.json() == {"status": "unloaded", "model_id": "a"}
        (finished,) = results  # drained, not cut off
        assert finished.status_code == 200
        assert finished.json()["usage"]["completion_tokens"] == 200
        assert set(on_b.overlapping(started, unloaded)) == {200}
        assert {r[2] for r in on_b.records} == {200}
        assert complete(http, "a").status_code == 404
        assert [m["id"] for m in http.get("/models").json()] == ["b"]
        assert http.get("/models/b/endpoint").json() == {"url": node.url}


def test_sigterm_drains_and_exits_zero(tiny_chat_model: Path):
    args = [str(tiny_chat_model), "--served-model-name", "a", "--max-model-len", "1024"]
    node = start_node([*args, *ENGINE_FLAGS, "--shutdown-grace", "20"], {})
    try:
        with node.client() as http:
            wait_ready(http)
            body = {"model": "a", "prompt": "hello", "max_tokens": 1000, "ignore_eos": True}
            body["stream"] = True
            with http.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["object"] == "text_completion"
                node.process.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                refused = http.get("/v1/models")
                assert refused.status_code == 503 and refused.headers["retry-after"]
                assert http.get("/health").json()["status"] == "shutting_down"
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            final = json.loads(rest[-2][6:])["choices"][0]
            assert final["finish_reason"] == "length"  # the request ran to its end
        assert node.process.wait(60) == 0, "".join(node.log)
    finally:
        stop_node(node)
