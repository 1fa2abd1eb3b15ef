"""The Ollama API's request schemas, and their translation into a chat completions request so
that `/api/chat` and `/api/generate` run through the chat pipeline (template, images, parsers,
grammar, engine).

Unknown fields are refused (a 400 naming them), as on the Anthropic routes: a field axon would
not honour is never silently dropped. Translation: a message's `images` (base64) become
`image_url` parts with a `data:` URI (the format is sniffed from the bytes), `thinking` the
assistant's `reasoning_content`, `tool_calls` (arguments as an object) OpenAI's calls (arguments
as a JSON string), a tool message's `tool_name` its `name`; `format` is chat's
`response_format`, `think` the template's `enable_thinking` or a `reasoning_effort`, `options`
the sampling fields (ollama_options.py).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from axon.server.errors import BadRequest
from axon.server.schemas.ollama_options import (
    THINK_EFFORTS,
    option_of,
    response_format,
    sampling_fields,
)
from axon.server.schemas.protocol import ChatCompletionRequest, param_of

KeepAlive = float | int | str | None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Model(_Strict):
    model: str = Field(min_length=1)


class ToolCallFunction(_Strict):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None


class ToolCall(_Strict):
    id: str | None = None
    type: str | None = None
    function: ToolCallFunction


class Message(_Strict):
    role: str
    content: str | None = ""  # null reads as "", as Ollama's own server reads it
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Generating(_Model):
    """What /api/chat and /api/generate share."""

    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: KeepAlive = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check_logprobs(self) -> None:
        if self.logprobs or self.top_logprobs:
            param = "logprobs" if self.logprobs else "top_logprobs"
            raise BadRequest(f"{param} is not supported on the Ollama routes", param=param)


class ChatRequest(_Generating):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generating):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None

    def check_unsupported(self) -> None:
        """Raises BadRequest for the fields axon cannot honour (when set to something)."""
        if self.template:
            message = "template: Ollama's Go templates are not supported; the model's own chat "
            raise BadRequest(message + "template is used (or raw: true)", param="template")
        if self.suffix:
            raise BadRequest("suffix: fill-in-the-middle is not supported", param="suffix")
        if self.context:
            message = "context: the deprecated token context is not supported; use /api/chat"
            raise BadRequest(message, param="context")
        if self.raw and (self.images or self.system or self.think is not None):
            name = "images" if self.images else "system" if self.system else "think"
            raise BadRequest(f"{name} needs the chat template: not with raw: true", param=name)


class EmbedRequest(_Model):
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    dimensions: int | None = Field(None, ge=1)


class EmbeddingsRequest(_Model):
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class _Named(_Strict):
    model: str | None = None
    name: str | None = None  # Ollama's older spelling of `model`

    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise BadRequest("model is required", param="model")
        return name


class ShowRequest(_Named):
    verbose: bool = False  # the answer is the same either way: axon has no GGUF key dump


class PullRequest(_Named):
    insecure: bool = False  # nothing is fetched, so no connection to secure
    stream: bool = True


# ---- translation ----------------------------------------------------------------------------


def _image_parts(images: list[str]) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": f"data:;base64,{data}"}} for data in images]


def chat_message(message: Message) -> dict:
    """An Ollama message as a chat completions message."""
    text = message.content or ""
    out: dict[str, Any] = {"role": message.role, "content": text}
    if message.images:
        out["content"] = [{"type": "text", "text": text}, *_image_parts(message.images)]
    if message.thinking:
        out["reasoning_content"] = message.thinking
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id or f"call_{number}",
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": json.dumps(call.function.arguments, ensure_ascii=False),
                },
            }
            for number, call in enumerate(message.tool_calls)
        ]
    if message.tool_name:
        out["name"] = message.tool_name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def generate_messages(body: GenerateRequest) -> list[dict]:
    """/api/generate's prompt (and system prompt, images) as chat messages."""
    messages = [{"role": "system", "content": body.system}] if body.system else []
    user = Message(role="user", content=body.prompt, images=body.images)
    return [*messages, chat_message(user)]


def think_fields(think: bool | str | None) -> dict:
    """`think` as chat fields: true/false switch the template's thinking, an effort is a
    reasoning_effort (a thinking budget, reasoning_budget.py)."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    if think in THINK_EFFORTS:
        return {"reasoning_effort": think}
    message = f"think must be true, false or one of {THINK_EFFORTS}, got {think!r}"
    raise BadRequest(message, param="think")


def to_chat_request(
    body: ChatRequest | GenerateRequest, messages: list[dict], tools=None
) -> tuple[ChatCompletionRequest, int | None]:
    """(the chat completions request `body` means, its num_ctx); raises BadRequest naming the
    Ollama field (`options.temperature`) when a value is refused."""
    fields, num_ctx = sampling_fields(body.options)
    chat = {"model": body.model, "messages": messages, "stream": body.stream, **fields}
    chat.update(think_fields(body.think))
    if tools:
        chat["tools"] = tools
    chat_format = response_format(body.format)
    if chat_format is not None:
        chat["response_format"] = chat_format
    try:
        return ChatCompletionRequest.model_validate(chat), num_ctx
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = param_of(error["loc"]) or ""
        name = option_of(param.split(".")[0].split("[")[0])
        param = name + param[len(param.split(".")[0].split("[")[0]) :]
        raise BadRequest(f"{param}: {error['msg']}", param=param) from None
