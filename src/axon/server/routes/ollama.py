"""The Ollama API's generating routes: `POST /api/chat` and `POST /api/generate`.

A request is translated into a chat completions request (schemas/ollama.py) and runs through the
chat pipeline (`prepare_chat`: template, images, output plan, sampling; the same engine); its
parsed output (thinking, content, tool calls) comes back in Ollama's shape, whole or as NDJSON
lines (Ollama streams unless `stream: false`), the last one `done: true` with the done reason,
token counts and durations in nanoseconds. Errors use Ollama's shape, `{"error": "..."}`, with
their HTTP status; the API key is the server's (`Authorization: Bearer`). An empty prompt (or no
messages) loads the model (`done_reason: "load"`), or with keep_alive 0 unloads it (`unload`), as
Ollama's does; routes/ollama_keep_alive.py finds the model (on demand) and applies keep_alive.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from axon.server.auth import require_api_key
from axon.server.chat_output import ChatOutputPlan, ChoiceOutput, call_arguments
from axon.server.chat_pipeline import PreparedChat, prepare_chat
from axon.server.errors import AxonHTTPError, BadRequest
from axon.server.generation import (
    EventStream,
    Generation,
    or_disconnect,
    vocab_size,
)
from axon.server.offload import off_loop
from axon.server.reasoning_budget import can_disable_thinking
from axon.server.routes.ollama_keep_alive import kept_model, schedule_unload, unload_now
from axon.server.routes.shaped import error_shaped_route
from axon.server.sampling import build_sampling_params, check_context, check_prompt_ids
from axon.server.schemas.ollama import (
    ChatRequest,
    GenerateRequest,
    chat_message,
    generate_messages,
    to_chat_request,
)
from axon.server.schemas.ollama_options import check_num_ctx, keep_alive_seconds, option_of
from axon.server.schemas.protocol import SampleCursor, parse_request
from axon.tokenizer.parsers import parser_family

logger = logging.getLogger(__name__)
_NS = 1_000_000_000
# A chat field's name in an error -> the Ollama field the request set it with.
_RENAMES = {"reasoning_effort": "think", "thinking_token_budget": "think"}


# ---- errors, the API key, the model ---------------------------------------------------------


def error_response(exc: Exception) -> JSONResponse:
    """Ollama's `{"error": message}` for `exc` with its status (an unexpected one logged)."""
    headers = None
    if isinstance(exc, AxonHTTPError):
        status, message, headers = exc.status_code, exc.message, exc.headers
    elif isinstance(exc, StarletteHTTPException):
        status, message, headers = exc.status_code, str(exc.detail), exc.headers
    elif isinstance(exc, RequestValidationError):
        status, message = 400, str(exc.errors()[0].get("msg", "invalid request"))
    else:
        logger.error("ollama route failed", exc_info=exc)
        status, message = 500, f"internal error: {type(exc).__name__}"
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


OllamaRoute = error_shaped_route(error_response)


router = APIRouter(route_class=OllamaRoute, dependencies=[Depends(require_api_key)])


def created_at() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ndjson(item: dict) -> str:
    return json.dumps(item, ensure_ascii=False, separators=(",", ":")) + "\n"


class NdjsonStream(EventStream):
    """Ollama's stream: one JSON object a line, aborted the moment the client goes away."""

    media_type = "application/x-ndjson"


# ---- preparing a request --------------------------------------------------------------------


def _renamed(exc: BadRequest) -> BadRequest:
    """`exc` naming the Ollama field (`options.num_predict`, `think`) the request used."""
    name = _RENAMES.get(exc.param or "", option_of(exc.param or ""))
    if exc.param and name != exc.param:
        exc.message = exc.message.replace(exc.param, name, 1)
        exc.param = name
        exc.args = (exc.message,)
    return exc


def _check_think(model, name: str, think) -> None:
    """Raises BadRequest for a `think` switch the model cannot follow."""
    if not isinstance(think, bool):
        return
    info = getattr(getattr(model, "client", None), "info", None) or {}
    reasoning = parser_family(model.tokenizer, info.get("model_type")).reasoning
    if think and not reasoning:
        raise BadRequest(f"think: model {name!r} does not support thinking", param="think")
    if not think and reasoning and not can_disable_thinking(model):
        message = f"think: model {name!r} cannot turn thinking off (its template has no switch)"
        raise BadRequest(message, param="think")


