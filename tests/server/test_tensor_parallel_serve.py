"""Tensor parallelism through `axon serve`: a TP=2 copy of the tiny model loaded over HTTP
answers greedy requests exactly as the TP=1 one does; kill -9 of its rank 1, or a rank that
hangs past the step deadline, fails the model over to a fresh rank group (poisoned/recovering,
then loaded), leaves no rank process or rendezvous directory behind, and serving resumes.

One server for the module (each start costs a serve process, an engine and its ranks): every
test loads the TP models it needs under its own names, the wedge hook names only its own."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import MODEL_ID, start_server, stop_server

pytestmark = pytest.mark.slow
TP_ID = "tiny-tp2"
WEDGED_ID = "tiny-tp2-wedged"  # the only model whose rank 1 hangs (once per server)
STEP_TIMEOUT_S = 5
FIRED: set[str] = set()  # wedged models whose hook has fired: plain TP=2 copies since
LOADING: dict[str, Future] = {}  # TP=2 copies a test started loading in the background


def _complete(base_url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "w10 w11 w12", "max_tokens": 8, "temperature": 0}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=120)


def _entry(base_url: str, model: str = TP_ID) -> dict | None:
    models = httpx.get(base_url + "/models", timeout=10).json()
    return next((m for m in models if m["id"] == model), None)


def _spawned_children(pid: int) -> list[int]:
    """Pids of the rank programs `pid` started (its tensor-parallel ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if (
                int(stat.rsplit(")", 1)[1].split()[1]) == pid
                and b"axon.distributed.rank" in cmdline
            ):
                found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def tp_server(tiny_chat_model):
    env = {"AXON_TP_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S), "AXON_DEBUG_TP_WEDGE": WEDGED_ID}
    server = start_server(tiny_chat_model, env)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def background(tp_server):
    """A thread for loads started in the background (waited for before the server stops)."""
    with ThreadPoolExecutor(1) as pool:
        yield pool


def _load_tp(base_url: str, model_dir, name: str = TP_ID) -> None:
    """Loads the TP=2 copy `name` unless an earlier test of the module already did (or started
    loading it in the background: then waits for that load)."""
    if name in LOADING:
        LOADING.pop(name).result()
    _load_tp_now(base_url, model_dir, name)


def _load_tp_now(base_url: str, model_dir, name: str) -> None:
    if _entry(base_url, name) is not None:
        return
    spec = {"model_id": str(model_dir), "served_model_name": name, "tensor_parallel": 2}
    loaded = httpx.post(base_url + "/models/load", json=spec, timeout=300)
    assert loaded.status_code == 200, loaded.text


def _wait_recovered(base_url: str, engine_pid: int, name: str = TP_ID) -> tuple[set, dict]:
    """The statuses seen until a new engine serves the model, and its entry."""
    seen, deadline = set(), time.monotonic() + 180
    while time.monotonic() < deadline:
        entry = _entry(base_url, name)
        status = entry and entry["status"]
        seen.add(status)
        if status == "loaded" and entry["engine_pid"] != engine_pid:
            break
        time.sleep(0.1)
    return seen, entry


def _gone(pid: int) -> bool:
    """Not running: absent, or a zombie waiting for its reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_wedged_rank_trips_the_step_deadline(tp_server, tiny_chat_model, background):
    url = tp_server.base_url
    _load_tp(url, tiny_chat_model, WEDGED_ID)
    # The wedged step leaves this test idle for the whole deadline: the next test's TP copy
    # loads meanwhile (in its own engine and ranks, which the wedge hook does not name).
    LOADING[TP_ID] = background.submit(_load_tp_now, url, tiny_chat_model, TP_ID)
    engine_pid = _entry(url, WEDGED_ID)["engine_pid"]
    (rank1,) = _spawned_children(engine_pid)
    stores = list(Path(tempfile.gettempdir()).glob(f"axon-tp-{engine_pid}-*"))
    assert len(stores) == 1, stores

    started = time.monotonic()
    wedged = _complete(url, WEDGED_ID)  # rank 1 never answers this step
    FIRED.add(WEDGED_ID)
    assert wedged.status_code == 503, wedged.text
    assert "deadline" in wedged.text or "gloo" in wedged.text.lower(), wedged.text
    assert time.monotonic() - started < STEP_TIMEOUT_S + 30

    seen, entry = _wait_recovered(url, engine_pid, WEDGED_ID)
    assert seen & {"poisoned", "recovering", None}, seen
    assert entry["status"] == "loaded" and entry["engine_pid"] != engine_pid, entry
    assert _gone(engine_pid) and _gone(rank1)
    assert not stores[0].exists()  # swept by the new engine's start
    again = _complete(url, WEDGED_ID)  # the hook fires once per server
    assert again.status_code == 200, again.text


def _open_stream(base_url: str, model: str):
    """A long greedy stream through the official openai client, started and first chunk read;
    returns (the stream, a function that reads it to its end: ("done" | the error, seconds))."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model=model, prompt="w1 w2", max_tokens=1500, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))

    def drain(started: float) -> tuple[str, float]:
        try:
            for _chunk in stream:
                pass
        except Exception as exc:  # noqa: BLE001 - the error the client surfaces is the point
            return repr(exc), time.monotonic() - started
        return "done", time.monotonic() - started

    return stream, drain


def test_tp2_over_http_matches_tp1_and_recovers_from_a_dead_rank(tp_server, tiny_chat_model):
    server = tp_server
    _load_tp(server.base_url, tiny_chat_model)
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)

    def complete(model: str) -> str:
        reply = client.completions.create(
            model=model, prompt="w10 w11 w12", max_tokens=8, temperature=0
        )
        return reply.choices[0].text

    want = complete(MODEL_ID)
    assert complete(TP_ID) == want

    engine_pid = _entry(server.base_url)["engine_pid"]
    ranks = _spawned_children(engine_pid)
    assert len(ranks) == 1, ranks
    (rank1,) = ranks
    streams = [_open_stream(server.base_url, TP_ID) for _ in range(2)]  # mid-stream
    with ThreadPoolExecutor(len(streams)) as pool:
        killed_at = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        ends = list(pool.map(lambda s: s[1](killed_at), streams))
    for outcome, seconds in ends:
        assert outcome != "done" and seconds < 10, (outcome, seconds)
    seen, entry = _wait_recovered(server.base_url, engine_pid)
    assert entry is not None, "the model was dropped:\n" + "".join(server.log)
    assert _gone(rank1)
    assert seen & {"poisoned", "recovering", None}, seen
    assert entry["status"] == "loaded" and entry["engine_pid"] != engine_pid, entry
    assert complete(TP_ID) == want


def test_two_tp_models_at_once_on_one_host(tp_server, tiny_chat_model):
    """Each engine has its own rank group and rendezvous: both load, both answer (at the same
    time), greedy equal to the TP=1 model."""
    server = tp_server
    # The wedged model, recovered, is a plain TP=2 copy: reusing it saves an engine and a rank.
    names = (TP_ID, WEDGED_ID if WEDGED_ID in FIRED else "tiny-tp2-b")
    for name in names:
        _load_tp(server.base_url, tiny_chat_model, name)
    want = _complete(server.base_url, MODEL_ID).json()["choices"][0]["text"]
    with ThreadPoolExecutor(len(names)) as pool:
        replies = list(pool.map(lambda name: _complete(server.base_url, name), names))
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == want
    engine_pids = [_entry(server.base_url, name)["engine_pid"] for name in names]
    assert len(set(engine_pids)) == 2
    for pid in engine_pids:
        assert len(_spawned_children(pid)) == 1  # its own rank 1
        assert len(list(Path(tempfile.gettempdir()).glob(f"axon-tp-{pid}-*"))) == 1
