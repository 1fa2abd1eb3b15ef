"""`POST /models/load` against a real `axon serve` must not expose the filesystem (issue 18.1,
18.3; issue 12's 500s; issue 32.4): local paths only under the allowed roots, one answer for a
path outside them and a missing one, no directory walk, a chat template read once off the event
loop (never a FIFO) and only as text or from the model's own folder, no symlink in a model folder
followed out of the roots, the working directory no root unless named, and no local paths in
`/v1/models`. One server for the whole module, on the default roots (its HF cache is the allowed
directory), started in a working directory that holds a model and a secret; every request has a
timeout, so a regression fails the test instead of hanging it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import (
    MODEL_ID,
    _serve_args,
    _wait_until_serving,
    spawn_serve,
    stop_server,
    write_tiny_qwen3,
)

FAST_S = 5.0  # the timeout of a request that must be refused at once (a directory walk: 20 s)
LOAD_S = 180.0  # a load that must succeed: an engine process starts
SECRET = "hello world tell me a story"  # words the tiny tokenizer knows: it would round-trip


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(allowed, outside): the server's only allowed root, and a sibling with GGUF files in it."""
    allowed = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    for name in ("Secret-Q4_K_M.gguf", "Secret-Q8_0.gguf"):
        (outside / name).write_bytes(b"x")
    (outside / "secret.txt").write_text(SECRET)
    write_tiny_qwen3(allowed / "tiny")
    return allowed, outside


