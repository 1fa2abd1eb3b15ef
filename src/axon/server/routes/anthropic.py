"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request is translated into a chat completions request (anthropic_protocol.py) and runs through
the chat pipeline (`prepare_chat`: template, output plan, sampling; the same engine), and its
parsed output (reasoning, text, tool calls) comes back as Anthropic content blocks (`thinking`,
`text`, `tool_use`), whole or as Anthropic's SSE events. Errors on these routes use Anthropic's
shape, `{"type": "error", "error": {"type", "message"}}`, and the key may come as `x-api-key`.
"""

from __future__ import annotations

import hmac
import json
import logging
import time

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from axon.server.auth import bearer_token
from axon.server.chat_output import ChatOutputPlan, ChoiceOutput, call_arguments
from axon.server.chat_pipeline import PreparedChat, chat_prompt, prepare_chat
from axon.server.errors import AxonHTTPError, Unauthorized
from axon.server.generation import (
    EventStream,
    Generation,
    or_disconnect,
    request_model,
)
from axon.server.offload import json_response, off_loop
from axon.server.routes.shaped import error_shaped_route
from axon.server.schemas.anthropic_context import cleared_thinking_turns
from axon.server.schemas.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    to_chat_request,
)
from axon.server.schemas.protocol import SampleCursor, parse_request, random_id, sse

logger = logging.getLogger(__name__)
_BUDGET = "thinking.budget_tokens"  # what a thinking-budget error names
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


# ---- errors and the API key -----------------------------------------------------------------


def error_response(exc: Exception) -> JSONResponse:
    """Anthropic's error body for `exc` with its status (an unexpected one logged, a 500)."""
    headers = None
    if isinstance(exc, AxonHTTPError):
        status, message, headers = exc.status_code, exc.message, exc.headers
    elif isinstance(exc, StarletteHTTPException):
        status, message, headers = exc.status_code, str(exc.detail), exc.headers
    elif isinstance(exc, RequestValidationError):
        status, message = 400, str(exc.errors()[0].get("msg", "invalid request"))
    else:
        logger.error("anthropic route failed", exc_info=exc)
        status, message = 500, f"internal error: {type(exc).__name__}"
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers or None)


_AnthropicRoute = error_shaped_route(error_response)


async def require_key(request: Request) -> None:
    """The server's key as `x-api-key` (Anthropic's clients) or `Authorization: Bearer`."""
    expected = request.app.state.axon.config.api_key
    if expected is None:
        return
    key = request.headers.get("x-api-key") or bearer_token(request.headers.get("authorization"))
    if not key:
        raise Unauthorized("missing API key: send 'x-api-key: <key>'")
    if not hmac.compare_digest(key.encode(), expected.encode()):
        raise Unauthorized("incorrect API key provided")


router = APIRouter(route_class=_AnthropicRoute, dependencies=[Depends(require_key)])


