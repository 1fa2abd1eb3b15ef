"""Splits a model's output into reasoning (inside `<think>…</think>`) and content.

The markers themselves are never emitted. Reasoning is stripped of the whitespace next to its
markers and content of the whitespace after `</think>`, the way Qwen3 lays them out
(`<think>\\nreasoning\\n</think>\\n\\ncontent`). Only a `<think>` at the very start of the output
(after whitespace) opens reasoning; an output can also start inside reasoning, when the chat
template put `<think>` at the end of the prompt (Qwen3 thinking models, Qwen3.5).
"""

from __future__ import annotations

from axon.tokenizer.parsers.base import ContentDelta, Event, ReasoningDelta, find_marker

THINK_START = "<think>"
THINK_END = "</think>"

_START, _REASONING, _AFTER, _CONTENT = "start", "reasoning", "after", "content"


def prompt_opens_reasoning(prompt: str | None, start: str = THINK_START) -> bool:
    """Whether the rendered prompt ends inside an open reasoning block (`…<think>\\n`)."""
    return bool(prompt) and prompt.rstrip().endswith(start)


class ReasoningParser:
    """Text deltas in; ReasoningDelta and ContentDelta events out."""

    def __init__(self, in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END):
        self.start, self.end = start, end
        self.mode = _REASONING if in_reasoning else _START
        self.buffer = ""
        self._reasoning_begun = False  # a non-space reasoning character has been emitted
        self._pending_space = ""  # trailing whitespace of the reasoning so far

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self.buffer and self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        while self.buffer and self._step(events, final=True):
            pass
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        """Handle the buffer in the current mode; True when the mode changed (run again)."""
        if self.mode == _START:
            return self._step_start(final)
        if self.mode == _REASONING:
            return self._step_reasoning(events, final)
        if self.mode == _AFTER:
            self.buffer = self.buffer.lstrip()
            if self.buffer:
                self.mode = _CONTENT
            return bool(self.buffer)
        events.append(ContentDelta(self.buffer))
        self.buffer = ""
        return False

    def _step_start(self, final: bool) -> bool:
        stripped = self.buffer.lstrip()
        if stripped.startswith(self.start):
            self.buffer = stripped[len(self.start) :]
            self.mode = _REASONING
            return True
        if not final and self.start.startswith(stripped):
            return False  # still could be `<think>`
        self.mode = _CONTENT
        return True

    def _step_reasoning(self, events: list[Event], final: bool) -> bool:
        index, marker = find_marker(self.buffer, (self.end,))
        if final and marker is None:
            index = len(self.buffer)
        self._reasoning(self.buffer[:index], events)
        self.buffer = self.buffer[index:]
        if marker is None:
            return False
        self.buffer = self.buffer[len(marker) :]
        self._pending_space = ""
        self.mode = _AFTER
        return True

    def _reasoning(self, text: str, events: list[Event]) -> None:
        if not self._reasoning_begun:
            text = text.lstrip()
            self._reasoning_begun = bool(text)
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = text[len(body) :]
        if body:
            events.append(ReasoningDelta(body))
