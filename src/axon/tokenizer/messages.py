"""OpenAI-shaped chat messages normalised into what HF chat templates are written against.

The reference is vLLM's OpenAI server (`parse_chat_messages` and `_postprocess_messages` in its
`entrypoints/chat_utils.py`): what it hands transformers' `apply_chat_template` for a request is
what real templates are tested with, so every route that renders (chat, Anthropic, Responses,
`/tokenize`) goes through `normalize_messages` here, once, inside `render_chat`:

- `content` is always present: null becomes "", so `message.content` never fails. (The reference
  gives [] to templates that loop over parts; "" renders wherever [] does, and also in templates
  that take `content[0]['text']` of a non-string, like Devstral's.)
- Content parts: text parts joined with "\\n" for string templates; for part-looping templates
  text parts are `{"type": "text", "text": ...}` and images `{"type": "image", "url": ...}`, except
  a `tool` message made only of text parts, which is joined into a string (most templates render
  tool results as strings).
- Assistant turns: an empty `tool_calls` list is dropped (the template takes its plain path);
  `function.arguments` given as a JSON string is parsed (templates iterate `arguments|items` or
  print `arguments|tojson`), a string that is not JSON becomes {} as in the reference
  (`parse_arguments=False` keeps the strings: render_chat's second try, for templates that
  concatenate them, like functionary's); the reasoning of an earlier turn is passed as both
  `reasoning` and `reasoning_content`, whichever the client sent (templates read one or the
  other).
- Tool call ids, with `call_id_length` (templates that take only ids of one length, like
  Mistral's 9 alphanumeric characters): each id that is not already such an id is mapped to one
  (a hash of it, so an assistant's call and the tool result answering it keep matching), as vLLM
  does for Mistral models.

String content stays a string in both formats (the reference wraps it in a text part for
part-looping templates: in llama.cpp's corpus all of those render both alike but Gemma 4, which
prints a wrapped system prompt as a list). Other fields pass through untouched.
"""

from __future__ import annotations

import hashlib
import json
import string
from typing import Any

STRING = "string"  # the template concatenates content as text
OPENAI = "openai"  # the template loops over content parts


def normalize_messages(
    messages: list[dict],
    fmt: str = STRING,
    parse_arguments: bool = True,
    call_id_length: int | None = None,
) -> list[dict]:
    """New message dicts in the shapes templates take (see the module docstring); `fmt` is the
    template's content format (chat_template.content_format), `call_id_length` the one length
    of tool call ids it accepts (chat_template.call_id_length). `messages` is not changed."""
    normalized = [_message(message, fmt, parse_arguments) for message in messages]
    if call_id_length:
        for message in normalized:
            _fix_call_ids(message, call_id_length)
    return normalized


_ALPHANUMERIC = string.ascii_letters + string.digits


def fixed_length_id(call_id: Any, length: int) -> Any:
    """`call_id` as `length` alphanumeric characters: unchanged when it is one already, else
    the leading digits of its SHA-256 in base 62 (the same id always maps to the same one)."""
    if not isinstance(call_id, str) or (len(call_id) == length and call_id.isalnum()):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest(), "big")
    digits = []
    for _ in range(length):
        number, digit = divmod(number, len(_ALPHANUMERIC))
        digits.append(_ALPHANUMERIC[digit])
    return "".join(digits)


def _fix_call_ids(message: dict, length: int) -> None:
    if message.get("role") == "tool" and "tool_call_id" in message:
        message["tool_call_id"] = fixed_length_id(message["tool_call_id"], length)
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if isinstance(calls, list):
        message["tool_calls"] = [
            {**call, "id": fixed_length_id(call["id"], length)}
            if isinstance(call, dict) and "id" in call
            else call
            for call in calls
        ]


def has_string_arguments(messages: list[dict]) -> bool:
    """Whether an assistant turn gives a tool call's arguments as a string (OpenAI's wire form)."""
    return any(
        isinstance(call, dict)
        and isinstance(call.get("function"), dict)
        and isinstance(call["function"].get("arguments"), str)
        for message in messages
        if message.get("role") == "assistant"
        for call in message.get("tool_calls") or []
    )


def _message(message: dict, fmt: str, parse_arguments: bool) -> dict:
    message = dict(message)
    role = message.get("role")
    message["content"] = _content(message.get("content"), fmt, role)
    if role == "assistant":
        _assistant_fields(message, parse_arguments)
    return message


def _content(content: Any, fmt: str, role: Any) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    parts = content
    if not isinstance(parts, list):
        return content
    texts = [part.get("text") for part in parts if _is_text(part)]
    texts = [text for text in texts if isinstance(text, str)]
    if fmt == STRING or (role == "tool" and all(_is_text(part) for part in parts)):
        return "\n".join(texts)
    return [_part(part) for part in parts]


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text"


def _part(part: Any) -> Any:
    """A content part as HF templates spell it: text as {type, text}, `image_url` as
    {"type": "image", "url": ...}; other parts verbatim."""
    if _is_text(part):
        return {"type": "text", "text": part.get("text")}
    if isinstance(part, dict) and part.get("type") == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        return {"type": "image", "url": url}
    return part


def _assistant_fields(message: dict, parse_arguments: bool) -> None:
    calls = message.get("tool_calls")
    if isinstance(calls, list) and not calls:
        del message["tool_calls"]
    elif isinstance(calls, list) and parse_arguments:
        message["tool_calls"] = [_tool_call(call) for call in calls]
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if reasoning is not None:
        message["reasoning"] = message["reasoning_content"] = reasoning


def _tool_call(call: Any) -> Any:
    """The call with its arguments as the parsed JSON value; {} when they are not JSON or not
    given (the reference's choice: a template iterating them still renders)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {}
    elif not isinstance(arguments, dict | list):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}


def conversation_shapes(messages: list[dict], tools: list | None = None) -> list[str]:
    """The message shapes a conversation uses that templates may refuse, in words (for the
    error that names what a template cannot render)."""
    shapes = []
    roles = [message.get("role") for message in messages]
    if "system" in roles or "developer" in roles:
        first = roles[0] in ("system", "developer")
        shapes.append("a system message" + ("" if first else " after the first turn"))
    if any(isinstance(message.get("content"), list) for message in messages):
        shapes.append("content parts")
    calls = [len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant"]
    if any(calls):
        shapes.append("assistant tool_calls" + (" (several in one turn)" if max(calls) > 1 else ""))
    if "tool" in roles:
        shapes.append("tool results")
    if any(m.get("reasoning") or m.get("reasoning_content") for m in messages):
        shapes.append("reasoning of an earlier turn")
    if tools:
        shapes.append("tools")
    return shapes
