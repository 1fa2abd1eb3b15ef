"""The FastAPI app: the OpenAI routes, the node API and /metrics, and one error envelope for all
of them: `{"error": {"message", "type", "code", "param"}}`."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from axon.server.errors import AxonHTTPError, ModelNotFound
from axon.server.generation import ClientDisconnected, served_model
from axon.server.lifecycle.sources import is_repo_id
from axon.server.reasoning_budget import supported_efforts
from axon.server.routes import (
    anthropic,
    embeddings,
    ollama,
    ollama_models,
    openai_chat,
    openai_completions,
    responses,
    utility_routes,
)
from axon.server.schemas.protocol import param_of

logger = logging.getLogger(__name__)
models_router = APIRouter()
_STATUS_CODES = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}
_STATIC_DIR = Path(__file__).parent / "static"
# The page loads its own scripts and styles and talks to this server only; a model's answer that
# slipped past the Markdown renderer's escaping still could not run a script or call elsewhere.
_CHAT_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data: blob:; connect-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'",
    "Cache-Control": "no-cache",
}


def _optional(module: str, attribute: str):
    """`module.attribute` when that module exists (another part of the server may not yet)."""
    if importlib.util.find_spec(module) is None:
        return None
    return getattr(importlib.import_module(module), attribute, None)


def model_card(model, name: str | None = None) -> dict:
    """OpenAI's model object with vLLM's `root`: the repo id of a hub model, else the served id
    (as vLLM does without a repo id); never a local path, which would map the server's disk.
    Under an alias `name`, the card is the alias's, its `parent` the served id."""
    model_id = getattr(getattr(model, "spec", None), "model_id", None)
    card = {
        "id": name or model.id,
        "object": "model",
        "created": model.created,
        "owned_by": "axon",
        "root": model_id if model_id and is_repo_id(model_id) else model.id,
        "max_model_len": model.max_model_len,
        "status": "loaded",
    }
    if name is not None and name != model.id:
        card["parent"] = model.id
    efforts = supported_efforts(model) if getattr(model, "tokenizer", None) is not None else []
    if efforts:  # the reasoning_effort values the model takes (reasoning_budget.py)
        card["reasoning_efforts"] = efforts
    return card


def unloaded_card(row: dict) -> dict:
    """The card of a model a request may name that is not loaded (`status` available, loading,
    …: registry.listing's row), never a path."""
    card = {"id": row["id"], "object": "model", "created": row.get("modified", 0)}
    return card | {"owned_by": "axon", "root": row["id"], "status": row["status"]}


async def _unloaded_cards(registry) -> list[dict]:
    listing = getattr(registry, "listing", None)  # a stand-in registry (tests) may have none
    rows = [] if listing is None else await listing()
    # A startup load in progress stays out, as before: clients wait for a model to be listed.
    shown = [row for row in rows if row["status"] == "available" or row.get("on_demand")]
    shown = [row for row in shown if row["status"] in ("available", "loading")]
    return [unloaded_card(row) for row in shown]


@models_router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """The loaded models, each followed by its aliases (vLLM lists every served name), then
    the models not loaded that a request may name (models on demand), each with its status."""
    registry = request.app.state.axon.registry
    cards = []
    for model in registry.list_models():
        cards.append(model_card(model))
        names = [alias for alias, target in registry.aliases.items() if target == model.id]
        cards += [model_card(model, alias) for alias in names]
    return {"object": "list", "data": cards + await _unloaded_cards(registry)}


@models_router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict:
    try:
        return model_card(served_model(request, model_id), model_id)
    except ModelNotFound:
        registry = request.app.state.axon.registry
        cards = [card for card in await _unloaded_cards(registry) if card["id"] == model_id]
        if not cards:
            raise
        return cards[0]


def _envelope(status: int, message: str, error_type: str, code, param=None, headers=None):
    body = {"error": {"message": message, "type": error_type, "code": code, "param": param}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _axon_error(request: Request, exc: AxonHTTPError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers or None)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    loc = tuple(errors[0].get("loc", ())) if errors else ()
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    param = param_of(loc)
    message = errors[0].get("msg", "invalid request") if errors else "invalid request"
    return _envelope(
        400, f"{param}: {message}" if param else message, "invalid_request_error", None, param
    )


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = _STATUS_CODES.get(exc.status_code, "http_error")
    error_type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return _envelope(
        exc.status_code, str(exc.detail), error_type, code, headers=getattr(exc, "headers", None)
    )


async def _disconnected(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=499)  # nobody reads it: the client is gone


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _envelope(
        500, f"internal error: {type(exc).__name__}", "internal_error", "internal_error"
    )


def _add_docs(app: FastAPI, dependencies: list) -> None:
    """`/openapi.json`, `/docs` and `/redoc`, which need the API key when one is set."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

    @app.get("/openapi.json", include_in_schema=False, dependencies=dependencies)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=dependencies)
    async def swagger() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="axon API")

    @app.get("/redoc", include_in_schema=False, dependencies=dependencies)
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title="axon API")


def _add_chat_page(app: FastAPI) -> None:
    """The chat page at `/` and its scripts under `/static/`, open without the API key: they hold
    no data, and the page asks for the key before it calls any route that needs it."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(_STATIC_DIR / "index.html", headers=_CHAT_PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=_STATIC_DIR), name="static")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(AxonHTTPError, _axon_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnected, _disconnected)
    app.add_exception_handler(Exception, _unexpected)


def create_app(state, lifespan=None) -> FastAPI:
    """The HTTP app over `state` (an AppState: config and model registry), which every route
    reads as `request.app.state.axon`."""
    # The schema and its pages are served below, behind the API key like every other route.
    app = FastAPI(title="axon", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.axon = state
    install_error_handlers(app)
    require_api_key = _optional("axon.server.auth", "require_api_key")
    v1 = [Depends(require_api_key)] if require_api_key is not None else []
    _add_docs(app, v1)
    _add_chat_page(app)
    for router in (
        models_router,
        openai_chat.router,
        openai_completions.router,
        embeddings.router,
        responses.router,
        utility_routes.router,
    ):
        app.include_router(router, dependencies=v1)
    # Its own key check (x-api-key or a bearer token) and error shape: see anthropic.py.
    app.include_router(anthropic.router)
    # Ollama's API: its own error shape, the same key (see ollama.py).
    app.include_router(ollama.router)
    app.include_router(ollama_models.router)
    app.include_router(utility_routes.open_router)
    for module in ("axon.server.routes.node_api", "axon.server.metrics"):
        router = _optional(module, "router")
        if router is not None:
            app.include_router(router)
    return app
