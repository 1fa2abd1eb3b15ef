"""The Ollama API's model and embedding routes: `GET /api/tags`, `GET /api/ps`, `POST
/api/show`, `GET /api/version`, `POST /api/pull`, `POST /api/embed` and the older
`POST /api/embeddings`.

`tags` lists the models a request may name: the loaded ones (each alias too, whose
`details.parent_model` is the served id), then those the models dirs hold that are not loaded
(a request loads them on demand; their size is their weight files'). `ps` lists the loaded ones,
sizes the weights' bytes in memory, with `expires_at` when axon will unload the model idle (its
keep-alive) and none when it stays until unloaded.
`pull` loads a Hugging Face repo (`org/name`, or `org/name:QUANT` for one GGUF file of it) as the
node API's `POST /models/load` does, served under the name pulled, its progress streamed; a model
already loaded is a success at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from axon import __version__
from axon.server.auth import require_api_key
from axon.server.errors import BadRequest, ModelNotFound
from axon.server.generation import or_disconnect
from axon.server.lifecycle.recovery import retrieve_exception
from axon.server.lifecycle.sources import is_repo_id, quant_label
from axon.server.offload import off_loop
from axon.server.reasoning_budget import supported_efforts
from axon.server.routes.embeddings import (
    EmbeddingRequest,
    embedding_inputs,
    embedding_prompts,
    embedding_response,
)
from axon.server.routes.ollama import NdjsonStream, OllamaRoute, error_response, ndjson
from axon.server.routes.ollama_keep_alive import kept_model, ollama_model
from axon.server.schemas.node_protocol import ModelSpec
from axon.server.schemas.ollama import (
    EmbeddingsRequest,
    EmbedRequest,
    PullRequest,
    ShowRequest,
)
from axon.server.schemas.ollama_options import check_num_ctx
from axon.server.schemas.protocol import parse_request
from axon.tokenizer.parsers import parser_family

router = APIRouter(route_class=OllamaRoute, dependencies=[Depends(require_api_key)])


_PROGRESS_S = 0.5  # how often a streamed pull reports the load's progress


# ---- what a model is ------------------------------------------------------------------------


def _info(model) -> dict:
    return getattr(getattr(model, "client", None), "info", None) or {}


def _size(model) -> int:
    return int((getattr(model, "parameter_bytes", None) or {}).get("total") or 0)


def _is_gguf(model) -> bool:
    return str(getattr(model, "model_path", "")).lower().endswith(".gguf")


def details(model, parent: str = "") -> dict:
    """Ollama's model details; parameter_size is left empty (axon knows bytes, not counts)."""
    info = _info(model)
    family = info.get("model_type") or ""
    quant = quant_label(Path(model.model_path).name) if _is_gguf(model) else ""
    return {
        "parent_model": parent,
        "format": "gguf" if _is_gguf(model) else "safetensors",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": "",
        "quantization_level": quant or str(info.get("dtype") or "").upper(),
    }


def capabilities(model) -> list[str]:
    """Ollama's capability names: completion or embedding, tools, thinking, vision."""
    if getattr(model, "task", "generate") == "embed":
        return ["embedding"]
    found = ["completion"]
    family = parser_family(model.tokenizer, _info(model).get("model_type"))
    if family.tool_format is not None:
        found.append("tools")
    if family.reasoning or supported_efforts(model):
        found.append("thinking")
    if getattr(model, "images", None) is not None:
        found.append("vision")
    return found


def _rfc3339(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).isoformat().replace("+00:00", "Z")


def _modified_at(model) -> str:
    return _rfc3339(model.created)


def _entry(model, name: str) -> dict:
    parent = model.id if name != model.id else ""
    return {
        "name": name,
        "model": name,
        "modified_at": _modified_at(model),
        "size": _size(model),
        "details": details(model, parent),
    }


# ---- listing and showing --------------------------------------------------------------------


@router.get("/api/version")
async def version() -> dict:
    return {"version": __version__}


