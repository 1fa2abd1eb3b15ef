"""Hermes-style tool calls (Qwen3, Qwen2.5): JSON inside `<tool_call>…</tool_call>`.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call whose JSON opens with `{"name": "…", "arguments":` streams: its start (index, id, name)
as soon as the name is complete, then the arguments' JSON text as it arrives, verbatim. Any
other layout is held until `</tool_call>` and parsed whole; if that fails (or the output ends
first) the markup is returned as content.
"""

from __future__ import annotations

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

_HEADER = regex.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.){1,256})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)
_HEADER_PHASE, _ARGUMENTS, _TAIL, _WHOLE = "header", "arguments", "tail", "whole"


class _ValueScanner:
    """Finds where a JSON value inside an object ends: at a `,` or `}` outside strings and
    nested brackets. Whitespace at the value's end is held back, never emitted."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """The index in `text` where the value ends, or None if it goes on past `text`."""
        for index, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                if self.depth == 0:
                    return index
                self.depth -= 1
            elif char == "," and self.depth == 0:
                return index
        return None


class HermesToolParser(ToolCallParser):
    def _begin_call(self) -> None:
        self.phase = _HEADER_PHASE
        self.scanner = _ValueScanner()
        self.index = self.num_calls

    def _call_step(self, events: list[Event], final: bool) -> bool:
        if self.phase == _HEADER_PHASE:
            return self._header(events, final)
        if self.phase == _ARGUMENTS:
            return self._arguments(events, final)
        if self.phase == _TAIL:
            return self._tail(final)
        return self._whole(events, final)

    def _header(self, events: list[Event], final: bool) -> bool:
        match = _HEADER.match(self.buffer, partial=True)
        if match is None or (final and match.partial):
            self.phase = _WHOLE
            return True
        if match.partial:
            return False
        name = json.loads(f'"{match.group(1)}"')
        events.append(ToolCallStart(self.index, tool_call_id(), name))
        self.buffer = self.buffer[match.end() :]
        self.phase = _ARGUMENTS
        return True

    def _arguments(self, events: list[Event], final: bool) -> bool:
        """Stream the arguments' text up to its end (or a `</tool_call>` cutting it short);
        trailing whitespace is held back, since it may follow the value."""
        limit, marker = find_marker(self.buffer, (TOOL_CALL_END,))
        end = self.scanner.scan(self.buffer[:limit])
        done = end is not None or marker is not None or final
        if end is None:
            end = len(self.buffer) if final else limit
        text = self.buffer[:end].rstrip()
        if text:
            events.append(ToolCallArguments(self.index, text))
        # Held whitespace is scanned again next time, which leaves the scanner as it is.
        self.buffer = self.buffer[end:] if done else self.buffer[len(text) :]
        if done:
            self.phase = _TAIL
        return done

    def _tail(self, final: bool) -> bool:
        """After the arguments: skip to `</tool_call>`."""
        index, marker = find_marker(self.buffer, (TOOL_CALL_END,))
        if marker is None and not final:
            self.buffer = self.buffer[index:]
            return False
        self.buffer = self.buffer[index + len(marker or "") :]
        self._end_call()
        return True

    def _whole(self, events: list[Event], final: bool) -> bool:
        index = self.buffer.find(TOOL_CALL_END)
        if index < 0 and not final:
            return False
        body = self.buffer if index < 0 else self.buffer[:index]
        call = _parse_call(body)
        if call is None:
            self._reject_call(events)
            return True
        name, arguments = call
        events.append(ToolCallStart(self.index, tool_call_id(), name))
        events.append(ToolCallArguments(self.index, arguments))
        self.buffer = "" if index < 0 else self.buffer[index + len(TOOL_CALL_END) :]
        self._end_call()
        return True


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call body, or None if it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        return call["name"], arguments
    return call["name"], json.dumps(arguments, ensure_ascii=False)