# ---- the response ---------------------------------------------------------------------------


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def content_blocks(message: dict) -> list[dict]:
    """A chat message (ChoiceOutput.message) as content blocks: thinking, text, tool uses; an
    empty text block when there is nothing else, so that `content[0]` always exists."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"]})
        blocks[-1]["signature"] = ""  # nothing to verify: thinking sent back is taken as is
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": _tool_use_id(call["id"]),
                "name": function["name"],
                "input": call_arguments(function["arguments"]),
            }
        )
    return blocks or [{"type": "text", "text": ""}]


class _MessageContext:
    """One request's constants and the builders of its message, stop reason and usage."""

    def __init__(self, body: MessagesRequest, model, plan: ChatOutputPlan, params, edits=None):
        self.body, self.model, self.plan, self.params = body, model, plan, params
        self.edits = edits  # context editing's report: None unless the request asked for it
        self.id = random_id("msg_")
        # The context, not the request, bounds this answer (model_context_window_exceeded).
        self.context_bound = params.max_tokens < body.max_tokens

    def stop(self, sample, output: ChoiceOutput) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of a finished sample."""
        if sample.finish_reason == "length":
            full = self.context_bound and len(sample.token_ids) >= self.params.max_tokens
            return ("model_context_window_exceeded" if full else "max_tokens"), None
        if output.num_calls:
            return "tool_use", None
        stop = sample.stop_reason
        if isinstance(stop, str) and stop in (self.body.stop_sequences or ()):
            return "stop_sequence", stop
        return "end_turn", None

    def usage(self, state) -> dict:
        """Anthropic's usage: `input_tokens` excludes the prompt tokens the prefix cache held,
        which are `cache_read_input_tokens` (together they are count_tokens' number)."""
        sample = state.samples[0]
        cached = sample.num_cached_tokens
        return {
            "input_tokens": len(state.prompt_token_ids) - cached,
            "output_tokens": len(sample.token_ids),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def message(self, content: list[dict], stop: tuple, usage: dict) -> dict:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.body.model,  # the name the client sent: an alias stays one
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }
        return message if self.edits is None else {**message, "context_management": self.edits}

    def response(self, state) -> dict:
        sample = state.samples[0]
        output = ChoiceOutput(self.plan)
        blocks = content_blocks(output.message(sample.text, sample.finish_reason))
        return self.message(blocks, self.stop(sample, output), self.usage(state))


# ---- streaming ------------------------------------------------------------------------------


def event(kind: str, **data) -> str:
    return sse({"type": kind, **data}, event=kind)


class _StreamBlocks:
    """The content blocks of a stream: each chat delta goes into the open block, or closes it
    and opens the next (thinking, text, one per tool call)."""

    def __init__(self, plan: ChatOutputPlan):
        self.output = ChoiceOutput(plan)
        self.index = -1
        self.open_kind: str | None = None

    def events(self, text: str, final: bool, reason: str | None = None):
        for delta in self.output.deltas(text, final, reason):
            if delta.get("reasoning_content"):
                yield from self._write("thinking", thinking=delta["reasoning_content"])
            elif delta.get("content"):
                yield from self._write("text", text=delta["content"])
            for call in delta.get("tool_calls", []):
                yield from self._tool(call)
        if final:
            if self.index < 0:  # nothing at all: one empty text block, as the whole message has
                yield from self._open({"type": "text", "text": ""})
            yield from self._close()

    def _write(self, kind: str, **delta):
        if self.open_kind != kind:
            yield from self._close()
            start = {"type": kind, **{key: "" for key in delta}}
            yield from self._open({**start, "signature": ""} if kind == "thinking" else start)
        delta_type = "thinking_delta" if kind == "thinking" else "text_delta"
        yield event("content_block_delta", index=self.index, delta={"type": delta_type, **delta})

    def _tool(self, call: dict):
        function = call["function"]
        if "id" in call:
            yield from self._close()
            block = {"type": "tool_use", "id": _tool_use_id(call["id"]), "name": function["name"]}
            yield from self._open({**block, "input": {}})
        if function.get("arguments") and self.open_kind == "tool_use":
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            yield event("content_block_delta", index=self.index, delta=delta)

    def _open(self, block: dict):
        self.index += 1
        self.open_kind = block["type"]
        yield event("content_block_start", index=self.index, content_block=block)

    def _close(self):
        if self.open_kind is not None:
            self.open_kind = None
            yield event("content_block_stop", index=self.index)


async def _message_stream(generation: Generation, context: _MessageContext):
    """message_start, ping, the blocks' events, message_delta (stop reason, usage),
    message_stop; an `error` event if the request fails after the stream has started."""
    cursor, blocks = SampleCursor(), _StreamBlocks(context.plan)
    try:
        shell = context.message([], (None, None), context.usage(generation.state))
        yield event("message_start", message=shell)
        yield event("ping")
        async for state in generation:
            step = cursor.advance(state.samples[0])
            if step is not None:
                reason = state.samples[0].finish_reason if cursor.done else None
                for item in blocks.events(step[0], cursor.done, reason):
                    yield item
        state = generation.state
        reason, sequence = context.stop(state.samples[0], blocks.output)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        edits = {} if context.edits is None else {"context_management": context.edits}
        yield event("message_delta", delta=delta, usage=context.usage(state), **edits)
        yield event("message_stop")
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which has started
        body = json.loads(error_response(exc).body)
        yield event("error", error=body["error"])
    finally:
        await generation.aclose()


# ---- routes ---------------------------------------------------------------------------------


def _prepare(model, body: MessagesRequest) -> tuple[PreparedChat, dict | None]:
    """Chat's preparation (prompt, images, output plan, sampling), max_tokens capped at the
    request's, and context editing's report. Request-sized work: run it off the event loop."""
    prepared = prepare_chat(model, to_chat_request(body), {}, budget_param=_BUDGET)
    params = prepared.params
    params.max_tokens = min(params.max_tokens, body.max_tokens)
    params.answer_reserve_tokens = min(params.answer_reserve_tokens, params.max_tokens // 4)
    return prepared, _applied_edits(model, body)


def _applied_edits(model, body: MessagesRequest) -> dict | None:
    """`context_management.applied_edits` (None when the request has no context_management):
    the thinking turns cleared and the prompt tokens that saved (the two renderings' lengths,
    whose images, the same in both, cancel out)."""
    if body.context_management is None:
        return None
    turns = cleared_thinking_turns(body)
    if not turns:
        return {"applied_edits": []}
    kept = len(chat_prompt(model, to_chat_request(body))[1])
    full = len(chat_prompt(model, to_chat_request(body, clear_thinking=False))[1])
    edit = {
        "type": "clear_thinking_20251015",
        "cleared_thinking_turns": len(turns),
        "cleared_input_tokens": full - kept,
    }
    return {"applied_edits": [edit]}


@router.post("/v1/messages")
async def create_message(request: Request):
    started_at = time.monotonic()
    body = await off_loop(parse_request, await request.body(), MessagesRequest)
    model = await request_model(request, body.model)
    prepared, edits = await off_loop(_prepare, model, body)
    generation = await or_disconnect(request, Generation.of_chat(model, prepared, started_at))
    context = _MessageContext(body, model, prepared.plan, prepared.params, edits)
    if body.stream:
        return EventStream(_message_stream(generation, context), generation.aclose)
    state = await or_disconnect(request, generation.collect())
    return await json_response(context.response, state)


def _count(model, body: CountTokensRequest) -> dict:
    """The prompt's tokens as /v1/messages prepares them (images expanded), so the number is
    the one that request's usage reports."""
    prepared = prepare_chat(model, to_chat_request(body), {}, budget_param=_BUDGET)
    return {"input_tokens": len(prepared.prompt_ids)}


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict:
    body = await off_loop(parse_request, await request.body(), CountTokensRequest)
    model = await request_model(request, body.model)
    return await off_loop(_count, model, body)
