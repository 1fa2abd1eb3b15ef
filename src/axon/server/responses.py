"""`POST /v1/responses`, stateless: the input items become chat messages (neuron's translation),
and the answer is one `message` output item, whole or as named SSE events (no `[DONE]`)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from pydantic import ValidationError

from axon.server.errors import BadRequest
from axon.server.openai_chat import chat_prompt
from axon.server.openai_completions import (
    EventStream,
    Generation,
    or_disconnect,
    served_model,
)
from axon.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ResponsesRequest,
    SampleCursor,
    error_body,
    now,
    parse_request,
    random_id,
    sse,
)
from axon.server.sampling import build_sampling_params

router = APIRouter()
_TEXT_PARTS = ("input_text", "output_text", "text")


def _message_content(content, where: str):
    """A message item's content as chat content: one string unless it carries an image."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise BadRequest(
            f"{where}.content must be a string or a list of parts", param=f"{where}.content"
        )
    if not any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return "\n\n".join(str(p.get("text", "")) for p in content if p.get("type") in _TEXT_PARTS)
    parts = []
    for part in content:
        if part.get("type") == "input_image":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif part.get("type") in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text", ""))})
    return parts


def _item_message(item: dict, where: str) -> dict | None:
    """The chat message one input item becomes (None: dropped, as `reasoning` is)."""
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        return {
            "role": item.get("role", "user"),
            "content": _message_content(item.get("content"), where),
        }
    if kind == "function_call":
        call = {"name": item.get("name"), "arguments": item.get("arguments", "")}
        tool_call = {"id": item.get("call_id"), "type": "function", "function": call}
        return {"role": "assistant", "content": "", "tool_calls": [tool_call]}
    if kind == "function_call_output":
        output = item.get("output", "")
        output = output if isinstance(output, str) else str(output)
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
    if kind == "reasoning":
        return None
    raise BadRequest(f"{where}.type {kind!r} is not supported", param=f"{where}.type")


def to_chat_messages(body: ResponsesRequest) -> list[dict]:
    """neuron's translation: instructions -> system, a string input -> one user message."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for index, item in enumerate(body.input):
        message = _item_message(item, f"input[{index}]")
        if message is not None:
            messages.append(message)
    if not messages:
        raise BadRequest("input must contain at least one message", param="input")
    return messages


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools in chat's nested shape, as chat templates expect."""
    if not tools:
        return None
    nested = []
    for tool in tools:
        if tool.get("type") == "function" and "function" not in tool:
            function = {k: v for k, v in tool.items() if k not in ("type", "strict")}
            tool = {"type": "function", "function": function}
        nested.append(tool)
    return nested


def _as_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    try:
        messages = [ChatMessage(**message) for message in to_chat_messages(body)]
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        raise BadRequest(f"input: {error['msg']}", param="input") from None
    return ChatCompletionRequest.model_construct(
        model=body.model,
        messages=messages,
        tools=_chat_tools(body.tools),
        chat_template_kwargs=body.chat_template_kwargs,
        add_generation_prompt=True,
    )


class _ResponseContext:
    """One request's ids and the builders of its response object and output item."""

    def __init__(self, body: ResponsesRequest, model, params):
        self.body, self.model, self.params = body, model, params
        self.id, self.item_id, self.created = random_id("resp_"), random_id("msg_"), now()
        self.sequence_number = 0

    def item(self, text: str, status: str, content: bool = True) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "type": "message",
            "id": self.item_id,
            "role": "assistant",
            "status": status,
            "content": [part] if content else [],
        }

    def response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model.id,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "previous_response_id": None,
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": self.body.tools or [],
            "metadata": {},
        }

    def final(self, state) -> dict:
        sample = state.samples[0]
        status = "incomplete" if sample.finish_reason == "length" else "completed"
        generated = len(sample.token_ids)
        prompt_tokens = len(state.prompt_token_ids)
        usage = {
            "input_tokens": prompt_tokens,
            "output_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        }
        return self.response(status, [self.item(sample.text, status)], usage)

    def event(self, kind: str, **data) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **data}
        self.sequence_number += 1
        return sse(payload, event=kind)


def _opening_events(context: _ResponseContext):
    shell = context.response("in_progress", [])
    yield context.event("response.created", response=shell)
    yield context.event("response.in_progress", response=shell)
    item = context.item("", "in_progress", content=False)
    yield context.event("response.output_item.added", output_index=0, item=item)
    part = {"type": "output_text", "text": "", "annotations": []}
    where = {"item_id": context.item_id, "output_index": 0, "content_index": 0}
    yield context.event("response.content_part.added", **where, part=part)


def _closing_events(context: _ResponseContext, state):
    final = context.final(state)
    item = final["output"][0]
    text = item["content"][0]["text"]
    where = {"item_id": context.item_id, "output_index": 0, "content_index": 0}
    yield context.event("response.output_text.done", **where, text=text)
    yield context.event("response.content_part.done", **where, part=item["content"][0])
    yield context.event("response.output_item.done", output_index=0, item=item)
    yield context.event("response.completed", response=final)


async def _response_stream(generation: Generation, context: _ResponseContext):
    cursor = SampleCursor()
    where = {"item_id": context.item_id, "output_index": 0, "content_index": 0}
    try:
        for event in _opening_events(context):
            yield event
        async for state in generation:
            step = cursor.advance(state.samples[0])
            if step is not None and step[0]:
                yield context.event("response.output_text.delta", **where, delta=step[0])
        for event in _closing_events(context, generation.state):
            yield event
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which has started
        error = error_body(exc)["error"]
        yield context.event("error", **{k: v for k, v in error.items() if k != "type"})
    finally:
        await generation.aclose()


@router.post("/v1/responses")
async def create_response(request: Request):
    started_at = time.monotonic()
    body = parse_request(await request.body(), ResponsesRequest)
    if body.previous_response_id is not None:
        raise BadRequest(
            "previous_response_id is not supported: this server keeps no conversation state; "
            "send the whole conversation as input",
            code="chained_conversation_not_supported",
            param="previous_response_id",
        )
    model = served_model(request, body.model)
    text, prompt_ids = chat_prompt(model, _as_chat_request(body))
    params = build_sampling_params(
        body, len(prompt_ids), model.max_model_len, model.generation_defaults, prompt_field="input"
    )
    generation = await or_disconnect(
        request, Generation.start(model, prompt_ids, params, text, started_at)
    )
    context = _ResponseContext(body, model, params)
    if body.stream:
        return EventStream(_response_stream(generation, context), generation.aclose)
    state = await or_disconnect(request, generation.collect())
    return context.final(state)