@pytest.fixture(scope="module")
def workdir(roots, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's working directory: a model and a secret, neither of them under a root."""
    allowed, _ = roots
    workdir = tmp_path_factory.mktemp("workdir")
    shutil.copytree(allowed / "tiny", workdir / "tiny")
    (workdir / "secret.txt").write_text(SECRET)
    return workdir


@pytest.fixture(scope="module")
def server(roots, workdir):
    allowed, _ = roots
    # The default roots: the HF cache (the allowed directory here) and axon's model cache.
    running = spawn_serve(
        _serve_args(allowed / "tiny"), {"HF_HUB_CACHE": str(allowed)}, cwd=workdir
    )
    try:
        _wait_until_serving(running)
        yield running
    finally:
        stop_server(running)


def load(server, timeout: float = FAST_S, **spec) -> httpx.Response:
    return httpx.post(server.base_url + "/models/load", json=spec, timeout=timeout)


def test_paths_outside_the_roots_are_refused_at_once_and_alike(server, roots):
    allowed, outside = roots
    hostile = ["/etc", "/", "/proc/1/root", "~root", "x" * 5000, "/" + "y" * 5000, "etc"]
    for model_id in hostile:
        response = load(server, model_id=model_id, served_model_name="h")
        assert 400 <= response.status_code < 500, (model_id[:40], response.text)
        assert response.json()["error"]["param"] == "model_id"
    # Existing outside, missing outside, missing inside, `..` out of the root: one message.
    probes = [outside, outside / "missing", allowed / "missing", allowed / ".." / outside.name]
    messages = set()
    for path in probes:
        response = load(server, model_id=str(path), quant="Q4_K_M", served_model_name="p")
        error = response.json()["error"]
        assert (response.status_code, error["code"]) == (400, "model_path_not_allowed")
        assert "Secret" not in response.text  # no GGUF file found outside is listed
        messages.add(error["message"].replace(repr(str(path)), "PATH"))
    assert len(messages) == 1, messages


def test_chat_template_outside_the_roots_is_refused(server, roots):
    allowed, _ = roots
    spec = {"model_id": str(allowed / "tiny"), "served_model_name": "passwd"}
    response = load(server, chat_template="/etc/passwd", **spec)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template" and "root:" not in response.text
    models = httpx.get(server.openai_url + "/models", timeout=FAST_S).json()["data"]
    assert [model["id"] for model in models] == [MODEL_ID]


def test_a_fifo_chat_template_is_refused_while_health_answers(server, roots):
    allowed, _ = roots
    fifo = allowed / "template.jinja"
    os.mkfifo(fifo)
    spec = {"model_id": str(allowed / "tiny"), "served_model_name": "fifo"}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            loading = pool.submit(load, server, 10.0, chat_template=str(fifo), **spec)
            health = httpx.get(server.base_url + "/health", timeout=FAST_S)
            assert health.status_code == 200
            response = loading.result()
    finally:
        _release(fifo)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template"
    assert httpx.get(server.base_url + "/health", timeout=FAST_S).status_code == 200


def _release(fifo: Path) -> None:
    """Unblocks a server that opened the FIFO for reading (the bug), so it can be stopped."""
    with contextlib.suppress(OSError):  # ENXIO: no reader, nothing is blocked on it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_v1_models_shows_no_local_path(server, roots):
    allowed, _ = roots
    for url in ("/v1/models", f"/v1/models/{MODEL_ID}"):
        response = httpx.get(server.base_url + url, timeout=FAST_S)
        assert response.status_code == 200
        assert str(allowed) not in response.text and "/tmp" not in response.text
    card = httpx.get(server.base_url + f"/v1/models/{MODEL_ID}", timeout=FAST_S).json()
    assert card["root"] == MODEL_ID


# ---- issue 32.4: the node API is not a file reader ---------------------------------------------


def _model_copy(allowed: Path, name: str) -> Path:
    copy = allowed / name
    shutil.copytree(allowed / "tiny", copy)
    return copy


@pytest.mark.parametrize(
    "linked", ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json"]
)
def test_a_symlink_out_of_the_roots_in_a_model_folder_is_refused(server, roots, linked):
    allowed, outside = roots
    folder = _model_copy(allowed, f"linked-{linked.replace('.', '-')}")
    (folder / linked).unlink(missing_ok=True)
    (folder / linked).symlink_to(outside / "secret.txt")
    response = load(server, model_id=str(folder), served_model_name="linked")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_path_not_allowed", "model_id")
    assert SECRET not in response.text and str(outside) not in response.text
    assert "linked" not in _node_models(server)


def test_a_shard_an_index_names_out_of_the_roots_is_refused(server, roots):
    allowed, outside = roots
    folder = _model_copy(allowed, "indexed")
    index = {"weight_map": {"lm_head.weight": f"../../{outside.name}/secret.txt"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    response = load(server, model_id=str(folder), served_model_name="indexed")
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "model_id"


def test_the_working_directory_is_no_root_by_default(server, workdir):
    for model_id in ("./tiny", str(workdir / "tiny")):
        response = load(server, model_id=model_id, served_model_name="cwd")
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "model_path_not_allowed"
    assert _node_models(server) == [MODEL_ID]


def test_a_chat_template_outside_the_model_folder_is_refused(server, roots, workdir):
    allowed, outside = roots
    (allowed / "beside.jinja").write_text(SECRET)
    spec = {"model_id": str(allowed / "tiny"), "served_model_name": "beside"}
    names = [
        str(allowed / "beside.jinja"),  # under the allowed root, but no file of the model's
        "../beside.jinja",
        "./secret.txt",  # the working directory
        str(workdir / "secret.txt"),
        str(outside / "secret.txt"),
    ]
    messages = set()
    for name in names:
        response = load(server, chat_template=name, **spec)
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("model_path_not_allowed", "chat_template")
        assert SECRET not in response.text
        messages.add(error["message"].replace(repr(name), "NAME"))
    assert len(messages) == 1, messages  # existing or not, inside a root or not: one answer
    assert _node_models(server) == [MODEL_ID]


def test_template_text_and_a_template_file_in_the_model_folder_work(server, roots):
    allowed, _ = roots
    folder = _model_copy(allowed, "own-template")
    (folder / "custom.jinja").write_text(
        "tell me {% for m in messages %}{{ m.content }}{% endfor %}"
    )
    cases = {
        "text": (
            "hello world {% for m in messages %}{{ m.content }}{% endfor %}",
            "hello world story",
        ),
        "file": ("custom.jinja", "tell me story"),
    }
    for served, (template, rendered) in cases.items():
        response = load(
            server, LOAD_S, model_id=str(folder), served_model_name=served, chat_template=template
        )
        assert response.status_code == 200, response.text
        try:
            assert _round_trip(server, served) == rendered
        finally:
            httpx.post(server.base_url + "/models/unload", json={"model_id": served}, timeout=60)


def _round_trip(server, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "story"}]}
    body["add_generation_prompt"] = False
    tokens = httpx.post(server.base_url + "/tokenize", json=body, timeout=FAST_S).json()["tokens"]
    body = {"model": model, "tokens": tokens}
    return httpx.post(server.base_url + "/detokenize", json=body, timeout=FAST_S).json()["prompt"]


def _node_models(server) -> list[str]:
    return [model["id"] for model in httpx.get(server.base_url + "/models", timeout=FAST_S).json()]
