"""An injected device fault in a real server: the request fails cleanly, the model shows
poisoned/recovering, a fresh engine process replaces the faulted one, and serving resumes."""

from __future__ import annotations

import time

import httpx

from .conftest import MODEL_ID, start_server, stop_server


def _status(base_url: str) -> str | None:
    models = httpx.get(base_url + "/models", timeout=10).json()
    return next((m["status"] for m in models if m["id"] == MODEL_ID), None)


def _complete(base_url: str) -> httpx.Response:
    body = {"model": MODEL_ID, "prompt": "w10 w11 w12", "max_tokens": 3}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=60)


def test_injected_device_fault_poisons_then_recovers(tiny_chat_model):
    server = start_server(tiny_chat_model, env={"AXON_DEBUG_POISON": MODEL_ID})
    try:
        failed = _complete(server.base_url)
        assert failed.status_code == 503, failed.text
        error = failed.json()["error"]
        assert "illegal memory access" in error["message"]
        seen = {_status(server.base_url)}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _status(server.base_url) != "loaded":
            seen.add(_status(server.base_url))
            time.sleep(0.1)
        assert seen & {"poisoned", "recovering"}, seen
        assert _status(server.base_url) == "loaded"
        recovered = _complete(server.base_url)
        assert recovered.status_code == 200, recovered.text
        assert len(recovered.json()["choices"][0]["text"]) > 0
    finally:
        stop_server(server)
    assert server.process.returncode == 0
