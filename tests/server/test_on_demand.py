"""Models on demand against real `axon serve` processes: a models dir with tiny models written
here is listed without loading; a chat request loads its model (once, however many ask);
`--max-loaded-models` evicts the least recently used idle model and never one streaming;
`--idle-unload-s` unloads; unknown names are 404s that show nothing of the disk;
`--no-load-on-demand` and a load that cannot fit are refused as documented."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from gguf import GGMLQuantizationType as Q

from axon.server.lifecycle.discovery import host_memory
from quant.gguf_files import build_gguf_model, write_gguf

from .conftest import spawn_serve, stop_server, write_tiny_qwen3

MAX_MODEL_LEN = 2048
ENGINE = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2", "--dtype", "float32"]
ENGINE += ["--kv-cache-memory", "16M"]
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """alpha and beta (tiny Qwen3 folders), a tiny GGUF, an HF-cache repo org/gamma, and a
    link to a model outside the dir (never listed)."""
    root = tmp_path_factory.mktemp("models")
    write_tiny_qwen3(root / "alpha")
    shutil.copytree(root / "alpha", root / "beta")
    # In a folder of its own: its folder's files are its tokenizer's, and the root holds a link
    # out of the dir (which would keep a GGUF beside it from loading).
    (root / "gguf").mkdir()
    write_gguf(build_gguf_model("qwen3"), "qwen3", Q.Q8_0, root / "gguf" / "tiny-q8_0.gguf")
    repo = root / "models--org--gamma"
    shutil.copytree(root / "alpha", repo / "blobs")
    snapshot = repo / "snapshots" / "r1"
    snapshot.mkdir(parents=True)
    for blob in (repo / "blobs").iterdir():
        (snapshot / blob.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("r1")
    outside = tmp_path_factory.mktemp("outside")
    write_tiny_qwen3(outside / "secret")
    (root / "secret").symlink_to(outside / "secret", target_is_directory=True)
    return root


def _serve(models_dir: Path, *flags: str):
    args = ["--no-demo", "--port", "0", "--models-dir", str(models_dir), *ENGINE, *flags]
    return spawn_serve([*args, "--log-level", "info"])


@pytest.fixture()
def serve(models_dir):
    started = []

    def start(*flags: str):
        started.append(_serve(models_dir, *flags))
        return started[-1]

    yield start
    for server in started:
        stop_server(server)


def statuses(server) -> dict[str, str]:
    cards = httpx.get(server.openai_url + "/models", timeout=30).json()["data"]
    return {card["id"]: card["status"] for card in cards}


def chat(server, model: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return httpx.post(server.openai_url + "/chat/completions", json=body | extra, timeout=300)


def chat_when_loaded(server, model: str) -> httpx.Response:
    """A chat request, sent again while the server answers that the model is still loading
    (a client honouring Retry-After; the wait here is shorter than a load)."""
    deadline = time.monotonic() + 120
    while True:
        reply = chat(server, model)
        if reply.status_code != 503 or "is loading" not in reply.text:
            return reply
        assert time.monotonic() < deadline, "".join(server.log)
        time.sleep(0.5)


def log_count(server, text: str) -> int:
    return sum(text in line for line in server.log)


def test_listed_without_loading_then_loaded_once_for_concurrent_requests(serve, models_dir):
    server = serve()
    models = httpx.get(server.openai_url + "/models", timeout=30)
    assert statuses(server) == {
        "alpha": "available",
        "beta": "available",
        "tiny-q8_0": "available",
        "org/gamma": "available",
    }
    assert str(models_dir) not in models.text and "secret" not in models.text
    assert httpx.get(server.base_url + "/models", timeout=30).json() == []  # no engine
    one = httpx.get(server.openai_url + "/models/org/gamma", timeout=30).json()
    assert one["id"] == "org/gamma" and one["status"] == "available"

    client = openai.OpenAI(base_url=server.openai_url, api_key="none", max_retries=0)
    with ThreadPoolExecutor(2) as pool:
        replies = list(
            pool.map(
                lambda _: client.chat.completions.create(
                    model="alpha",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=3,
                    extra_body=EXACT,
                ),
                range(2),
            )
        )
    assert [reply.usage.completion_tokens for reply in replies] == [3, 3]
    assert log_count(server, "model alpha: loading on demand") == 1
    assert log_count(server, "model alpha loaded from") == 1
    assert statuses(server)["alpha"] == "loaded" and statuses(server)["beta"] == "available"


def test_a_gguf_file_loads_on_demand_under_its_stem(serve):
    server = serve("--max-model-len", "1024")  # the tiny GGUF's context (the last flag wins)
    body = {"model": "tiny-q8_0", "prompt": "hello", "max_tokens": 3, **EXACT}
    deadline = time.monotonic() + 300
    while True:
        reply = httpx.post(server.openai_url + "/completions", json=body, timeout=300)
        if "is loading" not in reply.text or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert reply.status_code == 200, (reply.text, "".join(server.log)[-3000:])
    assert reply.json()["model"] == "tiny-q8_0" and reply.json()["usage"]["completion_tokens"] == 3
    assert statuses(server)["tiny-q8_0"] == "loaded"


def test_unknown_models_are_404s_that_name_nothing_on_disk(serve, models_dir):
    server = serve()
    for name in ("nope", "../secret", "secret", "models--org--gamma"):
        reply = chat(server, name)
        assert reply.status_code == 404, reply.text
        error = reply.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert str(models_dir) not in reply.text and "alpha" not in reply.text
    assert log_count(server, "loading on demand") == 0


def test_the_lru_idle_model_is_evicted_never_one_streaming(serve):
    server = serve("--max-loaded-models", "1", "--on-demand-wait-s", "2")
    assert chat_when_loaded(server, "alpha").status_code == 200
    # A stream of big chunks that the test does not read: the server blocks on sending it, so
    # the request is still in flight, whatever the engine's speed. Its ~30 MB are far beyond
    # what the loopback's socket buffers take in (a few MB: 4 MB of it once all fit, and the
    # request ended before beta was asked for).
    body = {"model": "alpha", "messages": [{"role": "user", "content": "hello"}], "n": 8}
    body |= {"max_tokens": 1900, "stream": True, "logprobs": True, "top_logprobs": 20, **EXACT}
    url = server.openai_url + "/chat/completions"
    with httpx.Client(timeout=300) as http, http.stream("POST", url, json=body) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        refused = chat(server, "beta")
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        error = refused.json()["error"]
        assert error["code"] == "too_many_models", (error, "".join(server.log)[-4000:])
        assert "max_loaded_models 1" in error["message"]
        assert statuses(server) == {
            "alpha": "loaded",
            "beta": "available",
            "tiny-q8_0": "available",
            "org/gamma": "available",
        }
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if e[0] == "{"]
    assert "length" in finish  # the stream ran to its end
    assert chat_when_loaded(server, "beta").status_code == 200
    assert log_count(server, "model alpha unloaded to make room for beta") == 1
    now = statuses(server)
    assert (now["alpha"], now["beta"]) == ("available", "loaded")


def test_idle_models_are_unloaded(serve):
    server = serve("--idle-unload-s", "1")
    assert chat(server, "alpha").status_code == 200
    deadline = time.monotonic() + 120
    while statuses(server)["alpha"] != "available":
        assert time.monotonic() < deadline, "".join(server.log)
        time.sleep(0.5)
    assert log_count(server, "model alpha unloaded: idle past its keep-alive") == 1
    assert chat(server, "alpha").status_code == 200  # and a request loads it again


def test_without_load_on_demand_available_models_are_404s(serve):
    server = serve("--no-load-on-demand")
    assert statuses(server) == {}
    reply = chat(server, "alpha")
    assert reply.status_code == 404 and "--no-load-on-demand" in reply.json()["error"]["message"]


def test_a_load_that_cannot_fit_is_a_503_naming_the_memory(models_dir):
    total = host_memory()["total_bytes"]
    server = _serve(models_dir, "--kv-cache-memory", str(total))  # the last flag wins
    try:
        reply = chat(server, "alpha")
        assert reply.status_code == 503 and reply.headers["Retry-After"], reply.text
        error = reply.json()["error"]
        assert error["code"] == "insufficient_memory"
        assert "needs about" in error["message"] and "GiB" in error["message"]
        assert str(models_dir) not in reply.text
        assert log_count(server, "loaded from") == 0
    finally:
        stop_server(server)
