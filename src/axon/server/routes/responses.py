"""`POST /v1/responses`, stateless: the input items become chat messages (neuron's translation),
and the answer is one `message` output item, whole or as named SSE events (no `[DONE]`)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from pydantic import ValidationError

from axon.server.admission import check_request
from axon.server.chat_output import ChatOutputPlan, ChoiceOutput
from axon.server.chat_pipeline import PreparedChat, prepare_chat
from axon.server.errors import BadRequest
from axon.server.generation import (
    EventStream,
    Generation,
    or_disconnect,
    request_model,
)
from axon.server.offload import json_response, off_loop
from axon.server.schemas.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    SampleCursor,
    error_body,
    now,
    parse_request,
    random_id,
    sse,
)
from axon.server.schemas.responses import ResponsesRequest

router = APIRouter()
_TEXT_PARTS = ("input_text", "output_text", "text")


def _message_content(content, where: str) -> str | list[dict]:
    """A message item's content as chat content: its text parts joined into one string, or,
    when it holds `input_image` parts, chat parts (text, and `image_url` for each image) in
    order. Any other part type is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise BadRequest(
            f"{where}.content must be a string or a list of parts", param=f"{where}.content"
        )
    parts = [_chat_part(part, f"{where}.content[{index}]") for index, part in enumerate(content)]
    if all(part["type"] == "text" for part in parts):
        return "\n\n".join(part["text"] for part in parts)
    return parts


def _chat_part(part: dict, param: str) -> dict:
    """One Responses content part as a chat content part."""
    kind = part.get("type")
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            message = f"{param}: input_image needs an image_url (file_id is not supported)"
            raise BadRequest(message, param=f"{param}.image_url")
        detail = part.get("detail") or "auto"
        return {"type": "image_url", "image_url": {"url": url, "detail": detail}}
    if kind not in _TEXT_PARTS:
        raise BadRequest(f"{param}.type {kind!r} is not supported", param=f"{param}.type")
    if not isinstance(part.get("text"), str):
        raise BadRequest(f"{param}.text must be a string", param=f"{param}.text")
    return {"type": "text", "text": part["text"]}


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
    """Responses' flat function tools in chat's nested shape, as chat templates expect
    (`strict` kept: chat_output enforces it)."""
    if not tools:
        return None
    nested = []
    for tool in tools:
        if tool.get("type") == "function" and "function" not in tool:
            function = {k: v for k, v in tool.items() if k != "type"}
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
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        chat_template_kwargs=body.chat_template_kwargs,
        response_format=body.response_format(),
        add_generation_prompt=True,
        reasoning_effort=body.reasoning.effort if body.reasoning is not None else None,
        thinking_token_budget=None,
    )


class _ResponseContext:
    """One request's ids and the builders of its response object and output item."""

    def __init__(self, body: ResponsesRequest, model, params, plan: ChatOutputPlan):
        self.body, self.model, self.params, self.plan = body, model, params, plan
        self.id, self.item_id, self.created = random_id("resp_"), random_id("msg_"), now()
        self.reasoning_id = random_id("rs_")
        self.sequence_number = 0

    def reasoning_item(self, text: str, status: str) -> dict:
        part = {"type": "reasoning_text", "text": text}
        kind = {"type": "reasoning", "id": self.reasoning_id, "summary": []}
        return {**kind, "content": [part] if text else [], "status": status}

    def output_items(self, text: str, status: str) -> list[dict]:
        """The output items of the whole `text`: reasoning (if any), the message (unless the
        answer is only tool calls), then one function_call item per call."""
        reason = "length" if status == "incomplete" else None
        message = ChoiceOutput(self.plan).message(text, reason)
        items = []
        if message.get("reasoning_content"):
            items.append(self.reasoning_item(message["reasoning_content"], "completed"))
        calls = message.get("tool_calls") or []
        if message["content"] or not calls:
            items.append(self.item(message["content"] or "", status))
        for call in calls:
            function = call["function"]
            items.append(
                {
                    "type": "function_call",
                    "id": "fc_" + call["id"].removeprefix("call_"),
                    "call_id": call["id"],
                    "name": function["name"],
                    "arguments": function["arguments"],
                    "status": "completed",
                }
            )
        return items

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
            "model": self.body.model,  # the name the client sent: an alias stays one
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "previous_response_id": None,
            "parallel_tool_calls": self.plan.parallel_tool_calls,
            "tool_choice": self.body.tool_choice or "auto",
            "tools": self.body.tools or [],
            "text": {"format": self.text_format()},
            "metadata": self.body.metadata or {},
        }

    def text_format(self) -> dict:
        text = self.body.text
        return text.format if text is not None and text.format else {"type": "text"}

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
        return self.response(status, self.output_items(sample.text, status), usage)

    def event(self, kind: str, **data) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **data}
        self.sequence_number += 1
        return sse(payload, event=kind)