def _fit(prepared: PreparedChat, window: int, chat, model, field: str) -> PreparedChat:
    """`prepared` within the request's num_ctx `window` (when smaller than the model's)."""
    if window < model.max_model_len:
        params, prompt_len = prepared.params, len(prepared.prompt_ids)
        check_context(prompt_len, chat.max_tokens, window, (field, "options.num_predict"))
        params.max_tokens = min(params.max_tokens, window - prompt_len)
        params.answer_reserve_tokens = min(params.answer_reserve_tokens, params.max_tokens // 4)
    return prepared


def prepare_chat_request(model, body: ChatRequest) -> PreparedChat:
    """/api/chat's preparation; request-sized work: run it off the event loop."""
    try:
        chat, num_ctx = to_chat_request(body, [chat_message(m) for m in body.messages], body.tools)
        window = check_num_ctx(num_ctx, model.max_model_len)
        _check_think(model, body.model, body.think)
        prepared = prepare_chat(model, chat, {}, budget_param="think")
    except BadRequest as exc:
        raise _renamed(exc) from None
    return _fit(prepared, window, chat, model, "messages")


def prepare_generate_request(model, body: GenerateRequest) -> PreparedChat:
    """/api/generate's: the prompt through the chat template, or as it is with `raw`."""
    body.check_unsupported()
    try:
        messages = [{"role": "user", "content": body.prompt}]
        chat, num_ctx = to_chat_request(body, messages if body.raw else generate_messages(body))
        window = check_num_ctx(num_ctx, model.max_model_len)
        _check_think(model, body.model, body.think)
        if body.raw:
            prepared = _prepare_raw(model, body.prompt, chat)
        else:
            prepared = prepare_chat(model, chat, {}, prompt_field="prompt", budget_param="think")
    except BadRequest as exc:
        raise _renamed(exc) from None
    return _fit(prepared, window, chat, model, "prompt")


def _prepare_raw(model, prompt: str, chat) -> PreparedChat:
    ids = check_prompt_ids(model.encode(prompt, add_special_tokens=True, param="prompt"), "prompt")
    plan = ChatOutputPlan.of(model, chat, prompt, {})
    plan.enable_thinking = False  # raw text comes back as the model wrote it
    params = build_sampling_params(
        chat,
        len(ids),
        model.max_model_len,
        model.generation_defaults,
        prompt_field="prompt",
        structured_output=plan.structured_output,
        vocab_size=vocab_size(model),
    )
    return PreparedChat(prompt, ids, plan, params, None)


# ---- the answer -----------------------------------------------------------------------------


class _RawOutput:
    """A raw generation's text, as ChoiceOutput's interface gives it: nothing parsed."""

    num_calls = 0

    def deltas(self, text: str, final: bool = False, reason: str | None = None) -> list[dict]:
        return [{"content": text}] if text else []

    def message(self, text: str, reason: str | None = None) -> dict:
        return {"role": "assistant", "content": text}


def ollama_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's tool calls (arguments a JSON string) in Ollama's shape (arguments an object)."""
    return [
        {
            "id": call["id"],
            "function": {
                "index": index,
                "name": call["function"]["name"],
                "arguments": call_arguments(call["function"]["arguments"]),
            },
        }
        for index, call in enumerate(calls)
    ]


class Reply:
    """One request's answer: its chunks, its last line (done reason, counts, durations) and
    the whole answer, for /api/chat (`message`) or /api/generate (`response`)."""

    def __init__(self, name: str, prepared: PreparedChat, chat: bool, raw: bool, started_at):
        self.name, self.prepared, self.chat, self.raw = name, prepared, chat, raw
        self.started_at, self.first_token_at = started_at, None

    def output(self):
        return _RawOutput() if self.raw else ChoiceOutput(self.prepared.plan)

    def saw(self, sample) -> None:
        if self.first_token_at is None and sample.token_ids:
            self.first_token_at = time.monotonic()

    def chunk(self, delta: dict, done: bool = False) -> dict:
        """A line of the answer carrying `delta` (content, reasoning_content, tool_calls)."""
        head = {"model": self.name, "created_at": created_at()}
        thinking = delta.get("reasoning_content")
        if not self.chat:
            thinking_field = {"thinking": thinking} if thinking else {}
            return {**head, "response": delta.get("content") or "", **thinking_field, "done": done}
        message = {"role": "assistant", "content": delta.get("content") or ""}
        if thinking:
            message["thinking"] = thinking
        if delta.get("tool_calls"):
            message["tool_calls"] = ollama_calls(delta["tool_calls"])
        return {**head, "message": message, "done": done}

    def final(self, state, delta: dict | None = None) -> dict:
        """The `done: true` line: done reason, token counts, durations (ns)."""
        sample, now = state.samples[0], time.monotonic()
        first = self.first_token_at or now
        return {
            **self.chunk(delta or {}, done=True),
            "done_reason": "length" if sample.finish_reason == "length" else "stop",
            "total_duration": int((now - self.started_at) * _NS),
            "load_duration": 0,  # the model was loaded before the request
            "prompt_eval_count": len(state.prompt_token_ids),
            "prompt_eval_duration": int((first - self.started_at) * _NS),
            "eval_count": len(sample.token_ids),
            "eval_duration": int((now - first) * _NS),
        }

    def whole(self, state) -> dict:
        sample = state.samples[0]
        return self.final(state, self.output().message(sample.text, sample.finish_reason))


def _gather_calls(calls: list[dict], pieces: list[dict]) -> None:
    for piece in pieces:
        if "id" in piece:
            calls.append({"id": piece["id"], "function": dict(piece["function"])})
        elif calls:
            calls[-1]["function"]["arguments"] += piece["function"]["arguments"]


async def _lines(generation: Generation, reply: Reply):
    """The NDJSON lines: content and thinking as they come, the tool calls once whole, then
    the `done` line; an `{"error"}` line if the request fails after the stream has started."""
    cursor, output, calls = SampleCursor(), reply.output(), []
    try:
        async for state in generation:
            sample = state.samples[0]
            reply.saw(sample)
            step = cursor.advance(sample)
            if step is None:
                continue
            reason = sample.finish_reason if cursor.done else None
            for delta in output.deltas(step[0], cursor.done, reason):
                if "tool_calls" in delta:
                    _gather_calls(calls, delta["tool_calls"])
                else:
                    yield ndjson(reply.chunk(delta))
        if calls:
            yield ndjson(reply.chunk({"tool_calls": calls}))
        yield ndjson(reply.final(generation.state))
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which has started
        yield ndjson(json.loads(error_response(exc).body))
    finally:
        await generation.aclose()


async def _collect(generation: Generation, reply: Reply):
    async for state in generation:
        reply.saw(state.samples[0])
    return generation.state


async def answer(request: Request, model, body, reply: Reply, unload: bool):
    """Runs the prepared request: its NDJSON stream, or the whole answer."""
    prepared = reply.prepared
    generation = await or_disconnect(request, Generation.of_chat(model, prepared, reply.started_at))

    async def close() -> None:
        await generation.aclose()
        if unload:
            schedule_unload(request, model.id)

    if body.stream:
        return NdjsonStream(_lines(generation, reply), close)
    try:
        state = await or_disconnect(request, _collect(generation, reply))
    finally:
        await close()
    return JSONResponse(await off_loop(reply.whole, state))


async def load_answer(request: Request, body, keep_alive, chat: bool):
    """An empty request: the model is loaded (`load`), or unloaded now with keep_alive 0."""
    if keep_alive_seconds(keep_alive) == 0:
        await unload_now(request, body.model)
        reason = "unload"
    else:
        await kept_model(request, body.model, keep_alive)
        reason = "load"
    line = {"model": body.model, "created_at": created_at()}
    line |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return JSONResponse({**line, "done": True, "done_reason": reason})


# ---- routes ---------------------------------------------------------------------------------


@router.post("/api/chat")
async def chat(request: Request):
    started_at = time.monotonic()
    body = await off_loop(parse_request, await request.body(), ChatRequest)
    body.check_logprobs()
    if not body.messages:
        return await load_answer(request, body, body.keep_alive, chat=True)
    model, unload = await kept_model(request, body.model, body.keep_alive)
    prepared = await off_loop(prepare_chat_request, model, body)
    reply = Reply(body.model, prepared, chat=True, raw=False, started_at=started_at)
    return await answer(request, model, body, reply, unload)


@router.post("/api/generate")
async def generate(request: Request):
    started_at = time.monotonic()
    body = await off_loop(parse_request, await request.body(), GenerateRequest)
    body.check_logprobs()
    if not body.prompt and not body.images:
        body.check_unsupported()
        return await load_answer(request, body, body.keep_alive, chat=False)
    model, unload = await kept_model(request, body.model, body.keep_alive)
    prepared = await off_loop(prepare_generate_request, model, body)
    reply = Reply(body.model, prepared, chat=False, raw=body.raw, started_at=started_at)
    return await answer(request, model, body, reply, unload)
