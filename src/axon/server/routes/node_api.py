"""The node-management API, in neuron's shapes: discovery, health, and the model lifecycle.

Every route but `/health` requires a key when one is configured: load and unload the admin key
(`--admin-api-key`) when one is set, the read-only routes the inference key or the admin key
(auth.py). `POST /models/load` is synchronous: it returns once the model's weights are resident
and it serves requests.
"""

from __future__ import annotations

import asyncio
import functools
import platform
import time

from fastapi import APIRouter, Depends, Request

from axon.server.auth import require_admin_key, require_node_key
from axon.server.errors import ModelNotFound
from axon.server.lifecycle.discovery import HealthProbe, discover, host_memory
from axon.server.lifecycle.registry import ActivationTracker
from axon.server.schemas.node_protocol import ModelInfo, ModelSpec, UnloadRequest
from axon.server.schemas.protocol import parse_request

router = APIRouter(tags=["node"])
_authorized = [Depends(require_node_key)]
_admin = [Depends(require_admin_key)]
_health_probe = HealthProbe()
_WILDCARD_HOSTS = {"", "0.0.0.0", "::"}


def _state(request: Request):
    return request.app.state.axon


@functools.cache
def _discovery() -> dict:
    return discover()


@router.get("/discovery", dependencies=_authorized)
async def get_discovery() -> dict:
    """Host, OS, kernel, CUDA and driver versions, and the GPUs (empty without nvidia-smi)."""
    return await asyncio.to_thread(_discovery)


@router.get("/health")
async def get_health(request: Request) -> dict:
    """Uptime, per-device memory, host memory and the startup activation; open to probes."""
    state = _state(request)
    devices, memory = await asyncio.gather(
        asyncio.to_thread(_health_probe.devices), asyncio.to_thread(host_memory)
    )
    activation = state.activation or ActivationTracker(state="ready")
    return {
        "status": "shutting_down" if state.shutting_down else "ok",
        "uptime_secs": int(time.time() - state.started_at),
        "devices": devices,
        "host_memory": memory,
        "activation": activation.snapshot(state.registry),
        "models": state.registry.summary(),
    }


@router.get("/models", dependencies=_authorized)
async def get_models(request: Request) -> list[ModelInfo]:
    """Every model on the node with its status (loading, loaded, poisoned, recovering,
    failed)."""
    return await _state(request).registry.infos()


# The bodies are read in the handlers, after the key check: a body parameter is read first.
@router.post("/models/load", dependencies=_admin)
async def load_model(request: Request) -> dict:
    """Loads `spec` and returns once it serves requests: `{"status": "loaded", ...}`."""
    spec = parse_request(await request.body(), ModelSpec)
    registry = _state(request).registry
    await registry.load(spec)
    infos = {info.id: info for info in await registry.infos()}
    info = infos.get(spec.served_id)
    return {
        "status": "loaded",
        "model_id": spec.served_id,
        "model": info.model_dump() if info else None,
    }


@router.post("/models/unload", dependencies=_admin)
async def unload_model(request: Request) -> dict:
    """Stops admitting requests to the model, lets its in-flight ones finish, stops its engine."""
    body = parse_request(await request.body(), UnloadRequest)
    await _state(request).registry.unload(body.model_id)
    return {"status": "unloaded", "model_id": body.model_id}


@router.get("/models/{model_id:path}/endpoint", dependencies=_authorized)
async def model_endpoint(model_id: str, request: Request) -> dict:
    """The base URL that serves `model_id` (this node's). Ids with '/' may come percent-encoded."""
    state = _state(request)
    if model_id not in state.registry:
        raise ModelNotFound(f"model {model_id!r} is not loaded on this node", param="model_id")
    return {"url": bind_url(state.config.host, state.config.port)}


def bind_url(host: str, port: int) -> str:
    """The URL clients reach this server at; a wildcard bind answers with the host's name."""
    if host in _WILDCARD_HOSTS:
        host = platform.node() or "localhost"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"
