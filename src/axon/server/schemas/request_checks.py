"""Checks of the parts of an OpenAI request that pydantic leaves free-form (tools, tool_choice,
response_format, content parts, any JSON value), run when the request is parsed, so that bad
input is a 400 naming the field before any work is done.

Size caps (axon's own, generous for real clients, small enough that no request can make the
server build an unbounded grammar or prompt):
  tools: at most MAX_TOOLS, MAX_TOOLS_BYTES of JSON in all
  a JSON schema (response_format, a tool's parameters): MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH levels
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel

from axon.server.errors import BadRequest

MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 * 1024
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 64
TOOL_CHOICES = ("none", "auto", "required")
IMAGE_PARTS = ("image_url", "image")  # chat's (and HF's) image parts


def non_finite_path(value: Any, path: str) -> str | None:
    """Where in `value` (named from `path`) a NaN or infinity sits, or None: Python's JSON
    reader takes them, the JSON writer of every response refuses them."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return where
        elif isinstance(item, dict | BaseModel):
            pairs = item.items() if isinstance(item, dict) else iter(item)
            stack.extend((f"{where}.{key}", child) for key, child in pairs)
        elif isinstance(item, list):
            stack.extend((f"{where}[{index}]", child) for index, child in enumerate(item))
    return None


def json_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def json_depth(value: Any) -> int:
    """How many containers deep `value` nests (0 for a scalar); iterative, any depth."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_schema(schema: Any, param: str) -> None:
    """Raises BadRequest unless `schema` is a JSON schema object within the size caps."""
    if not isinstance(schema, dict):
        raise BadRequest(f"{param} must be a JSON schema object", param=param)
    if json_size(schema) > MAX_SCHEMA_BYTES:
        raise BadRequest(f"{param} is larger than {MAX_SCHEMA_BYTES} bytes", param=param)
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise BadRequest(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)


def _check_function(function: Any, where: str) -> None:
    if not isinstance(function, dict):
        raise BadRequest(f"{where} must be an object", param=where)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name must be a non-empty string", param=f"{where}.name")
    if function.get("parameters") is not None:
        check_schema(function["parameters"], f"{where}.parameters")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise BadRequest(f"{where}.strict must be a boolean", param=f"{where}.strict")


def check_tools(tools: list | None, flat: bool) -> None:
    """Raises BadRequest unless every tool is a function tool: chat's
    `{"type": "function", "function": {"name", "parameters"?}}`, or with `flat` (responses)
    `{"type": "function", "name", "parameters"?}` (the nested form is taken there too)."""
    if not tools:
        return
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    if json_size(tools) > MAX_TOOLS_BYTES:
        raise BadRequest(f"tools: larger than {MAX_TOOLS_BYTES} bytes of JSON", param="tools")
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if tool.get("type") != "function":
            message = f"{where}.type must be 'function', got {tool.get('type')!r}"
            raise BadRequest(message, param=f"{where}.type")
        if flat and "function" not in tool:
            _check_function(tool, where)
        else:
            _check_function(tool.get("function"), f"{where}.function")


def check_tool_choice(tool_choice: Any) -> None:
    """Raises BadRequest unless `tool_choice` is none/auto/required or names a function
    (`{"type": "function", "function": {"name"}}`, or responses' `{"type": "function", "name"}`)."""
    if tool_choice is None or tool_choice in TOOL_CHOICES:
        return
    if isinstance(tool_choice, str):
        message = f"tool_choice must be one of {TOOL_CHOICES} or a function, got {tool_choice!r}"
        raise BadRequest(message, param="tool_choice")
    function = tool_choice.get("function", tool_choice)
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str) or not name:
        message = 'tool_choice must be {"type": "function", "function": {"name": ...}}'
        raise BadRequest(message, param="tool_choice")


def check_response_format(response_format: dict | None) -> None:
    """Raises BadRequest unless `response_format` is text, json_object or a json_schema whose
    `json_schema.schema` is a schema object within the caps."""
    if response_format is None:
        return
    kind = response_format.get("type")
    if kind in ("text", "json_object"):
        return
    if kind != "json_schema":
        message = f"response_format.type {kind!r} is not one of text, json_object, json_schema"
        raise BadRequest(message, param="response_format.type")
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict):
        message = "response_format.json_schema must be an object with a schema"
        raise BadRequest(message, param="response_format.json_schema")
    check_schema(json_schema.get("schema"), "response_format.json_schema.schema")


def text_format_as_response_format(text_format: Any, param: str = "text.format") -> dict | None:
    """/v1/responses' `text.format` (`{"type": "json_schema", "name", "schema", "strict"?,
    "description"?}`, `json_object` or `text`) as chat's `response_format`, which the engine
    enforces the same way; raises BadRequest naming the bad part."""
    if text_format is None:
        return None
    if not isinstance(text_format, dict):
        raise BadRequest(f"{param} must be an object", param=param)
    kind = text_format.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        message = f"{param}.type {kind!r} is not one of text, json_object, json_schema"
        raise BadRequest(message, param=f"{param}.type")
    name = text_format.get("name", "output")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{param}.name must be a non-empty string", param=f"{param}.name")
    strict = text_format.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{param}.strict must be a boolean", param=f"{param}.strict")
    check_schema(text_format.get("schema"), f"{param}.schema")
    json_schema = {"name": name, "schema": text_format["schema"], "strict": strict}
    return {"type": "json_schema", "json_schema": json_schema}


def check_content_parts(content: Any, where: str) -> None:
    """Raises BadRequest for a content part of a type this server does not know (text, and
    images, which only a model with a vision tower takes: openai_chat.request_image_parts)."""
    if not isinstance(content, list):
        return
    for index, part in enumerate(content):
        param = f"{where}[{index}]"
        kind = part.get("type")
        if kind not in ("text", *IMAGE_PARTS):
            raise BadRequest(f"{param}.type {kind!r} is not supported", param=f"{param}.type")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise BadRequest(f"{param}.text must be a string", param=f"{param}.text")


def check_continuation(continue_final: bool, generation_prompt_sent: bool, roles: list) -> None:
    """vLLM's rule for `continue_final_message`: not with `add_generation_prompt: true` sent
    explicitly (left out, it is off while continuing), and only after an assistant message,
    whose open turn the model then continues. Raises BadRequest naming the field."""
    if not continue_final:
        return
    if generation_prompt_sent:
        message = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        raise BadRequest(message, param="continue_final_message")
    if not roles or roles[-1] != "assistant":
        message = "continue_final_message needs the last message to be an assistant message"
        raise BadRequest(message, param="continue_final_message")
