"""The Anthropic Messages request schema, and its translation into a chat completions request so
that `/v1/messages` runs through the chat pipeline (template, parsers, grammar, engine).

Unlike the OpenAI schemas, unknown fields are refused (Anthropic's API refuses them too): a field
this server would not honour is a 400 naming it, never silently dropped. `cache_control` is
accepted wherever Anthropic allows it and has nothing to do: the prefix cache reuses every
repeated prefix on its own.

Translation (neuron's gateway does the same): `system` becomes a system message, with the text
of any `role: "system"` message appended to it in order; `text` and
`image` blocks become chat content parts (an image as an `image_url` part: a `data:` URI for a
base64 source, the URL for a url source, under the chat path's media policy); `tool_use` blocks
become the assistant's `tool_calls`, `tool_result` blocks become `tool` messages, `thinking`
blocks the assistant's `reasoning_content`; `tools[].input_schema` is the function's
`parameters`; tool_choice `any` is `required`, `tool` names a function; `thinking` sets the
template's `enable_thinking` (off unless asked for, as Anthropic's default is no thinking) and
its `budget_tokens` is the engine's thinking budget;
`output_config.format` (a JSON schema) is chat's `response_format`, enforced while decoding;
`context_management` clears old thinking (anthropic_context.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from axon.server.errors import BadRequest
from axon.server.schemas.anthropic_context import ContextManagement, cleared_thinking_turns
from axon.server.schemas.protocol import ChatCompletionRequest, StopString, param_of


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Block(_Strict):
    cache_control: dict[str, Any] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(_Strict):
    type: Literal["url"]
    url: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Strict):
    role: Literal["user", "assistant", "system"]  # system: folded into the system prompt
    content: str | list[ContentBlock]


class Tool(_Strict):
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    display: Literal["summarized"] | None = None


class Metadata(_Strict):
    user_id: str | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None  # `effort` has no meaning here: refused


class CountTokensRequest(_Strict):
    """`POST /v1/messages/count_tokens`: what the prompt is made of."""

    model: str
    context_management: ContextManagement | None = None
    cache_control: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[StopString] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None


# ---- translation ----------------------------------------------------------------------------


def _image_part(block: ImageBlock) -> dict:
    source = block.source
    if isinstance(source, Base64Source):
        url = f"data:{source.media_type};base64,{source.data}"
    else:
        url = source.url
    return {"type": "image_url", "image_url": {"url": url}}


def _part(block: TextBlock | ImageBlock) -> dict:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    return _image_part(block)


def _user_content(parts: list[dict]) -> str | list[dict]:
    """One text part as a plain string (as most clients send it), else the parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _tool_message(block: ToolResultBlock) -> dict:
    content = block.content
    if not isinstance(content, str):
        content = _user_content([_part(item) for item in content]) if content else ""
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _user_messages(message: Message, where: str) -> list[dict]:
    """A user turn: its tool results as `tool` messages, its text and images as user messages,
    in their order."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    messages, parts = [], []
    for index, block in enumerate(message.content):
        if isinstance(block, ToolResultBlock):
            if parts:
                messages.append({"role": "user", "content": _user_content(parts)})
                parts = []
            messages.append(_tool_message(block))
        elif isinstance(block, TextBlock | ImageBlock):
            parts.append(_part(block))
        else:
            param = f"{where}.content[{index}].type"
            raise BadRequest(
                f"{param}: {block.type!r} blocks belong to assistant turns", param=param
            )
    if parts:
        messages.append({"role": "user", "content": _user_content(parts)})
    return messages


def _assistant_message(message: Message, where: str, keep_thinking: bool = True) -> dict:
    """An assistant turn: text joined, tool_use blocks as tool_calls, thinking as reasoning
    (unless context editing cleared it: `keep_thinking` False)."""
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, reasoning, calls = [], [], []
    for index, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning += [block.thinking] if keep_thinking else []
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif not isinstance(block, RedactedThinkingBlock):  # redacted: nothing to show a model
            param = f"{where}.content[{index}].type"
            raise BadRequest(f"{param}: {block.type!r} blocks belong to user turns", param=param)
    assistant: dict = {"role": "assistant", "content": "\n".join(texts)}
    if reasoning:
        assistant["reasoning_content"] = "\n".join(reasoning)
    if calls:
        assistant["tool_calls"] = calls
    return assistant


def _system_parts(body: CountTokensRequest) -> list[dict]:
    """The system prompt's text parts: the top-level `system`, then the text of every
    `role: "system"` message in order (OpenAI-style clients put it there; Anthropic's API has
    no such role, so it is folded in rather than refused)."""
    if isinstance(body.system, str):
        parts = [{"type": "text", "text": body.system}] if body.system else []
    else:
        parts = [_part(block) for block in body.system or []]
    for index, message in enumerate(body.messages):
        if message.role != "system":
            continue
        if isinstance(message.content, str):
            parts += [{"type": "text", "text": message.content}] if message.content else []
            continue
        for number, block in enumerate(message.content):
            if not isinstance(block, TextBlock):
                param = f"messages[{index}].content[{number}].type"
                raise BadRequest(f"{param}: a system message holds text blocks only", param=param)
            parts.append(_part(block))
    return parts


def chat_messages(body: CountTokensRequest, clear_thinking: bool = True) -> list[dict]:
    """The conversation as chat messages, system messages folded into one system prompt, the
    thinking that `context_management` clears left out (unless not `clear_thinking`); raises
    BadRequest for a block in the wrong turn, no user or assistant turn, or a final assistant
    turn (a prefill to continue, which the chat pipeline does not do)."""
    cleared = set(cleared_thinking_turns(body)) if clear_thinking else set()
    system = _system_parts(body)
    messages = [{"role": "system", "content": _user_content(system)}] if system else []
    turns = [(i, message) for i, message in enumerate(body.messages) if message.role != "system"]
    if not turns:
        message = "messages: a user turn is required besides system messages"
        raise BadRequest(message, param="messages")
    for index, message in turns:
        where = f"messages[{index}]"
        if message.role == "user":
            messages.extend(_user_messages(message, where))
        else:
            messages.append(_assistant_message(message, where, index not in cleared))
    last, final = turns[-1]
    if final.role == "assistant":
        where = f"messages[{last}]"
        message = (
            f"{where}: a final assistant turn (prefill) is not supported; end with a user turn"
        )
        raise BadRequest(message, param=f"{where}.role")
    return messages


def _tool_choice(choice: ToolChoice | None) -> str | dict | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise BadRequest(
                "tool_choice.name is required for type 'tool'", param="tool_choice.name"
            )
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _enable_thinking(body: CountTokensRequest) -> bool:
    thinking = body.thinking
    if thinking is None or thinking.type == "disabled":
        return False
    budget = thinking.budget_tokens
    if thinking.type == "enabled" and (budget is None or budget < 1):
        message = "thinking.budget_tokens must be a positive integer when thinking is enabled"
        raise BadRequest(message, param="thinking.budget_tokens")
    limit = getattr(body, "max_tokens", None)
    if budget is not None and limit is not None and budget >= limit:
        message = f"thinking.budget_tokens ({budget}) must be less than max_tokens ({limit})"
        raise BadRequest(message, param="thinking.budget_tokens")
    return True


def _thinking_budget(body: CountTokensRequest) -> int | None:
    """budget_tokens of enabled thinking, enforced by the engine; None otherwise."""
    thinking = body.thinking
    return thinking.budget_tokens if thinking is not None and thinking.type == "enabled" else None


def _chat_fields(body: CountTokensRequest, clear_thinking: bool) -> dict:
    """The chat request's fields (no max_tokens: see to_chat_request)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                **({"description": tool.description} if tool.description is not None else {}),
                "parameters": tool.input_schema,
            },
        }
        for tool in body.tools or []
    ]
    choice = body.tool_choice
    output = body.output_config.format if body.output_config else None
    fields = {
        "model": body.model,
        "messages": chat_messages(body, clear_thinking),
        "tools": tools or None,
        "tool_choice": _tool_choice(choice),
        "parallel_tool_calls": not (choice and choice.disable_parallel_tool_use),
        "chat_template_kwargs": {"enable_thinking": _enable_thinking(body)},
        "thinking_token_budget": _thinking_budget(body),
        "response_format": (
            {"type": "json_schema", "json_schema": {"name": "output", "schema": output.json_schema}}
            if output is not None
            else None
        ),
    }
    if isinstance(body, MessagesRequest):
        fields.update(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences,
            user=body.metadata.user_id if body.metadata else None,
        )
    return fields


def to_chat_request(body: CountTokensRequest, clear_thinking: bool = True) -> ChatCompletionRequest:
    """The chat completions request this Anthropic request means (with not `clear_thinking`,
    as if `context_management` cleared nothing). Its max_tokens is left unset (the room the
    context leaves); the route caps it at the requested one, so a request whose max_tokens
    overruns the context stops at the context (Anthropic's `model_context_window_exceeded`)
    instead of failing. Raises BadRequest."""
    try:
        return ChatCompletionRequest.model_validate(_chat_fields(body, clear_thinking))
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = param_of(error["loc"])
        raise BadRequest(f"{param}: {error['msg']}", param=param) from None
