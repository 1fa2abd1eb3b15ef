"""Hermes-style tool calls (Qwen3, Qwen2.5): JSON inside `<tool_call>…</tool_call>`.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call whose JSON opens with `{"name": "…", "arguments":` streams: its start (index, id, name)
as soon as the name is complete, then the arguments' JSON text as it arrives, verbatim. Any
other layout is held until `</tool_call>` and parsed whole; if that fails (or the output ends
first) the markup is returned as content.

The JSON is repaired where only one reading exists (repair.py): trailing commas dropped, the
brackets left open when `</tool_call>` or the end of the output comes are closed. Cut off by
max_tokens, a call whose name is out keeps its arguments as far as they got (unclosed, so no
client mistakes them for whole ones), and one whose name is not out is dropped.
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
from axon.tokenizer.parsers.repair import JsonScanner, repair_json

_HEADER = regex.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.){1,256})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)
_HEADER_PHASE, _ARGUMENTS, _TAIL, _WHOLE = "header", "arguments", "tail", "whole"


class HermesToolParser(ToolCallParser):
    def _begin_call(self) -> None:
        self.phase = _HEADER_PHASE
        self.scanner = JsonScanner()
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
        """Stream the arguments' text, repaired, up to its end; when `</tool_call>` or the end
        of the output cuts it short, its open brackets are closed (unless cut off)."""
        limit, marker = find_marker(self.buffer, (TOOL_CALL_END,))
        if final and marker is None and not self.cut_off:
            limit = len(self.buffer)  # all of it; cut off, a begun `</tool_call>` is dropped
        text, end = self.scanner.feed(self.buffer[:limit])
        self.buffer = self.buffer[limit if end is None else end :]
        if end is None and not self.cut_off and (marker is not None or final):
            text += self.scanner.closing()
        if text:
            events.append(ToolCallArguments(self.index, text))
        done = end is not None or marker is not None or final
        if done:
            self.phase = _TAIL
        return done

    def _whole(self, events: list[Event], final: bool) -> bool:
        index = self.buffer.find(TOOL_CALL_END)
        if index < 0 and not final:
            return False
        body = self.buffer if index < 0 else self.buffer[:index]
        call = _parse_call(body, repair=not (self.cut_off and index < 0))
        if call is None:
            self._reject_call(events)
            return True
        name, arguments = call
        events.append(ToolCallStart(self.index, tool_call_id(), name))
        events.append(ToolCallArguments(self.index, arguments))
        self.buffer = "" if index < 0 else self.buffer[index + len(TOOL_CALL_END) :]
        self._end_call()
        return True


def _parse_call(body: str, repair: bool) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call body, or None if it is not one."""
    try:
        call = repair_json(body) if repair else json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        return call["name"], arguments
    return call["name"], json.dumps(arguments, ensure_ascii=False)
