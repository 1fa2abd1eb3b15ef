"""Models on demand: a request naming a model the models dirs hold loads it; memory is managed.

ModelRegistry's on-demand half (it uses the registry's `_entries`, `config`, `load`, `unload`,
`get`, `resolve` and `_status`). The API the routes use:

- `await registry.ensure(name)`: the ServedModel `name` names (a served id or an alias),
  loading it first when it is available (a models dir holds it, or it is a startup model that
  was unloaded); held for the current HTTP request (RequestScope) so that it is never evicted
  under it. One load per model at a time: concurrent requests for it wait on the same load, at
  most `on_demand_wait_s` from their start, then get a 503 with Retry-After (the load goes on).
- `await registry.listing()`: every model a request may name with its state (`loaded`,
  `loading`, `available`, and the registry's `poisoned`, `recovering`, `failed`).
- `registry.touch(name, keep_alive_s)`: marks the model used now; `keep_alive_s` (Ollama's
  per-request keep_alive) sets how long it stays loaded once idle: 0 unloads it as soon as its
  requests end, a negative value never, None keeps `idle_unload_s`. Call it after `ensure`.
- `registry.expires_in(name)`: seconds until the idle unload takes it (Ollama's `expires_at`).
- `registry.unloads_itself(name)`: whether the keep-alive applies to it (see below).

Only reloadable models are ever unloaded by axon itself: those loaded on demand and the
startup models (their spec is kept, so a request loads them again). A model loaded through
`POST /models/load` stays until it is unloaded the same way. Before an on-demand load, models
are unloaded least recently used first while `max_loaded_models` are loaded or the load's
estimate (its weight files plus `kv_cache_memory` when set) exceeds the free memory of its
device; never one with a request in flight or held. When nothing can make room the load is a
503 that names the memory it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
from pathlib import Path
from typing import Any

from axon.server.errors import AxonHTTPError, ModelNotFound, ModelUnavailable
from axon.server.lifecycle import discovery
from axon.server.lifecycle.catalog import Catalog, Found
from axon.server.lifecycle.local_paths import check_model_files
from axon.server.lifecycle.recovery import retrieve_exception
from axon.server.schemas.node_protocol import ModelSpec

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "5"
ROOM_POLL_S = 0.1  # how often a load waiting for a busy model to go idle looks again
IDLE_POLL_S = 0.5
_HELD: contextvars.ContextVar[list | None] = contextvars.ContextVar("axon_held", default=None)


class RequestScope:
    """ASGI wrapper: the models a request obtained through `ensure` are held until its response
    has been sent (a stream's last byte) or its client went away."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        releases: list = []
        token = _HELD.set(releases)
        try:
            await self.app(scope, receive, send)
        finally:
            _HELD.reset(token)
            for release in releases:
                release()


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def weight_bytes(path: Path) -> int:
    """The weight files' bytes of a .gguf file or a safetensors checkpoint folder."""
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    except OSError:
        return 0


def free_memory(engine_args: dict, spec: ModelSpec) -> int | None:
    """Free bytes where the model would load: its GPU's (nvidia-smi) unless it runs on the CPU
    or the node has none, else the host's available memory. Blocking."""
    device = str(engine_args.get("device") or "auto")
    if device != "cpu" and discovery.gpu_indices():
        rows = discovery.parse_gpu_health(discovery._query(discovery.HEALTH_QUERY))
        wanted = spec.devices[0] if spec.devices else None
        for row in rows:
            if (wanted is None or row["index"] == wanted) and row["vram_free_mb"] is not None:
                return row["vram_free_mb"] * 2**20
        return None
    return discovery.host_memory()["available_bytes"]


class OnDemand:
    """ModelRegistry's models-on-demand half; see the module docstring."""

    _entries: dict[str, Any]
    config: Any
    aliases: dict[str, str]
    closed: bool

    def _init_on_demand(self) -> None:
        self.catalog = Catalog(self.config.models_dirs or ())
        self._pending: dict[str, asyncio.Task] = {}  # on-demand loads, room-making included
        self._room_lock: asyncio.Lock | None = None  # one on-demand load plans memory at a time
        self._reloadable: dict[str, tuple[ModelSpec, Path]] = {}  # startup models' specs
        self._idle_task: asyncio.Task | None = None
        self._room_problems: dict[str, str] = {}  # why a pending load waits for room

    # ---- the routes' API --------------------------------------------------------------------

    async def ensure(self, name: str):
        """The ServedModel `name` names, loaded on demand when it is available; held until the
        current request ends. Raises ModelNotFound (404: neither loaded nor available; it
        names no path), ModelUnavailable (503 + Retry-After: still loading past the wait, no
        room, a failed load) and get()'s errors."""
        served_id = self.resolve(name)
        if served_id not in self._entries and served_id not in self._pending:
            plan = await self._on_demand_plan(served_id)
            # Looked for again: a concurrent request may have begun the load meanwhile.
            if plan is not None and served_id not in self._entries | self._pending:
                self._begin_load(served_id, *plan)
        await self._wait_loaded(served_id, name)
        model = self.get(name)
        self._hold(self._entries[served_id])
        return model

    def touch(self, name: str, keep_alive_s: float | None = None) -> None:
        """Marks the model `name` names used now; with `keep_alive_s`, how long it stays loaded
        once idle from now on (0: unloaded as soon as its requests end; negative: kept)."""
        entry = self._entries.get(self.resolve(name))
        if entry is None:
            return
        entry.last_used = time.monotonic()
        if keep_alive_s is not None:
            entry.keep_alive_s = keep_alive_s

    def unloads_itself(self, name: str) -> bool:
        """Whether axon unloads the loaded model `name` names by itself (idle, to make room):
        one loaded on demand or at startup, not one loaded through `POST /models/load`."""
        entry = self._entries.get(self.resolve(name))
        return entry is not None and entry.reloadable

    def expires_in(self, name: str) -> float | None:
        """Seconds until the idle unload takes the model `name` names if no request uses it
        meanwhile (Ollama's `expires_at`); None when nothing will (no keep-alive, or a model
        axon does not unload by itself, or not loaded)."""
        entry = self._entries.get(self.resolve(name))
        if entry is None or not entry.reloadable:
            return None
        keep = self.config.idle_unload_s if entry.keep_alive_s is None else entry.keep_alive_s
        if keep is None or keep < 0:
            return None
        if not self._idle(entry):
            return keep
        return max(0.0, keep - (time.monotonic() - entry.last_used))

    async def listing(self) -> list[dict]:
        """Every model a request may name, registry models first (load order; "on_demand":
        whether a request's load is under way), then the available ones: {"id", "status", and
        for available ones "format", "size_bytes", "modified"}. Never a path."""
        rows = [{"id": mid, "status": self._status(e)} for mid, e in self._entries.items()]
        rows += [{"id": mid, "status": "loading"} for mid in self._pending if mid not in self]
        for row in rows:  # a load a request began, not the operator's (startup, POST)
            row["on_demand"] = row["id"] in self._pending
        if not self.config.load_on_demand:
            return rows
        listed = {row["id"] for row in rows} | set(self.aliases)
        for model_id, path in self._unloaded_startup_models():
            rows.append({"id": model_id, "status": "available", **_file_facts(path)})
            listed.add(model_id)
        in_use = {entry.model_path for entry in self._entries.values()}
        for model_id, found in (await asyncio.to_thread(self.catalog.models)).items():
            if model_id in listed or found.path in in_use:
                continue
            facts = {"format": found.format, "size_bytes": found.size_bytes}
            rows.append(
                {"id": model_id, "status": "available", **facts, "modified": found.modified}
            )
        return rows

    def start_idle_unloader(self) -> None:
        """Starts the task that unloads models idle past their keep-alive (idle_unload_s or a
        request's keep_alive); call it once, in the server's event loop."""
        if self._idle_task is None:
            self._idle_task = asyncio.get_running_loop().create_task(self._unload_idle())
            self._idle_task.add_done_callback(retrieve_exception)

    def keep_spec(self, spec: ModelSpec) -> None:
        """Makes the loaded startup model `spec` reloadable: axon may unload it (idle, or to make
        room), and a request loads it again."""
        entry = self._entries.get(spec.served_id)
        if entry is not None and entry.model_path is not None:
            entry.reloadable = True
            self._reloadable[spec.served_id] = (spec, entry.model_path)

    # ---- loading on demand ------------------------------------------------------------------

    async def _on_demand_plan(self, served_id: str) -> tuple[ModelSpec, int] | None:
        """(spec, weight bytes) to load `served_id` on demand, or None. Raises ModelNotFound
        for a model a models dir holds while loading on demand is off."""
        if served_id in self._reloadable:
            spec, path = self._reloadable[served_id]
            return (spec, weight_bytes(path)) if self.config.load_on_demand else None
        found = (await asyncio.to_thread(self.catalog.models)).get(served_id)
        if found is None or self.config.load_on_demand:
            return None if found is None else await self._checked(found)
        raise ModelNotFound(
            f"model {served_id!r} is not loaded on this node, and loading models on demand is "
            "off (--no-load-on-demand): load it with POST /models/load",
            param="model",
        )

    async def _checked(self, found: Found) -> tuple[ModelSpec, int] | None:
        # Every file the load may open must resolve inside the dir it was found in.
        try:
            await asyncio.to_thread(check_model_files, found.path, (found.root,), found.id)
        except AxonHTTPError as exc:
            logger.warning("models dir: %s is not loaded: %s", found.id, exc.message)
            return None
        spec = ModelSpec(model_id=str(found.path), served_model_name=found.id)
        return spec, found.size_bytes

    def _begin_load(self, served_id: str, spec: ModelSpec, weights: int) -> None:
        task = asyncio.get_running_loop().create_task(self._load_on_demand(spec, weights))
        self._pending[served_id] = task

        def done(finished: asyncio.Task) -> None:
            if self._pending.get(served_id) is finished:
                del self._pending[served_id]
            retrieve_exception(finished)

        task.add_done_callback(done)

    async def _load_on_demand(self, spec: ModelSpec, weights: int) -> None:
        served_id = spec.served_id
        if self._room_lock is None:
            self._room_lock = asyncio.Lock()
        async with self._room_lock:  # memory is measured with no other load under way
            await self._make_room(spec, weights)
            logger.info("model %s: loading on demand", served_id)
            try:
                await self.load(spec, trusted=True)
            except ModelUnavailable:
                raise
            except AxonHTTPError as exc:  # the reason may name files: the log has it
                logger.error("model %s: loading on demand failed: %s", served_id, exc.message)
                raise ModelUnavailable(
                    f"model {served_id!r} could not be loaded; the server log says why",
                    code="model_load_failed",
                ) from exc
        entry = self._entries.get(served_id)
        if entry is not None:
            entry.reloadable = True
            entry.last_used = time.monotonic()

    async def _wait_loaded(self, served_id: str, name: str) -> None:
        # Only a request's load is waited for: one the operator started (startup, POST
        # /models/load) answers 503 + Retry-After meanwhile, as get() says.
        task = self._pending.get(served_id)
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), self.config.on_demand_wait_s)
        except TimeoutError:
            if task.done():  # it ended as the wait did (a busy event loop): its outcome counts
                task.result()
                return
            problem = self._room_problems.get(served_id)
            if problem is None:
                raise ModelUnavailable(
                    f"model {name!r} is loading; retry shortly",
                    headers={"Retry-After": RETRY_AFTER_S},
                ) from None
            raise _no_room(name, problem) from None

    # ---- making room ------------------------------------------------------------------------

    async def _make_room(self, spec: ModelSpec, weights: int) -> None:
        """Unloads idle reloadable models, least recently used first, until `spec` fits; waits
        for busy ones up to on_demand_wait_s. Raises ModelUnavailable (503) when it cannot."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.on_demand_wait_s
        try:
            while True:
                problem = await self._room_problem(spec, weights)
                if problem is None:
                    return
                victim = self._least_recently_used(spec.served_id)
                if victim is not None:
                    logger.info("model %s unloaded to make room for %s (%s)", victim,
                                spec.served_id, problem)  # fmt: skip
                    await self.unload(victim, grace_s=0.0, keep_spec=True)
                    continue
                if not self._busy_reloadable() or loop.time() >= deadline:
                    raise _no_room(spec.served_id, problem)
                self._room_problems[spec.served_id] = problem  # what its waiters are told
                await asyncio.sleep(ROOM_POLL_S)
        finally:
            self._room_problems.pop(spec.served_id, None)

    async def _room_problem(self, spec: ModelSpec, weights: int) -> str | None:
        limit = self.config.max_loaded_models
        loaded = sum(1 for e in self._entries.values() if e.status != "failed")
        if limit is not None and loaded >= limit:
            return f"{loaded} models are loaded (max_loaded_models {limit})"
        engine_args = self.config.engine_args(spec)
        kv_bytes = engine_args.get("kv_cache_memory") or 0
        free = await asyncio.to_thread(free_memory, engine_args, spec)
        need = weights + kv_bytes
        if free is None or need <= free:
            return None
        kv = f" and {gib(kv_bytes)} of KV cache" if kv_bytes else ""
        return (
            f"it needs about {gib(need)} of memory ({gib(weights)} of weights{kv}) and "
            f"{gib(free)} is free"
        )

    def _idle(self, entry) -> bool:
        model = entry.model
        return (
            entry.reloadable
            and self._status(entry) == "loaded"
            and entry.pins == 0
            and model.num_inflight == 0
        )

    def _least_recently_used(self, exclude: str) -> str | None:
        idle = [(e.last_used, mid) for mid, e in self._entries.items() if mid != exclude]
        idle = [(used, mid) for used, mid in idle if self._idle(self._entries[mid])]
        return min(idle)[1] if idle else None

    def _busy_reloadable(self) -> bool:
        return any(e.reloadable and not self._idle(e) for e in self._entries.values())

    # ---- holding and idling -----------------------------------------------------------------

    def _hold(self, entry) -> None:
        entry.last_used = time.monotonic()
        releases = _HELD.get()
        if releases is None:  # outside an HTTP request (a test's direct call): nothing to end
            return
        entry.pins += 1

        def release() -> None:
            entry.pins -= 1
            entry.last_used = time.monotonic()

        releases.append(release)

    async def _unload_idle(self) -> None:
        while not self.closed:
            await asyncio.sleep(IDLE_POLL_S)
            for model_id in self._expired():
                logger.info("model %s unloaded: idle past its keep-alive", model_id)
                with contextlib.suppress(AxonHTTPError):  # unloaded meanwhile
                    await self.unload(model_id, grace_s=0.0, keep_spec=True)

    def _expired(self) -> list[str]:
        now = time.monotonic()
        expired = []
        for model_id, entry in self._entries.items():
            keep = entry.keep_alive_s
            keep = self.config.idle_unload_s if keep is None else keep
            idle_for = now - entry.last_used
            if keep is not None and 0 <= keep <= idle_for and self._idle(entry):
                expired.append(model_id)
        return expired

    def _unloaded_startup_models(self) -> list[tuple[str, Path]]:
        return [(mid, path) for mid, (_, path) in self._reloadable.items() if mid not in self]


def _no_room(model_id: str, problem: str) -> ModelUnavailable:
    return ModelUnavailable(
        f"model {model_id!r} cannot be loaded now: {problem}",
        code="insufficient_memory" if "memory" in problem else "too_many_models",
        headers={"Retry-After": RETRY_AFTER_S},
    )


def _file_facts(path: Path) -> dict:
    try:
        modified = int(os.stat(path).st_mtime)
    except OSError:
        modified = 0
    kind = "gguf" if path.suffix.lower() == ".gguf" else "safetensors"
    return {"format": kind, "size_bytes": weight_bytes(path), "modified": modified}
