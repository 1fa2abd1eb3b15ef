"""The Ollama API over models on demand, with the official `ollama` client against `axon serve
--models-dir`: `tags` lists a model the dir holds before it is loaded, a chat on it loads it,
`ps` shows it with its `expires_at` under keep_alive, and keep_alive 0 unloads it (Ollama's
empty request now, a request's after it is answered) while `tags` still lists it."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from tests.server.conftest import spawn_serve, stop_server, write_tiny_qwen3

ollama = pytest.importorskip("ollama")

ENGINE = ["--max-model-len", "256", "--max-num-seqs", "2", "--dtype", "float32"]
ENGINE += ["--kv-cache-memory", "8M"]
HELLO = [{"role": "user", "content": "hello"}]
SHORT = {"temperature": 0, "num_predict": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    models = tmp_path_factory.mktemp("ollama_models")
    write_tiny_qwen3(models / "alpha")
    running = spawn_serve(["--no-demo", "--port", "0", "--models-dir", str(models), *ENGINE])
    try:
        yield running
    finally:
        stop_server(running)


@pytest.fixture()
def client(server):
    return ollama.Client(host=server.base_url, timeout=120)


def running(client) -> dict:
    return {m.model: m for m in client.ps().models}


def wait_unloaded(client, name: str) -> None:
    """The idle unloader takes a keep_alive 0 model once its request has ended."""
    deadline = time.monotonic() + 30
    while name in running(client):
        assert time.monotonic() < deadline, f"{name} is still loaded"
        time.sleep(0.2)


def test_tags_chat_ps_and_keep_alive_over_a_model_on_demand(client):
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {"alpha"} and listed["alpha"].size > 0
    assert listed["alpha"].details.format == "safetensors"
    assert running(client) == {}

    answer = client.chat(model="alpha", messages=HELLO, options=SHORT, keep_alive="5m")
    assert answer.done and answer.model == "alpha"
    shown = running(client)["alpha"]
    left = shown.expires_at - datetime.now(UTC)
    assert timedelta(minutes=4) < left <= timedelta(minutes=5)

    unloaded = client.chat(model="alpha", messages=[], keep_alive=0)  # Ollama's unload
    assert unloaded.done_reason == "unload"
    assert running(client) == {} and {m.model for m in client.list().models} == {"alpha"}


def test_an_empty_request_loads_and_a_request_with_keep_alive_0_unloads_after(client):
    loaded = client.generate(model="alpha:latest")  # Ollama's load: `:latest` names it too
    assert loaded.done_reason == "load" and "alpha" in running(client)
    assert running(client)["alpha"].expires_at is None  # no --idle-unload-s, no keep_alive
    assert "completion" in client.show("alpha").capabilities

    answer = client.generate(model="alpha", prompt="hello", options=SHORT, keep_alive=0)
    assert answer.done
    wait_unloaded(client, "alpha")
    assert {m.model for m in client.list().models} == {"alpha"}


def test_keep_alive_0_on_a_model_not_loaded_loads_nothing_and_a_bad_one_is_a_400(client):
    assert client.chat(model="alpha", messages=[], keep_alive=0).done_reason == "unload"
    assert running(client) == {}
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="no-such-model", messages=[], keep_alive=0)
    assert missing.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as bad:
        client.chat(model="alpha", messages=HELLO, keep_alive="soon")
    assert bad.value.status_code == 400 and "keep_alive" in bad.value.error
    assert running(client) == {}  # refused before anything was loaded