def _available_entry(row: dict) -> dict:
    """A model a models dir holds, not loaded: what its files say (no family before loading)."""
    quant = quant_label(row["id"]) if row.get("format") == "gguf" else ""
    details = {"parent_model": "", "format": row.get("format") or "", "family": ""}
    details |= {"families": None, "parameter_size": "", "quantization_level": quant}
    return {
        "name": row["id"],
        "model": row["id"],
        "modified_at": _rfc3339(row.get("modified") or 0),
        "size": row.get("size_bytes") or 0,
        "details": details,
    }


@router.get("/api/tags")
async def tags(request: Request) -> dict:
    """The loaded models, each followed by its aliases, then the available ones."""
    registry = request.app.state.axon.registry
    entries = []
    for model in registry.list_models():
        entries.append(_entry(model, model.id))
        aliases = [alias for alias, target in registry.aliases.items() if target == model.id]
        entries += [_entry(model, alias) for alias in aliases]
    listing = getattr(registry, "listing", None)  # a stand-in registry (tests) may have none
    rows = await listing() if listing is not None else []
    entries += [_available_entry(row) for row in rows if row["status"] == "available"]
    return {"models": entries}


@router.get("/api/ps")
async def running(request: Request) -> dict:
    """The loaded models with their memory (all on the accelerator when there is one)."""
    registry, models = request.app.state.axon.registry, []
    expires_in = getattr(registry, "expires_in", lambda name: None)
    for model in registry.list_models():
        entry = _entry(model, model.id)
        on_device = not str(_info(model).get("device") or "cpu").startswith("cpu")
        entry |= {"size_vram": entry["size"] if on_device else 0}
        seconds = expires_in(model.id)
        if seconds is not None:  # none: it stays loaded until it is unloaded
            entry["expires_at"] = _rfc3339(time.time() + seconds)
        models.append(entry | {"context_length": model.max_model_len})
    return {"models": models}


def _parameters(model) -> str:
    """The model's sampling defaults (generation_config.json) as Modelfile parameter lines."""
    defaults = getattr(model, "generation_defaults", None) or {}
    names = {"repetition_penalty": "repeat_penalty"}
    return "\n".join(f"{names.get(key, key)} {value}" for key, value in sorted(defaults.items()))


def _template(model) -> str:
    """The chat template's text (Jinja, not an Ollama Go template)."""
    template = getattr(model.tokenizer, "chat_template", None) if model.tokenizer else None
    return template if isinstance(template, str) else ""


@router.post("/api/show")
async def show(request: Request) -> dict:
    body = await off_loop(parse_request, await request.body(), ShowRequest)
    name = body.model_name()
    model = await ollama_model(request, name)
    info, family = _info(model), _info(model).get("model_type") or "unknown"
    model_info = {"general.architecture": family, f"{family}.context_length": model.max_model_len}
    if info.get("hidden_size"):
        model_info[f"{family}.embedding_length"] = info["hidden_size"]
    return {
        "parameters": _parameters(model),
        "template": _template(model),
        "details": details(model, model.id if name != model.id else ""),
        "model_info": model_info,
        "capabilities": capabilities(model),
        "modified_at": _modified_at(model),
    }


def pull_spec(name: str) -> ModelSpec:
    """The load spec of a pull: `org/name` or `org/name:QUANT` (a GGUF file of the repo, by
    substring; `:latest` is none), served under the name pulled. Raises BadRequest for any
    other name (Ollama's library names are not a source axon has)."""
    head, colon, tag = name.rpartition(":")
    repo, quant = (head, tag) if colon and "/" in head and "/" not in tag else (name, None)
    if not is_repo_id(repo):
        raise BadRequest(
            f"model {name!r}: pull takes a Hugging Face repo id, org/name or org/name:QUANT "
            "(Ollama's library names are not available)",
            param="model",
        )
    return ModelSpec(
        model_id=repo, quant=None if quant == "latest" else quant, served_model_name=name
    )


async def _pull_lines(registry, spec: ModelSpec, name: str):
    """Ollama's pull progress: what is fetched, the weights' bytes as the engine loads them,
    then `success`, or an `{"error"}` line."""
    load = asyncio.ensure_future(registry.load(spec))
    load.add_done_callback(retrieve_exception)  # the client may go before the load ends
    yield ndjson({"status": f"pulling {spec.model_id}"})
    shown = None
    try:
        while not load.done():
            await asyncio.wait({load}, timeout=_PROGRESS_S)
            progress = registry.load_progress(spec.served_id)
            if progress is not None and progress != shown:
                shown = progress
                line = {"total": progress["total_bytes"], "completed": progress["loaded_bytes"]}
                yield ndjson({"status": f"loading {name}", **line})
        load.result()
        yield ndjson({"status": "success"})
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which has started
        yield ndjson(json.loads(error_response(exc).body))


