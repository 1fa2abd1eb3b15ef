"""Qwen3.5 / Qwen3-Coder tool calls: XML-ish markup inside `<tool_call>…</tool_call>`.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The start (index, id, name) goes out when `<function=NAME>` is complete; the arguments are
built as JSON text: a string parameter streams as it arrives, any other type (from the tool's
JSON schema) is converted when its value is complete. A `<tool_call>` not followed by
`<function=` is returned as content.
"""

from __future__ import annotations

import ast
import json

import regex

from axon.tokenizer.parsers.base import (
    TOOL_CALL_END,
    Event,
    ToolCallArguments,
    ToolCallParser,
    ToolCallStart,
    find_marker,
    tool_call_id,
)

_FUNCTION = regex.compile(r"\s*<function=([^>\n]{1,256})>")
# The lookahead makes a match at the very end of the text partial: a newline may follow.
_PARAMETER = regex.compile(r"\s*<parameter=([^>\n]{1,256})>(?:\n|(?=[^\n]))")
_CLOSERS = regex.compile(r"\s*(</function>|</tool_call>)")
_VALUE_ENDS = ("</parameter>", "</function>", TOOL_CALL_END, "<parameter=")
_FUNCTION_PHASE, _PARAMETERS, _VALUE, _TAIL = "function", "parameters", "value", "tail"


def parameter_types(tools: list[dict]) -> dict[str, dict[str, str]]:
    """{function name: {parameter: JSON-schema type}} of chat-format `tools`."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools:
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name", "")] = {
            key: _schema_type(schema) for key, schema in properties.items()
        }
    return types


def _schema_type(schema) -> str:
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return kind if isinstance(kind, str) else "string"


def convert_value(text: str, kind: str):
    """A parameter's raw text as the JSON value its schema type asks for (else the text)."""
    value = text.strip()
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value)
            return int(number) if number.is_integer() and "." not in value else number
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if kind == "null" and value.lower() in ("null", "none"):
            return None
        if kind in ("object", "array"):
            try:
                return json.loads(value)
            except ValueError:
                return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass
    return text


class Qwen3CoderToolParser(ToolCallParser):
    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self.types = parameter_types(self.tools)

    def _begin_call(self) -> None:
        self.phase = _FUNCTION_PHASE
        self.index = self.num_calls
        self.num_parameters = 0

    def _call_step(self, events: list[Event], final: bool) -> bool:
        if self.phase == _FUNCTION_PHASE:
            return self._function(events, final)
        if self.phase == _PARAMETERS:
            return self._parameters(events, final)
        if self.phase == _VALUE:
            return self._value(events, final)
        return self._tail(final)

    def _function(self, events: list[Event], final: bool) -> bool:
        match = _FUNCTION.match(self.buffer, partial=True)
        if match is None or (final and match.partial):
            self._reject_call(events)
            return True
        if match.partial:
            return False
        self.name = match.group(1).strip()
        events.append(ToolCallStart(self.index, tool_call_id(), self.name))
        self.buffer = self.buffer[match.end() :]
        self.phase = _PARAMETERS
        return True

    def _parameters(self, events: list[Event], final: bool) -> bool:
        """Between parameters: the next `<parameter=KEY>`, or the end of the function."""
        for pattern in (_PARAMETER, _CLOSERS):
            match = pattern.match(self.buffer, partial=True)
            if match is not None and match.partial and not final:
                return False
            if match is None or match.partial:
                continue
            self.buffer = self.buffer[match.end() :]
            if pattern is _PARAMETER:
                self._open_value(match.group(1).strip(), events)
            else:
                self._close_arguments(events, match.group(1) == TOOL_CALL_END)
            return True
        if final or not self.buffer.strip():
            self.buffer = "" if final else self.buffer
            self._close_arguments(events, final)
            return final
        skip = self.buffer.find("<", 1)  # stray text between parameters: skipped
        self.buffer = self.buffer[skip:] if skip > 0 else ""
        return bool(self.buffer)

    def _open_value(self, key: str, events: list[Event]) -> None:
        self.kind = self.types.get(self.name, {}).get(key, "string")
        separator = "{" if self.num_parameters == 0 else ", "
        self.key_prefix = separator + json.dumps(key, ensure_ascii=False) + ": "
        self.value = ""
        self.num_parameters += 1
        if self.kind == "string":
            events.append(ToolCallArguments(self.index, self.key_prefix + '"'))
        self.phase = _VALUE

    def _value(self, events: list[Event], final: bool) -> bool:
        index, marker = find_marker(self.buffer, _VALUE_ENDS)
        if marker is None and final:
            index = len(self.buffer)
        text, self.buffer = self.buffer[:index], self.buffer[index:]
        done = marker is not None or final
        if not done and text.endswith("\n"):
            text, self.buffer = text[:-1], "\n" + self.buffer  # maybe the newline before the end
        if done and text.endswith("\n"):
            text = text[:-1]
        self._value_text(text, events)
        if not done:
            return False
        if marker == "</parameter>":
            self.buffer = self.buffer[len(marker) :]
        if self.kind != "string":
            value = json.dumps(convert_value(self.value, self.kind), ensure_ascii=False)
            events.append(ToolCallArguments(self.index, self.key_prefix + value))
        else:
            events.append(ToolCallArguments(self.index, '"'))
        self.phase = _PARAMETERS
        return True

    def _value_text(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self.kind == "string":
            events.append(ToolCallArguments(self.index, json.dumps(text, ensure_ascii=False)[1:-1]))
        else:
            self.value += text

    def _close_arguments(self, events: list[Event], call_ended: bool) -> None:
        events.append(ToolCallArguments(self.index, "}" if self.num_parameters else "{}"))
        if call_ended:
            self._end_call()
        else:
            self.phase = _TAIL

    def _tail(self, final: bool) -> bool:
        """After `</function>`: skip to `</tool_call>`."""
        index, marker = find_marker(self.buffer, (TOOL_CALL_END,))
        if marker is None and not final:
            self.buffer = self.buffer[index:]
            return False
        self.buffer = self.buffer[index + len(marker or "") :]
        self._end_call()
        return True
