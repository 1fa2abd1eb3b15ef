"""The model an Ollama request names, and its `keep_alive`.

A request's model is loaded on demand as on the OpenAI routes (`request_model`: a models dir
holds it, or it is a startup model axon unloaded), and Ollama's clients add `:latest` to a bare
name. `keep_alive` is honoured for the models axon manages (loaded on demand or at startup)
through the registry's keep-alive (`registry.touch`: 0 unloads it once its requests end, a
negative value keeps it, a positive one is its idle time). A model loaded through the node API
stays until it is unloaded the same way: there keep_alive 0 unloads it after the request and a
positive value is a 400 (`unload_after`). An empty request with keep_alive 0 unloads the model
now, and loads nothing.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request

from axon.server.errors import ModelNotFound
from axon.server.generation import request_model, served_model
from axon.server.schemas.ollama_options import keep_alive_seconds, unload_after

logger = logging.getLogger(__name__)
_unloads: set[asyncio.Task] = set()  # keep_alive 0's unloads, held until they finish


def _names(name: str) -> tuple[str, ...]:
    """`name`, then without Ollama's `:latest` tag."""
    return (name, name.removesuffix(":latest")) if name.endswith(":latest") else (name,)


def _manages(registry, model_id: str) -> bool:
    unloads_itself = getattr(registry, "unloads_itself", None)  # a stand-in registry (tests)
    return unloads_itself is not None and unloads_itself(model_id)


async def ollama_model(request: Request, name: str):
    """The model `name` names (an alias too), loaded on demand and held for the request."""
    *first, last = _names(name)
    for candidate in first:
        try:
            return await request_model(request, candidate)
        except ModelNotFound:
            pass
    return await request_model(request, last)


async def kept_model(request: Request, name: str, keep_alive) -> tuple[object, bool]:
    """(the model `name` names, whether to unload it once this request is answered) with
    `keep_alive` applied. A malformed keep_alive is a 400 before anything is loaded."""
    seconds = keep_alive_seconds(keep_alive)
    model = await ollama_model(request, name)
    registry = request.app.state.axon.registry
    if not _manages(registry, model.id):
        return model, unload_after(keep_alive)
    registry.touch(model.id, seconds)  # 0: the idle unloader takes it once its requests end
    return model, False


async def unload_now(request: Request, name: str) -> None:
    """An empty request with keep_alive 0: the model is unloaded (its requests in flight get
    the grace of any unload); one that is only available is left as it is."""
    registry = request.app.state.axon.registry
    for candidate in _names(name):
        try:
            model = served_model(request, candidate)
        except ModelNotFound:
            continue
        if _manages(registry, model.id):
            await registry.unload(model.id, keep_spec=True)  # a request may load it again
        else:
            await registry.unload(model.id)
        return
    await _check_available(registry, name)


async def _check_available(registry, name: str) -> None:
    listing = getattr(registry, "listing", None)
    rows = await listing() if listing is not None else []
    available = {row["id"] for row in rows if row["status"] == "available"}
    if not available & set(_names(name)):
        raise ModelNotFound(f"model {name!r} is not loaded on this node", param="model")


def schedule_unload(request: Request, model_id: str) -> None:
    """keep_alive 0 on a model loaded through the node API: unloaded once this request is
    answered."""
    registry = request.app.state.axon.registry
    task = asyncio.get_running_loop().create_task(registry.unload(model_id))
    _unloads.add(task)
    task.add_done_callback(_unload_done)


def _unload_done(task: asyncio.Task) -> None:
    _unloads.discard(task)
    if not task.cancelled() and isinstance(task.exception(), Exception):
        logger.warning("keep_alive 0: the unload failed: %s", task.exception())
