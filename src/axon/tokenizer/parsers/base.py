"""What the output parsers emit, the marker-scanning helpers they share, and the base of the
tool-call parsers (finding `<tool_call>` in content and the whitespace around calls).

Every parser is a deterministic function of the text seen so far: it emits only what no later
text can change and holds back the rest (a possible marker prefix, trailing whitespace). So the
events of a text fed whole, in two pieces or one character at a time concatenate to the same
reasoning, content and tool calls.

At the end of the output (`finish`) a call still open is either closed, with its JSON repaired
where that is unambiguous (the model stopped there), or, when the output was cut off by
`max_tokens`, left as far as it got: a call whose name is out keeps its arguments unclosed,
and any markup before that is dropped, never returned as content.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    fragment: str  # the arguments' JSON text, piece by piece


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArguments


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def partial_marker_len(buffer: str, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of `buffer` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(buffer)), longest, -1):
            if buffer.endswith(marker[:size]):
                longest = size
                break
    return longest


def find_marker(buffer: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """(index, marker) of the earliest complete marker in `buffer`; else (index, None) where
    text from `index` on could still start a marker and must be held back."""
    found: tuple[int, str | None] = (len(buffer), None)
    for marker in markers:
        index = buffer.find(marker)
        if index >= 0 and (found[1] is None or index < found[0]):
            found = (index, marker)
    if found[1] is not None:
        return found
    return len(buffer) - partial_marker_len(buffer, markers), None


class ToolCallParser:
    """Content text in, content and tool-call events out. Subclasses parse one call's body
    (the text after `<tool_call>`) in `_call_step`; this class finds the calls, drops the
    whitespace around them and returns a malformed call's text as content."""

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self.buffer = ""
        self.in_call = False
        self.num_calls = 0
        self._pending_space = ""  # trailing whitespace of content: dropped if a call follows
        self._strip_leading = False  # just after a call: its trailing whitespace is dropped
        self._space_before_call = ""  # given back if the call turns out malformed
        self.cut_off = False  # set by finish: the output ended at max_tokens

    def feed(self, text: str) -> list[Event]:
        """Events for `text`, the next piece of content."""
        self.buffer += text
        return self._run(final=False)

    def finish(self, cut_off: bool = False) -> list[Event]:
        """Events for whatever is held back, at the end of the output; `cut_off` when it
        ended at max_tokens (unfinished markup is dropped, an open call is left unclosed)."""
        self.cut_off = cut_off
        events = self._run(final=True)
        if self._pending_space and not self.num_calls:
            events.append(ContentDelta(self._pending_space))
        self._pending_space = ""
        return events

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self.in_call:
                if not self._call_step(events, final):
                    return events
                continue
            index, marker = find_marker(self.buffer, (TOOL_CALL_START,))
            if marker is None and final and not self.cut_off:
                index = len(self.buffer)
            self._content(self.buffer[:index], events)
            self.buffer = "" if final and marker is None else self.buffer[index:]
            if marker is None:
                return events
            self.buffer = self.buffer[len(marker) :]
            self._space_before_call, self._pending_space = self._pending_space, ""
            self.in_call = True
            self._begin_call()

    def _content(self, text: str, events: list[Event]) -> None:
        if self._strip_leading:
            text = text.lstrip()
            self._strip_leading = not text
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = text[len(body) :]
        if body:
            events.append(ContentDelta(body))

    def _end_call(self) -> None:
        self.in_call = False
        self.num_calls += 1
        self._strip_leading = True

    def _tail(self, final: bool) -> bool:
        """After the call's body: skip to `</tool_call>`; True when the call ended."""
        index, marker = find_marker(self.buffer, (TOOL_CALL_END, TOOL_CALL_START))
        if marker is None and not final:
            self.buffer = self.buffer[index:]
            return False
        # A next `<tool_call>` ends this call too (its end tag missing); at the end of the
        # output a `</tool_call>` begun is markup, dropped.
        skip = len(marker) if marker == TOOL_CALL_END else 0
        self.buffer = "" if marker is None else self.buffer[index + skip :]
        self._end_call()
        return True

    def _reject_call(self, events: list[Event]) -> None:
        """The call is malformed: its marker is content after all; its body is parsed again.
        Cut off by max_tokens, the unfinished markup and all after it are dropped instead."""
        self.in_call = False
        if self.cut_off:
            self.buffer = ""
            return
        self._pending_space = self._space_before_call
        self._content(TOOL_CALL_START, events)

    def _begin_call(self) -> None:
        raise NotImplementedError

    def _call_step(self, events: list[Event], final: bool) -> bool:
        """Consume what it can of the call body in `self.buffer`; True when it made progress
        (the loop calls again), False when it needs more text."""
        raise NotImplementedError