def _message_opening(context: _ResponseContext, index: int):
    item = context.item("", "in_progress", content=False)
    yield context.event("response.output_item.added", output_index=index, item=item)
    part = {"type": "output_text", "text": "", "annotations": []}
    where = {"item_id": context.item_id, "output_index": index, "content_index": 0}
    yield context.event("response.content_part.added", **where, part=part)


def _closing_events(context: _ResponseContext, state, message_index: int | None):
    """The end of the open message (its item as the final response has it), any items the
    stream did not carry (tool calls), and response.completed."""
    final = context.final(state)
    for index, item in enumerate(final["output"]):
        if item["type"] == "reasoning":
            continue
        if item["type"] == "message" and index == message_index:
            text = item["content"][0]["text"]
            where = {"item_id": context.item_id, "output_index": index, "content_index": 0}
            yield context.event("response.output_text.done", **where, text=text)
            yield context.event("response.content_part.done", **where, part=item["content"][0])
        else:
            yield context.event("response.output_item.added", output_index=index, item=item)
        yield context.event("response.output_item.done", output_index=index, item=item)
    yield context.event("response.completed", response=final)


class _StreamItems:
    """Which output items a response stream has open: reasoning first, then the message."""

    def __init__(self, context: _ResponseContext):
        self.context, self.output = context, ChoiceOutput(context.plan)
        self.reasoning = ""
        self.reasoning_open = False
        self.message_index: int | None = None

    def events(self, text: str, final: bool, reason: str | None = None):
        for delta in self.output.deltas(text, final, reason):
            if "reasoning_content" in delta:
                yield from self._reasoning(delta["reasoning_content"])
            elif delta.get("content"):
                yield from self._open_message()
                where = {"item_id": self.context.item_id, "output_index": self.message_index}
                yield self.context.event(
                    "response.output_text.delta", **where, content_index=0, delta=delta["content"]
                )
        if final and not self.output.num_calls:
            yield from self._open_message()

    def _reasoning(self, text: str):
        context = self.context
        if not self.reasoning_open:
            self.reasoning_open = True
            item = context.reasoning_item("", "in_progress")
            yield context.event("response.output_item.added", output_index=0, item=item)
        self.reasoning += text
        where = {"item_id": context.reasoning_id, "output_index": 0, "content_index": 0}
        yield context.event("response.reasoning_text.delta", **where, delta=text)

    def _open_message(self):
        if self.message_index is not None:
            return
        context = self.context
        if self.reasoning_open:
            where = {"item_id": context.reasoning_id, "output_index": 0, "content_index": 0}
            yield context.event("response.reasoning_text.done", **where, text=self.reasoning)
            item = context.reasoning_item(self.reasoning, "completed")
            yield context.event("response.output_item.done", output_index=0, item=item)
        self.message_index = 1 if self.reasoning_open else 0
        yield from _message_opening(context, self.message_index)


async def _response_stream(generation: Generation, context: _ResponseContext):
    cursor = SampleCursor()
    items = _StreamItems(context)
    try:
        shell = context.response("in_progress", [])
        yield context.event("response.created", response=shell)
        yield context.event("response.in_progress", response=shell)
        async for state in generation:
            step = cursor.advance(state.samples[0])
            if step is not None:
                reason = state.samples[0].finish_reason if cursor.done else None
                for event in items.events(step[0], cursor.done, reason):
                    yield event
        for event in _closing_events(context, generation.state, items.message_index):
            yield event
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which has started
        error = error_body(exc)["error"]
        yield context.event("error", **{k: v for k, v in error.items() if k != "type"})
    finally:
        await generation.aclose()


@router.post("/v1/responses")
async def create_response(request: Request):
    started_at = time.monotonic()
    body = await off_loop(parse_request, await request.body(), ResponsesRequest)
    if body.previous_response_id is not None:
        raise BadRequest(
            "previous_response_id is not supported: this server keeps no conversation state; "
            "send the whole conversation as input",
            code="chained_conversation_not_supported",
            param="previous_response_id",
        )
    model = await request_model(request, body.model)
    check_request(model, body)
    prepared = await off_loop(_prepare, model, body)
    generation = await or_disconnect(request, Generation.of_chat(model, prepared, started_at))
    context = _ResponseContext(body, model, prepared.params, prepared.plan)
    if body.stream:
        return EventStream(_response_stream(generation, context), generation.aclose)
    state = await or_disconnect(request, generation.collect())
    return await json_response(context.final, state)


def _prepare(model, body: ResponsesRequest) -> PreparedChat:
    """The prompt text and ids, output plan, sampling params and images: request-sized work,
    off the loop."""
    try:
        return prepare_chat(
            model,
            _as_chat_request(body),
            {},
            sampling=body,
            prompt_field="input",
            budget_param="reasoning.effort",
        )
    except BadRequest as exc:
        # The chat pipeline names chat's field; this request spelled it text.format.
        if not (exc.param or "").startswith("response_format"):
            raise
        exc.param = exc.param.replace("response_format", "text.format", 1)
        exc.message = exc.message.replace("response_format", "text.format")
        exc.args = (exc.message,)
        raise
