"""The registry's models on demand with fake engines (no model, no torch): one load per model,
least-recently-used eviction that never takes a model in use, the memory check's 503, idle
unload and keep_alive, and the 404s."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from axon.server.config import ServerConfig
from axon.server.errors import ModelNotFound, ModelUnavailable
from axon.server.lifecycle import on_demand
from axon.server.lifecycle.registry import ModelRegistry
from axon.server.schemas.node_protocol import ModelSpec


class FakeModel:
    def __init__(self, model_id: str):
        self.id, self.status, self.num_inflight = model_id, "loaded", 0
        self.on_poisoned = None
        self.stopped = False

    async def shutdown(self, grace_s: float) -> None:
        self.stopped = True


class Fakes:
    """A registry over a models dir holding `names` (.gguf files), with fake engines."""

    def __init__(self, tmp_path: Path, names=("a", "b", "c"), **config):
        root = tmp_path / "models"
        root.mkdir()
        for name in names:
            (root / f"{name}.gguf").write_bytes(b"\0" * 64)
        self.starts: list[str] = []
        self.gate: asyncio.Event | None = None
        config = {"models_dirs": (str(root),), **config}
        self.registry = ModelRegistry(
            ServerConfig(**config),
            starter=self.start,
            resolver=lambda spec, *_, **__: Path(spec.model_id),
        )

    async def start(self, model_id, *args, **kwargs):
        self.starts.append(model_id)
        if self.gate is not None:
            await self.gate.wait()
        return FakeModel(model_id)


def run(coroutine):
    return asyncio.run(coroutine)


def test_listing_without_loading_then_one_load_for_concurrent_requests(tmp_path):
    fakes = Fakes(tmp_path)
    registry = fakes.registry

    async def scenario():
        rows = await registry.listing()
        assert sorted((r["id"], r["status"], r["format"]) for r in rows) == [
            (name, "available", "gguf") for name in ("a", "b", "c")
        ]
        assert all(r["status"] == "available" and "path" not in r for r in rows)
        assert fakes.starts == []
        fakes.gate = asyncio.Event()
        first = asyncio.ensure_future(registry.ensure("a"))
        second = asyncio.ensure_future(registry.ensure("a"))
        await asyncio.sleep(0.05)
        assert {r["id"]: r["status"] for r in await registry.listing()}["a"] == "loading"
        fakes.gate.set()
        one, two = await asyncio.gather(first, second)
        assert one is two and fakes.starts == ["a"]
        assert {r["id"]: r["status"] for r in await registry.listing()}["a"] == "loaded"

    run(scenario())


def test_a_request_past_the_wait_gets_503_and_the_load_goes_on(tmp_path):
    fakes = Fakes(tmp_path, on_demand_wait_s=0.05)

    async def scenario():
        fakes.gate = asyncio.Event()
        with pytest.raises(ModelUnavailable) as raised:
            await fakes.registry.ensure("a")
        assert raised.value.headers["Retry-After"] and "loading" in raised.value.message
        fakes.gate.set()
        await asyncio.sleep(0.05)
        assert (await fakes.registry.ensure("a")).id == "a" and fakes.starts == ["a"]

    run(scenario())


def test_the_least_recently_used_idle_model_is_evicted(tmp_path):
    fakes = Fakes(tmp_path, max_loaded_models=2)
    registry = fakes.registry

    async def scenario():
        a = await registry.ensure("a")
        b = await registry.ensure("b")
        registry.touch("a")  # a is used after b: b is the least recently used
        await registry.ensure("c")
        assert b.stopped and not a.stopped
        assert sorted(registry.model_ids()) == ["a", "c"]
        statuses = {r["id"]: r["status"] for r in await registry.listing()}
        assert statuses == {"a": "loaded", "c": "loaded", "b": "available"}

    run(scenario())


def test_a_model_in_use_is_never_evicted(tmp_path):
    fakes = Fakes(tmp_path, max_loaded_models=1, on_demand_wait_s=2.0)
    registry = fakes.registry

    async def scenario():
        a = await registry.ensure("a")
        a.num_inflight = 1  # a request streams from it
        refused = asyncio.ensure_future(registry.ensure("b"))
        while "b" not in registry._room_problems:  # its load waits for room
            await asyncio.sleep(0.01)
        with pytest.raises(ModelUnavailable) as raised:
            await refused
        assert raised.value.code == "too_many_models" and raised.value.headers["Retry-After"]
        assert "max_loaded_models 1" in raised.value.message
        while "b" in registry._pending:  # its load gives up too
            await asyncio.sleep(0.01)
        assert not a.stopped and registry.model_ids() == ["a"]
        waiting = asyncio.ensure_future(registry.ensure("b"))
        await asyncio.sleep(0.1)
        a.num_inflight = 0  # its request ended: now it may go
        assert (await waiting).id == "b" and a.stopped

    run(scenario())


def test_a_load_that_cannot_fit_is_a_503_naming_the_memory(tmp_path, monkeypatch):
    fakes = Fakes(tmp_path)
    monkeypatch.setattr(on_demand, "free_memory", lambda *args: 32)

    async def scenario():
        with pytest.raises(ModelUnavailable) as raised:
            await fakes.registry.ensure("a")
        return raised.value

    error = run(scenario())
    assert error.status_code == 503 and error.code == "insufficient_memory"
    assert "needs about 0.00 GiB" in error.message and str(tmp_path) not in error.message
    assert fakes.starts == []


def test_unknown_models_are_404s_that_name_no_path(tmp_path):
    fakes = Fakes(tmp_path)

    async def scenario():
        for name in ("nope", "../models/a", str(tmp_path / "models" / "a.gguf")):
            with pytest.raises(ModelNotFound) as raised:
                await fakes.registry.ensure(name)
            assert str(tmp_path) not in raised.value.message.replace(name, "")

    run(scenario())
    assert fakes.starts == []


def test_without_load_on_demand_an_available_model_is_a_404_that_says_so(tmp_path):
    fakes = Fakes(tmp_path, load_on_demand=False)

    async def scenario():
        with pytest.raises(ModelNotFound, match="--no-load-on-demand"):
            await fakes.registry.ensure("a")
        return await fakes.registry.listing()

    assert run(scenario()) == []  # nothing is listed that a request could not load
    assert fakes.starts == []


def test_idle_models_unload_after_their_keep_alive(tmp_path):
    fakes = Fakes(tmp_path, idle_unload_s=60.0)
    registry = fakes.registry

    async def scenario():
        a = await registry.ensure("a")
        b = await registry.ensure("b")
        assert registry._expired() == []
        registry._entries["a"].last_used -= 61  # unused for over a minute
        registry.touch("b", keep_alive_s=0)  # Ollama's keep_alive 0: unload once idle
        assert sorted(registry._expired()) == ["a", "b"]
        b.num_inflight = 1
        assert registry._expired() == ["a"]  # never under a request
        registry.touch("a", keep_alive_s=-1)  # kept loaded
        assert registry._expired() == []
        registry.start_idle_unloader()
        b.num_inflight = 0
        await asyncio.sleep(on_demand.IDLE_POLL_S * 3)
        assert b.stopped and not a.stopped and registry.model_ids() == ["a"]
        registry.closed = True

    run(scenario())


def test_models_loaded_by_the_operator_are_never_unloaded_by_axon(tmp_path):
    fakes = Fakes(tmp_path, max_loaded_models=1, on_demand_wait_s=0.05, idle_unload_s=0.01)
    registry = fakes.registry

    async def scenario():
        await registry.load(ModelSpec(model_id="org/pinned"))  # POST /models/load's way
        await asyncio.sleep(0.02)
        assert registry._expired() == []
        with pytest.raises(ModelUnavailable, match="max_loaded_models 1"):
            await registry.ensure("a")
        assert registry.model_ids() == ["org/pinned"]

    run(scenario())


def test_startup_models_come_back_on_demand_unless_the_operator_unloads_them(tmp_path):
    fakes = Fakes(tmp_path, names=(), max_loaded_models=1)
    registry = fakes.registry
    spec = ModelSpec(model_id=str(tmp_path / "start.gguf"), served_model_name="start")

    async def scenario():
        (tmp_path / "start.gguf").write_bytes(b"\0" * 8)
        await registry.load(spec, trusted=True)
        registry.keep_spec(spec)  # what axon serve does after a startup load
        await registry.unload("start", grace_s=0.0, keep_spec=True)  # idle, or to make room
        assert await registry.listing() == [
            {"id": "start", "status": "available", "format": "gguf", "size_bytes": 8}
            | {"modified": int((tmp_path / "start.gguf").stat().st_mtime)}
        ]
        assert (await registry.ensure("start")).id == "start"
        assert fakes.starts == ["start", "start"]
        await registry.unload("start")  # POST /models/unload: gone for good
        assert await registry.listing() == []
        with pytest.raises(ModelNotFound):
            await registry.ensure("start")

    run(scenario())


def test_expires_in_counts_down_the_keep_alive(tmp_path):
    fakes = Fakes(tmp_path, idle_unload_s=60.0)
    registry = fakes.registry

    async def scenario():
        a = await registry.ensure("a")
        registry._entries["a"].last_used -= 20
        assert 39 <= registry.expires_in("a") <= 40
        a.num_inflight = 1
        assert registry.expires_in("a") == 60.0  # in use: the whole keep-alive is ahead
        registry.touch("a", keep_alive_s=-1)
        assert registry.expires_in("a") is None and registry.expires_in("nope") is None

    run(scenario())
