"""`axon serve model.gguf` spawns the model's engine before it imports the server stack, and the
registry's load takes that engine over only when it is the very engine it would start; the HTTP
process never imports torch (issue 16, cold start)."""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import httpx
import pytest
from gguf import GGMLQuantizationType as Q

from axon.cache_dir import cache_dir
from axon.config import EngineConfig
from axon.engine.client import Liveness
from axon.engine.spawn import SpawnedEngine
from axon.server.config import ServerConfig
from axon.server.lifecycle.early_engine import EarlyEngine, spawn_first_model
from axon.server.schemas.node_protocol import ModelSpec
from axon.tokenizer.gguf_tokenizer import load_gguf_tokenizer
from quant.gguf_files import build_gguf_model, write_gguf

from .conftest import spawn_serve, stop_server

ARGS = {"max_model_len": 64, "kv_cache_memory": 1 << 22}


def _spawned(source) -> SpawnedEngine:
    """A SpawnedEngine record with no process behind it (adopt reads only what it was made of)."""
    return SpawnedEngine(None, None, source, Liveness().heartbeat_s)


def test_adopted_only_when_it_is_the_engine_the_load_would_start(tmp_path):
    path = str(tmp_path / "m.gguf")
    spawned = _spawned((path, ARGS))

    assert spawned.adopt(EngineConfig.from_kwargs(path, **ARGS), Liveness(), None)
    assert not spawned.adopt(EngineConfig.from_kwargs(path, max_model_len=32), Liveness(), None)
    assert not spawned.adopt(EngineConfig.from_kwargs(path + "x", **ARGS), Liveness(), None)
    config = EngineConfig.from_kwargs(path, **ARGS)
    assert not spawned.adopt(config, Liveness(step_timeout_s=1.0), None)  # another heartbeat
    assert not spawned.adopt(config, Liveness(), {"CUDA_VISIBLE_DEVICES": "1"})


def test_claimed_once_and_only_by_its_model():
    early = EarlyEngine("a", _spawned(("m.gguf", {})))

    assert early.claim("b") is None
    assert early.claim("a") is not None
    assert early.claim("a") is None  # a recovery or a reload starts afresh
    early.discard()  # nothing left to kill


@pytest.mark.parametrize(
    "spec",
    [
        {"model_id": "org/name"},  # a repo: resolved (maybe downloaded) by the registry
        {"model_id": "relative.gguf"},
        {"model_id": "/nonexistent/model.gguf"},
        {"model_id": "/", "quant": "Q4_K_M"},  # a directory, and a quant pick
        {"model_id": __file__, "tensor_parallel": 2},
        {"model_id": __file__, "devices": [0]},
    ],
)
def test_nothing_is_spawned_for_what_the_registry_must_resolve(spec):
    config = ServerConfig().with_overrides(default_models=(ModelSpec(**spec),))

    assert spawn_first_model(config) is None


@pytest.fixture()
def tiny_gguf(tmp_path, monkeypatch) -> Path:
    """A tiny GGUF whose tokenizer is already in axon's cache (a machine it has run on)."""
    path = (tmp_path / "tiny-q8_0.gguf").resolve()
    write_gguf(build_gguf_model("qwen3"), "qwen3", Q.Q8_0, path)
    kernels = cache_dir() / "kernels"  # the machine's, before the cache moves
    monkeypatch.setenv("AXON_CACHE_DIR", str(tmp_path / "cache"))  # the server inherits it
    # The compiled C kernels are the machine's own (scripts/setup.sh builds them): an empty
    # kernel cache would have the engine compile them again (~8 CPU-s), which is not tested here.
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels, target_is_directory=True)
    load_gguf_tokenizer(path)
    return path


def _wait_for_model(server, model_id: str, deadline_s: float = 300.0) -> None:
    """Until /v1/models lists `model_id` (the log is at info level: it says "failed": [])."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert server.process.poll() is None, "axon serve exited:\n" + "".join(server.log)
        with contextlib.suppress(httpx.HTTPError):
            models = httpx.get(server.openai_url + "/models", timeout=5).json()["data"]
            if any(model["id"] == model_id for model in models):
                return
        time.sleep(0.2)
    raise AssertionError("the model did not load in time:\n" + "".join(server.log))


def test_serve_takes_over_the_early_engine_and_never_imports_torch(tiny_gguf):
    args = [str(tiny_gguf), "--port", "0", "--served-model-name", "tiny", "--dtype", "float32"]
    args += ["--max-model-len", "64", "--kv-cache-memory", "4M", "--log-level", "info"]
    server = spawn_serve(args)
    try:
        _wait_for_model(server, "tiny")
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
        reply = httpx.post(server.openai_url + "/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    finally:
        stop_server(server)
    log = "".join(server.log)
    taken = re.search(r"engine\[(\d+)\] was spawned ahead for this model: taken over", log)
    assert taken, log
    assert re.search(rf"engine\[{taken.group(1)}\] weights:", log), log  # the one that loaded
    assert "libtorch" not in maps  # the HTTP process served a request without torch
    assert "start-up cache miss" not in log
