"""Real engine processes killed, stopped and wedged under live traffic (issue 12 points 2, 12,
15, 16; issue 18 point 7). Every stream must end with a clear error within seconds, the other
models keep answering, and the faulted model is serving again (poisoned -> recovering ->
loaded) on its own. One server for the module, with three copies of the tiny model; the last
test stops it with SIGTERM."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.faults.fleet import alive, launch, stop_fleet
from tests.server.conftest import write_tiny_qwen3

STEP_TIMEOUT_S = 4.0
GRACE_S = 3.0
NUM_STREAMS = 16
pytestmark = pytest.mark.slow  # a fleet of servers and step deadlines
LONG = {"max_tokens": 1900, "ignore_eos": True}  # far longer than any test waits


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    model_dir = write_tiny_qwen3(tmp_path_factory.mktemp("fleet") / "tiny")
    models = {"tiny-a": {"max_num_seqs": NUM_STREAMS}, "tiny-b": {}, "tiny-w": {}}
    env = {
        "AXON_ENGINE_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S),
        "AXON_DEBUG_WEDGE": "tiny-w",  # its first request wedges its engine's step
        "AXON_MAX_WAITING_REQUESTS": "32",
    }
    running = launch(model_dir, models, env, flags=["--shutdown-grace", str(GRACE_S)])
    yield running
    stop_fleet(running)


class Stream(threading.Thread):
    """One streaming completion; records when its first chunk came, how it ended and when."""

    def __init__(self, base_url: str, model: str, **extra):
        super().__init__(daemon=True)
        self.url, self.body = base_url + "/v1/completions", {"model": model, **extra}
        self.body.update(prompt="w10 w11 w12", stream=True)
        self.first_chunk = threading.Event()
        self.outcome: str | None = None  # done | error | http <status> | dropped
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as response:
                if response.status_code != 200:
                    self.outcome = f"http {response.status_code}"
                    return
                for line in response.iter_lines():
                    self.first_chunk.set()
                    if line.startswith("data: ") and '"error"' in line:
                        self.outcome = "error"
                    elif line == "data: [DONE]" and self.outcome is None:
                        self.outcome = "done"
        except httpx.HTTPError as exc:
            self.outcome = f"dropped {exc!r}"
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()


class Bystander(threading.Thread):
    """Completes short requests on another model until stopped; records every status."""

    def __init__(self, fleet, model: str):
        super().__init__(daemon=True)
        self.fleet, self.model = fleet, model
        self.statuses: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.statuses.append(self.fleet.complete(self.model, timeout=10).status_code)
            except httpx.HTTPError as exc:
                self.statuses.append(repr(exc))
            time.sleep(0.05)


def _open_streams(fleet, model: str, count: int) -> list[Stream]:
    streams = [Stream(fleet.base_url, model, **LONG) for _ in range(count)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_chunk.wait(60), "a stream never started"
    assert all(stream.outcome is None for stream in streams), [s.outcome for s in streams]
    return streams


def test_kill_9_under_live_streams(fleet):
    old_pid = fleet.engine_pid("tiny-a")
    bystander = Bystander(fleet, "tiny-b")
    bystander.start()
    streams = _open_streams(fleet, "tiny-a", NUM_STREAMS)
    killed_at = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    for stream in streams:
        stream.join(timeout=max(0.1, killed_at + 5 - time.monotonic()))
    hung = [stream for stream in streams if stream.is_alive()]
    assert not hung, f"{len(hung)} streams still open 5 s after the kill"
    assert [stream.outcome for stream in streams] == ["error"] * NUM_STREAMS
    assert max(stream.ended_at for stream in streams) - killed_at < 5
    seen = fleet.wait_loaded("tiny-a", deadline_s=30 - (time.monotonic() - killed_at))
    bystander.stop.set()
    bystander.join(15)
    assert {"poisoned", "recovering"} & set(seen), seen
    assert fleet.engine_pid("tiny-a") != old_pid and not alive(old_pid)
    assert fleet.complete("tiny-a").status_code == 200
    assert len(bystander.statuses) >= 5 and set(bystander.statuses) == {200}, bystander.statuses


def test_a_wedged_step_hits_the_deadline_and_recovers(fleet):
    old_pid = fleet.engine_pid("tiny-w")
    started = time.monotonic()
    response = fleet.complete("tiny-w", timeout=STEP_TIMEOUT_S + 30)  # its step never returns
    assert response.status_code == 503, response.text
    assert "step deadline" in response.json()["error"]["message"]
    assert time.monotonic() - started < STEP_TIMEOUT_S + 5
    fleet.wait_loaded("tiny-w", deadline_s=30)
    assert not alive(old_pid)
    assert fleet.complete("tiny-w").status_code == 200  # the hook fires once per process


def test_a_stopped_engine_is_caught_and_recovers(fleet):
    """SIGSTOP: the process is alive, its pipe open, it just never answers again."""
    old_pid = fleet.engine_pid("tiny-a")
    (stream,) = _open_streams(fleet, "tiny-a", 1)
    stopped_at = time.monotonic()
    os.kill(old_pid, signal.SIGSTOP)
    stream.join(STEP_TIMEOUT_S + 10)
    assert not stream.is_alive() and stream.outcome == "error"
    assert stream.ended_at - stopped_at < STEP_TIMEOUT_S + 5
    assert fleet.status("tiny-a") != "loaded" or fleet.engine_pid("tiny-a") != old_pid
    fleet.wait_loaded("tiny-a", deadline_s=30)
    assert not alive(old_pid)
    assert fleet.complete("tiny-a").status_code == 200


def test_streams_closed_by_the_client_free_the_engine(fleet):
    streams = []
    for _ in range(20):
        body = {"model": "tiny-a", "prompt": "w10 w11", "stream": True, **LONG}
        response = httpx.stream("POST", fleet.base_url + "/v1/completions", json=body, timeout=60)
        streams.append(response)
    for response in streams:
        lines = response.__enter__().iter_lines()
        for _ in range(3):
            next(lines)
    assert fleet.metric("axon:num_requests_running", "tiny-a") > 0
    for response in streams:
        response.__exit__(None, None, None)
    closed_at = time.monotonic()
    while fleet.metric("axon:num_requests_running", "tiny-a") > 0:
        assert time.monotonic() - closed_at < 1.0, "requests still running 1 s after the close"
        time.sleep(0.05)
    assert fleet.metric("axon:num_requests_waiting", "tiny-a") == 0
    assert fleet.metric("axon:kv_cache_usage_perc", "tiny-a") == 0


def test_sigterm_under_live_streams_drains_and_exits_0(fleet):
    streams = _open_streams(fleet, "tiny-a", NUM_STREAMS)
    engines = [fleet.engine_pid(name) for name in ("tiny-a", "tiny-b", "tiny-w")]
    fleet.process.send_signal(signal.SIGTERM)
    for stream in streams:
        stream.join(GRACE_S + 10)
    assert not any(stream.is_alive() for stream in streams)
    # Each ends cleanly: finished, or failed with an error event when the grace ran out.
    assert {stream.outcome for stream in streams} <= {"done", "error"}
    assert fleet.process.wait(GRACE_S + 20) == 0
    assert not any(alive(pid) for pid in engines)
