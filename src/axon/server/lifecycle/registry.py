"""The loaded models of this node: load, unload, look-up, and recovery of a faulted engine.

Each model is independent: resolving and downloading run in a thread, each engine is its own
process, and nothing here holds a lock across an await, so loading or unloading one model never
stalls another's requests. A model is `loading`, then `loaded`; a faulted engine makes it
`poisoned`, and recovery (recovery.py: single-flight, from the retained spec and files, retried
with backoff) `recovering` until a fresh engine is up, or `failed` once the attempts are spent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axon.server.config import ServerConfig
from axon.server.errors import AxonHTTPError, BadRequest, ModelNotFound, ModelUnavailable
from axon.server.lifecycle import discovery
from axon.server.lifecycle.local_paths import check_prefix_cache_dir
from axon.server.lifecycle.on_demand import OnDemand
from axon.server.lifecycle.recovery import Recovery, retrieve_exception
from axon.server.lifecycle.sources import resolve_model
from axon.server.lifecycle.templates import check_chat_template, read_chat_template
from axon.server.schemas.node_protocol import HARNESS, ModelInfo, ModelSpec

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "5"
MEMORY_QUERY_TIMEOUT_S = 2.0
Starter = Callable[..., Awaitable[Any]]  # ServedModel.start's signature
Resolver = Callable[..., Path]  # resolve_model's signature: (spec, config, trusted=...)


class Conflict(AxonHTTPError):
    status_code = 409
    code = "model_busy"


async def _start_served_model(*args, **kwargs):
    # lazy: the engine stack, on first use
    from axon.server.lifecycle.served_model import ServedModel

    return await ServedModel.start(*args, **kwargs)


@dataclass
class _Entry:
    spec: ModelSpec
    status: str = "loading"  # loading | loaded | poisoned | recovering | failed
    model: Any = None  # the ServedModel, once started
    model_path: Path | None = None
    chat_template: Any = None  # the spec's template override, read once (recovery reuses it)
    task: asyncio.Task | None = None  # the load or the recovery in progress
    error: str | None = None
    load_progress: tuple[int, int] | None = None  # (bytes of weights loaded, total) meanwhile
    attempt: int = 0  # the recovery's engine start under way (or the last one), 1-based
    # Models on demand (on_demand.py): whether axon may unload it (it can load it again), when
    # a request last held it, how many hold it now, and a request's keep_alive for it.
    reloadable: bool = False
    last_used: float = field(default_factory=time.monotonic)
    pins: int = 0
    keep_alive_s: float | None = None


@dataclass
class ActivationTracker:
    """Progress of the startup loads (`/health.activation`); each id is in exactly one bucket."""

    state: str = "pre_warming"  # pre_warming | ready
    pending: list[str] = field(default_factory=list)
    in_progress: str | None = None
    completed: list[str] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)

    def start(self, model_id: str) -> None:
        if model_id in self.pending:
            self.pending.remove(model_id)
        self.in_progress = model_id

    def finish(self, model_id: str, error: str | None = None) -> None:
        if self.in_progress == model_id:
            self.in_progress = None
        if error is None:
            self.completed.append(model_id)
        else:
            self.failed.append({"model_id": model_id, "error": error})

    def snapshot(self, registry: ModelRegistry | None = None) -> dict:
        """The buckets; with `registry`, the weight bytes loaded so far of the model in
        progress (`progress`: {"loaded_bytes", "total_bytes"}, null before its engine reports)."""
        snapshot = {
            "state": self.state,
            "pending": list(self.pending),
            "in_progress": self.in_progress,
            "completed": list(self.completed),
            "failed": [dict(failure) for failure in self.failed],
        }
        if registry is not None and self.in_progress is not None:
            snapshot["progress"] = registry.load_progress(self.in_progress)
        return snapshot


class ModelRegistry(Recovery, OnDemand):
    def __init__(
        self, config: ServerConfig, starter: Starter | None = None, resolver: Resolver | None = None
    ):
        self.config = config
        self._start = starter or _start_served_model
        self._resolve = resolver or resolve_model
        self._entries: dict[str, _Entry] = {}
        self.aliases: dict[str, str] = dict(config.model_aliases)  # alias -> served id
        self.closed = False  # set by unload_all: no more loads or new requests
        self._init_on_demand()

    # ---- load / unload ----------------------------------------------------------------------

    async def load(self, spec: ModelSpec, trusted: bool = False):
        """Resolves, downloads and starts `spec`; returns the ServedModel once its weights are
        resident. Local paths (model, chat template) must lie under the allowed roots unless
        `trusted` (the operator's own spec, not an HTTP request's). Raises BadRequest (unknown
        harness, already loaded, path not allowed, failed load), the preflight 422s, or
        ModelUnavailable while the server shuts down."""
        spec.check_harness()
        await check_placement(spec)
        if self.closed:
            raise ModelUnavailable("the server is shutting down")
        model_id = spec.served_id
        if model_id in self.aliases:
            raise BadRequest(
                f"model id {model_id!r} is an alias of {self.aliases[model_id]!r}: serve the "
                "model under another id",
                param="served_model_name",
            )
        existing = self._entries.get(model_id)
        if existing is not None and existing.status == "failed":  # loading it again: a fresh start
            self._drop(model_id, existing)
            existing = None
        if existing is not None:
            raise BadRequest(f"model {model_id!r} is already {existing.status}", param="model_id")
        entry = _Entry(spec)
        self._entries[model_id] = entry
        entry.task = asyncio.get_running_loop().create_task(self._load(model_id, entry, trusted))
        entry.task.add_done_callback(retrieve_exception)
        task = entry.task
        try:
            # Shielded: a client that hangs up mid-load must not leave half an engine behind.
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self._entries.get(model_id) is not entry:
                raise Conflict(f"model {model_id!r} was unloaded while it loaded") from None
            raise

    async def _load(self, model_id: str, entry: _Entry, trusted: bool):
        try:
            entry.model_path, entry.chat_template = await asyncio.to_thread(
                self._resolve_files, entry.spec, trusted
            )
            model = await self._start_model(model_id, entry)
        except BaseException:
            self._drop(model_id, entry)
            raise
        finally:
            entry.task = None
        entry.model, entry.status = model, "loaded"
        config = getattr(getattr(model, "client", None), "config", None)
        speculative = getattr(config, "speculative_config", None)
        logger.info(
            "model %s loaded from %s (activations %s%s)",
            model_id, entry.model_path, getattr(model, "activation_precision", None),
            f"; {speculative.describe()}" if speculative is not None else "",
        )  # fmt: skip
        return model

    def _resolve_files(self, spec: ModelSpec, trusted: bool) -> tuple[Path, Any]:
        # Blocking file work, in a thread. What is wrong with the template whatever the model
        # fails the load before anything is downloaded; a template file is then looked for in
        # the model's folder.
        check_chat_template(spec, self.config, trusted=trusted)
        check_prefix_cache_dir(spec, self.config, trusted=trusted)
        path = self._resolve(spec, self.config, trusted=trusted)
        return path, read_chat_template(spec, self.config, trusted=trusted, model_path=path)

    async def _start_model(self, model_id: str, entry: _Entry, previous=None):
        """Starts the model's engine; `previous` (a recovery) lends its tokenizer."""
        engine_args = self.config.engine_args(entry.spec)
        if entry.spec.tensor_parallel:  # ModelSpec's name (neuron's) for the engine's
            engine_args["tensor_parallel_size"] = entry.spec.tensor_parallel
        path, spec, template = str(entry.model_path), entry.spec, entry.chat_template
        reuse = {} if previous is None else {"previous": previous}

        def on_progress(loaded: int, total: int) -> None:
            entry.load_progress = (loaded, total)

        try:
            model = await self._start(
                model_id, path, engine_args, spec, self.config, chat_template=template,
                on_progress=on_progress, **reuse,
            )  # fmt: skip
        except AxonHTTPError:
            raise
        except Exception as exc:  # neuron: every other load failure is a 400 that says why
            raise BadRequest(f"loading {model_id!r} failed: {exc}", param="model_id") from exc
        model.on_poisoned = lambda reason: self._on_poisoned(model_id, model, reason)
        return model

    def _drop(self, model_id: str, entry: _Entry) -> None:
        if self._entries.get(model_id) is entry:
            del self._entries[model_id]

    async def unload(
        self, model_id: str, grace_s: float | None = None, keep_spec: bool = False
    ) -> None:
        """Stops admitting requests to the model (`model_id` or an alias of it), gives its
        in-flight ones up to `grace_s` (default: the config's shutdown grace), then stops its
        engine; a wedged engine is killed. A model still loading or recovering has that
        cancelled (its half-started engine's process group killed). A startup model stays
        loadable on demand only with `keep_spec` (axon's own unloads). Raises ModelNotFound."""
        model_id = self.resolve(model_id)
        entry = self._entries.get(model_id)
        if entry is None:
            raise ModelNotFound(f"model {model_id!r} is not loaded", param="model_id")
        if not keep_spec:
            self._reloadable.pop(model_id, None)
        del self._entries[model_id]  # from here on its new requests get 404
        if entry.task is not None:
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
            logger.info("model %s unloaded while %s", model_id, entry.status)
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        if entry.model is not None:  # a recovery without one shuts its new engine down itself
            await entry.model.shutdown(grace_s)
        logger.info("model %s unloaded", model_id)

    async def unload_all(self, grace_s: float) -> None:
        """Closes the registry and unloads every model at once, each with up to `grace_s` for its
        in-flight requests; loads still running get the same time. Failures are logged."""
        self.closed = True
        entries = list(self._entries.items())
        self._entries.clear()
        results = await asyncio.gather(
            *(self._shutdown_entry(entry, grace_s) for _, entry in entries), return_exceptions=True
        )
        for (model_id, _), result in zip(entries, results):
            if isinstance(result, BaseException):
                logger.error("unloading %s failed: %r", model_id, result)

    async def _shutdown_entry(self, entry: _Entry, grace_s: float) -> None:
        if entry.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(entry.task), grace_s)
            except (TimeoutError, asyncio.CancelledError, Exception):
                entry.task.cancel()
                return
        if entry.model is not None:
            await asyncio.wait_for(entry.model.shutdown(grace_s), grace_s + 30.0)

    # ---- look-up ----------------------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """The served id `name` stands for: the model an alias names, else `name` itself. Every
        look-up by a client's model name (OpenAI, Anthropic, node routes) goes through here."""
        return self.aliases.get(name, name)

    def get(self, model_id: str):
        """The ServedModel serving `model_id` (a served id or an alias). Raises ModelNotFound,
        or ModelUnavailable (503, Retry-After) while it loads, recovers or is poisoned, or while
        the server shuts down."""
        if self.closed:
            raise ModelUnavailable("the server is shutting down", headers={"Retry-After": "10"})
        served_id = self.resolve(model_id)
        entry = self._entries.get(served_id)
        shown = repr(model_id) if served_id == model_id else f"{served_id!r} (as {model_id!r})"
        if entry is None:
            raise ModelNotFound(f"model {shown} is not loaded on this node", param="model")
        status = self._status(entry)
        if status == "loaded":
            return entry.model
        if status == "poisoned":
            self._on_poisoned(served_id, entry.model, "engine fault")
        if status == "failed":
            raise ModelUnavailable(f"model {shown} failed: {entry.error}; load it again")
        raise ModelUnavailable(
            f"model {shown} is {status}; retry shortly", headers={"Retry-After": RETRY_AFTER_S}
        )

    def list_models(self) -> list:
        """The ServedModels ready for requests, in load order."""
        return [e.model for e in self._entries.values() if self._status(e) == "loaded"]

    def model_ids(self) -> list[str]:
        """Every model in the registry, whatever its status, in load order."""
        return list(self._entries)

    def __contains__(self, model_id: str) -> bool:
        return self.resolve(model_id) in self._entries

    def status(self, model_id: str) -> str | None:
        """The model's status, or None when it is not in the registry."""
        entry = self._entries.get(self.resolve(model_id))
        return None if entry is None else self._status(entry)

    @staticmethod
    def _status(entry: _Entry) -> str:
        if entry.status == "loaded" and entry.model.status != "loaded":
            return "poisoned"
        return entry.status

    async def infos(self) -> list[ModelInfo]:
        """`GET /models`: every model in the registry, loading and recovering ones included."""
        entries = list(self._entries.items())
        return list(await asyncio.gather(*(self._info(mid, e) for mid, e in entries)))

    async def _info(self, model_id: str, entry: _Entry) -> ModelInfo:
        status, model = self._status(entry), entry.model
        memory = None
        if status == "loaded":
            try:
                memory = await asyncio.wait_for(model.memory(), MEMORY_QUERY_TIMEOUT_S)
            except Exception as exc:  # a busy or faulted engine: report no figures, not a 500
                logger.debug("memory query of %s failed: %r", model_id, exc)
        total = (memory or {}).get("total_bytes") or 0
        return ModelInfo(
            id=model_id,
            model_id=entry.spec.model_id,
            harness=HARNESS,
            status=status,
            devices=list(getattr(model, "devices", None) or entry.spec.devices or []),
            memory=memory,
            vram_used_mb=memory["used_bytes"] // 2**20 if memory and total else None,
            capabilities=list(getattr(model, "capabilities", None) or []),
            max_model_len=getattr(model, "max_model_len", None),
            created=getattr(model, "created", None),
            error=entry.error,
            engine_pid=getattr(model, "engine_pid", None),
            load_progress=self.load_progress(model_id) if status != "loaded" else None,
            parameter_bytes=getattr(model, "parameter_bytes", None),
            activation_precision=getattr(model, "activation_precision", None),
            **self._recovery_fields(entry),
        )

    def _recovery_fields(self, entry: _Entry) -> dict:
        if entry.status not in ("recovering", "failed"):
            return {}
        return {
            "recovery_attempt": entry.attempt,
            "recovery_attempts": self.config.recovery_attempts,
        }

    def summary(self) -> list[dict]:
        """`/health.models`: each model's id and status (with its recovery's attempt and last
        failure while it recovers or once it failed); read from this process alone."""
        return [
            {"id": model_id, "status": self._status(entry), **self._recovery_fields(entry)}
            | ({"error": entry.error} if entry.status in ("recovering", "failed") else {})
            for model_id, entry in self._entries.items()
        ]

    def load_progress(self, model_id: str) -> dict | None:
        """{"loaded_bytes", "total_bytes"} of the weights of a model being loaded (or
        recovered); None before its engine reports any."""
        entry = self._entries.get(model_id)
        if entry is None or entry.load_progress is None:
            return None
        loaded, total = entry.load_progress
        return {"loaded_bytes": loaded, "total_bytes": total}


async def check_placement(spec: ModelSpec) -> None:
    """Raises BadRequest unless the spec's `tensor_parallel` and `devices` can be honoured
    here: one device per rank when devices are named, GPUs this node has (never silently
    ignored). Whether the model shards is checked where that is known: the preflight (a GGUF
    file whose row-parallel split cuts quant blocks is a 422 tp_gguf_split) and the engine's
    load (an architecture not sharded yet, or heads that do not divide, is a 400 naming the
    value)."""
    ranks = spec.tensor_parallel or 1
    devices = spec.devices
    if not devices:
        return
    if len(devices) != ranks:
        raise BadRequest(
            f"devices lists {len(devices)} GPUs for {ranks} rank(s): give one device per rank",
            param="devices",
        )
    present = await asyncio.to_thread(discovery.gpu_indices)
    missing = [device for device in devices if device not in present]
    if missing:
        have = f"its GPUs are {list(present)}" if present else "it has no NVIDIA GPU"
        raise BadRequest(
            f"devices {missing} not found on this node: {have}",
            code="device_not_found",
            param="devices",
        )
