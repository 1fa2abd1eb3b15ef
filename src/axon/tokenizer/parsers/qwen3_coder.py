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

The mistakes models make are repaired: a missing `</parameter>`, `</function>` or
`</tool_call>` (the next tag, or the end of the output, closes what is open); quotes in a
value (a string parameter is escaped as JSON); values typed by the schema (`type` a name or a
list, or `anyOf` / `oneOf`): integers, numbers, booleans, null, objects and arrays from JSON
(repaired as in repair.py) or Python literals. A value that is not of its type stays a string.
Cut off by max_tokens, a call whose name is out keeps its arguments as far as they got
(unclosed; a typed value not yet complete is left out), and one whose name is not is dropped.
"""

from __future__ import annotations

import ast
import json

import regex

from axon.tokenizer.parsers.base import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    Event,
    ToolCallArguments,
    ToolCallParser,
    ToolCallStart,
    find_marker,
    tool_call_id,
)
from axon.tokenizer.parsers.repair import repair_json

_FUNCTION = regex.compile(r"\s*<function=([^>\n]{1,256})>")
# The lookahead makes a match at the very end of the text partial: a newline may follow.
_PARAMETER = regex.compile(r"\s*<parameter=([^>\n]{1,256})>(?:\n|(?=[^\n]))")
# A next `<tool_call>` (looked at, not consumed) ends a call whose end tags are missing.
_CLOSERS = regex.compile(r"\s*(</function>|</tool_call>|(?=<tool_call>))")
_VALUE_ENDS = ("</parameter>", "</function>", TOOL_CALL_END, "<parameter=", TOOL_CALL_START)
_FUNCTION_PHASE, _PARAMETERS, _VALUE, _TAIL = "function", "parameters", "value", "tail"


def parameter_types(tools: list[dict]) -> dict[str, dict[str, tuple[str, ...]]]:
    """{function name: {parameter: its JSON-schema types}} of chat-format `tools`."""
    types: dict[str, dict[str, tuple[str, ...]]] = {}
    for tool in tools:
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name", "")] = {
            key: _schema_types(schema) for key, schema in properties.items()
        }
    return types


def _schema_types(schema) -> tuple[str, ...]:
    """The types a schema allows, in its order; ("string",) when it names none."""
    if not isinstance(schema, dict):
        return ("string",)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            kinds += list(_schema_types(option))
    found = tuple(dict.fromkeys(k for k in kinds if isinstance(k, str)))
    return found or ("string",)


def convert_value(text: str, kinds: tuple[str, ...] | str):
    """A parameter's raw text as the JSON value of the first of `kinds` it reads as (else the
    text: a string is never converted)."""
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    if "string" in kinds and "null" not in kinds:
        return text
    value = text.strip()
    for kind in kinds:
        try:
            return _CONVERTERS[kind](value)
        except (KeyError, ValueError, SyntaxError, TypeError, RecursionError):
            continue
    return text


def _integer(value: str) -> int:
    number = float(value)
    if not number.is_integer():
        raise ValueError(value)
    return int(value) if value.lstrip("+-").isdigit() else int(number)


def _number(value: str) -> int | float:
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(value)  # NaN and infinity are not JSON
    return int(value) if value.lstrip("+-").isdigit() else number


def _boolean(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise ValueError(value)
    return value.lower() == "true"


def _null(value: str) -> None:
    if value.lower() not in ("null", "none"):
        raise ValueError(value)


def _structured(kind: type):
    def convert(value: str):
        try:
            parsed = repair_json(value)
        except ValueError:
            parsed = ast.literal_eval(value)
        if not isinstance(parsed, kind):
            raise ValueError(value)
        return parsed

    return convert


_CONVERTERS = {
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "null": _null,
    "object": _structured(dict),
    "array": _structured(list),
}


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
                self._close_arguments(events, match.group(1) != "</function>")
            return True
        if final or not self.buffer.strip():
            self.buffer = "" if final else self.buffer
            self._close_arguments(events, final, closed=not self.cut_off)
            return final
        skip = self.buffer.find("<", 1)  # stray text between parameters: skipped
        self.buffer = self.buffer[skip:] if skip > 0 else ""
        return bool(self.buffer)

    def _open_value(self, key: str, events: list[Event]) -> None:
        self.kinds = self.types.get(self.name, {}).get(key, ("string",))
        # A value kept as text (its types allow a string, not null) streams as it arrives;
        # any other waits to be converted whole.
        self.streams = "string" in self.kinds and "null" not in self.kinds
        separator = "{" if self.num_parameters == 0 else ", "
        self.key_prefix = separator + json.dumps(key, ensure_ascii=False) + ": "
        self.value = ""
        self.num_parameters += 1
        if self.streams:
            events.append(ToolCallArguments(self.index, self.key_prefix + '"'))
        self.phase = _VALUE

    def _value(self, events: list[Event], final: bool) -> bool:
        index, marker = find_marker(self.buffer, _VALUE_ENDS)
        if marker is None and final and not self.cut_off:
            index = len(self.buffer)  # all of it; cut off, a begun end tag is dropped
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
        self.phase = _PARAMETERS
        if marker is None and self.cut_off:
            return True  # the value as far as it got: neither closed nor converted
        if not self.streams:
            value = json.dumps(convert_value(self.value, self.kinds), ensure_ascii=False)
            events.append(ToolCallArguments(self.index, self.key_prefix + value))
        else:
            events.append(ToolCallArguments(self.index, '"'))
        return True

    def _value_text(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self.streams:
            events.append(ToolCallArguments(self.index, json.dumps(text, ensure_ascii=False)[1:-1]))
        else:
            self.value += text

    def _close_arguments(self, events: list[Event], call_ended: bool, closed: bool = True) -> None:
        """End the arguments object (left open when `closed` is False: cut off)."""
        if closed:
            events.append(ToolCallArguments(self.index, "}" if self.num_parameters else "{}"))
        if call_ended:
            self._end_call()
        else:
            self.phase = _TAIL
