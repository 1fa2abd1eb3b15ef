"""`POST /models/load` against a real `axon serve` must not expose the filesystem (issue 18.1,
18.3; issue 12's 500s): local paths only under the allowed roots, one answer for a path outside
them and a missing one, no directory walk, a chat template read once off the event loop (never a
FIFO), and no local paths in `/v1/models`. One server for the whole module; every request has a
timeout, so a regression fails the test instead of hanging it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_ID, start_server, stop_server, write_tiny_qwen3

FAST_S = 5.0  # the timeout of a request that must be refused at once (a directory walk: 20 s)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(allowed, outside): the server's only allowed root, and a sibling with GGUF files in it."""
    allowed = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    for name in ("Secret-Q4_K_M.gguf", "Secret-Q8_0.gguf"):
        (outside / name).write_bytes(b"x")
    write_tiny_qwen3(allowed / "tiny")
    return allowed, outside


@pytest.fixture(scope="module")
def server(roots):
    allowed, _ = roots
    running = start_server(allowed / "tiny", env={"AXON_ALLOWED_LOCAL_MODEL_PATHS": str(allowed)})
    yield running
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