@router.post("/api/pull")
async def pull(request: Request):
    """Loads a HF repo (or one GGUF quant of it) as the node API's load does; a model already
    loaded is a success at once."""
    body = await off_loop(parse_request, await request.body(), PullRequest)
    name = body.model_name()
    try:
        await ollama_model(request, name)  # a model a models dir holds is loaded from there
    except ModelNotFound:
        pass
    else:
        return _success(body.stream)
    spec = pull_spec(name)
    registry = request.app.state.axon.registry
    if body.stream:
        return NdjsonStream(_pull_lines(registry, spec, name))
    await registry.load(spec)
    return _success(stream=False)


def _success(stream: bool):
    if stream:
        return Response(ndjson({"status": "success"}), media_type="application/x-ndjson")
    return {"status": "success"}


# ---- embeddings -----------------------------------------------------------------------------


def _check_embed_options(options: dict | None) -> int | None:
    """The num_ctx of an embedding request's options; any other option is a 400: sampling
    does not touch an embedding."""
    for name, value in (options or {}).items():
        if name != "num_ctx" and value is not None:
            raise BadRequest(
                f"options.{name}: has no effect on embeddings", param=f"options.{name}"
            )
    return (options or {}).get("num_ctx")


def _embed_prompts(model, body: EmbedRequest) -> tuple[EmbeddingRequest, list[list[int]]]:
    """The inputs' token ids, cut to the context window when `truncate` (Ollama's default)."""
    window = check_num_ctx(_check_embed_options(body.options), model.max_model_len)
    request = EmbeddingRequest(model=body.model, input=body.input, dimensions=body.dimensions)
    model.size_caps.check_sequences(len(embedding_inputs(request)), prompts_param="input")
    prompts = embedding_prompts(request, model)
    if body.truncate:
        prompts = [ids[:window] for ids in prompts]
    elif any(len(ids) > window for ids in prompts):
        message = f"input: an input is longer than the context window ({window} tokens)"
        raise BadRequest(message + "; send truncate: true to cut it", param="input")
    return request, prompts


@router.post("/api/embed")
async def embed(request: Request) -> dict:
    started = datetime.now(UTC)
    body = await off_loop(parse_request, await request.body(), EmbedRequest)
    model, unload = await kept_model(request, body.model, body.keep_alive)
    if body.input == []:  # Ollama's way of loading a model: nothing to embed
        return {"model": body.model, "embeddings": []}
    openai_body, prompts = await off_loop(_embed_prompts, model, body)
    vectors = await or_disconnect(request, model.embed(prompts))
    answer = await off_loop(embedding_response, openai_body, model, prompts, vectors)
    if unload:
        await request.app.state.axon.registry.unload(model.id)
    elapsed = int((datetime.now(UTC) - started).total_seconds() * 1e9)
    return {
        "model": body.model,
        "embeddings": [item["embedding"] for item in answer["data"]],
        "total_duration": elapsed,
        "load_duration": 0,
        "prompt_eval_count": answer["usage"]["prompt_tokens"],
    }


@router.post("/api/embeddings")
async def embeddings(request: Request) -> dict:
    """The older route: one prompt, one `embedding`."""
    body = await off_loop(parse_request, await request.body(), EmbeddingsRequest)
    model, unload = await kept_model(request, body.model, body.keep_alive)
    if not body.prompt:
        return {"embedding": []}
    embed_body = EmbedRequest(model=body.model, input=body.prompt, options=body.options)
    openai_body, prompts = await off_loop(_embed_prompts, model, embed_body)
    vectors = await or_disconnect(request, model.embed(prompts))
    answer = await off_loop(embedding_response, openai_body, model, prompts, vectors)
    if unload:
        await request.app.state.axon.registry.unload(model.id)
    return {"embedding": answer["data"][0]["embedding"]}
