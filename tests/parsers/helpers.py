"""Feeding a parser a model output whole, split in two at every character boundary, and one
character at a time; what the events reconstruct."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from axon.tokenizer.parsers import (
    ContentDelta,
    OutputParser,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
)

MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "<parameter=")


@dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[list] = field(default_factory=list)  # [name, arguments text] per call

    def add(self, event) -> None:
        if isinstance(event, ReasoningDelta):
            self.reasoning += event.text
        elif isinstance(event, ContentDelta):
            self.content += event.text
        elif isinstance(event, ToolCallStart):
            assert event.index == len(self.calls), "calls start in index order"
            assert event.id.startswith("call_") and event.name
            self.calls.append([event.name, ""])
        else:
            assert isinstance(event, ToolCallArguments)
            assert event.index == len(self.calls) - 1, "fragments follow their call's start"
            self.calls[event.index][1] += event.fragment

    def tool_calls(self) -> list[tuple[str, object]]:
        """(name, parsed arguments) of each call; the arguments must be valid JSON."""
        return [(name, json.loads(arguments)) for name, arguments in self.calls]


def parse(make_parser, pieces: list[str]) -> Parsed:
    parser: OutputParser = make_parser()
    parsed = Parsed()
    for piece in pieces:
        for event in parser.feed(piece):
            parsed.add(event)
    for event in parser.finish():
        parsed.add(event)
    return parsed


def splittings(text: str):
    """The text whole, in two pieces at every boundary, and one character at a time."""
    yield [text]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    yield list(text)


def parse_every_way(make_parser, text: str) -> Parsed:
    """The parse of `text`, asserted identical however the text is split."""
    whole = parse(make_parser, [text])
    for pieces in splittings(text):
        parsed = parse(make_parser, pieces)
        assert parsed == whole, f"split {[len(p) for p in pieces][:3]} differs: {parsed}"
    return whole


def assert_no_markup(text: str) -> None:
    for marker in MARKUP:
        assert marker not in text, f"{marker!r} leaked into {text!r}"
