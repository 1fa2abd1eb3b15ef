"""Output parsers per model family: reasoning (`<think>…</think>`) and tool calls.

`parser_family(tokenizer, model_type)` says what a model's output carries (looked up once per
tokenizer); `OutputParser` chains the reasoning parser and the family's tool-call parser over
one sample's text deltas. Tool calls are parsed in content only, never inside reasoning.

    Qwen3, Qwen2.5           reasoning if the vocabulary has <think>; Hermes JSON tool calls
    Qwen3.5, Qwen3-Coder     reasoning; XML tool calls (<function=NAME><parameter=KEY>…)
"""

from __future__ import annotations

from dataclasses import dataclass

from axon.tokenizer.parsers.base import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallParser,
    ToolCallStart,
)
from axon.tokenizer.parsers.hermes import HermesToolParser
from axon.tokenizer.parsers.qwen3_coder import Qwen3CoderToolParser
from axon.tokenizer.parsers.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningParser,
    prompt_opens_reasoning,
)

# The markers the parsers split output on. When a tokenizer flags them special, the detokenizer
# still keeps them (they are the parsers' input); the parsers never emit them.
MARKER_TOKENS = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END)

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}
# Model types whose tool-call form is known when the chat template does not show it.
_FORMAT_BY_MODEL_TYPE = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "qwen3_vl": "hermes",
    "qwen3_5": "qwen3_coder",
    "qwen3_5_moe": "qwen3_coder",
    "qwen3_next": "qwen3_coder",
}


@dataclass(frozen=True)
class ParserFamily:
    """What a model's output can carry: reasoning markers, and its tool-call form (or None)."""

    reasoning: bool
    tool_format: str | None


def _single_token(tokenizer, text: str) -> bool:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return text in vocab


_families: dict[int, tuple[object, ParserFamily]] = {}


def parser_family(tokenizer, model_type: str | None = None) -> ParserFamily:
    """The family of a model from its tokenizer (marker tokens, chat template) and config's
    model_type: reasoning when `<think>` and `</think>` are single tokens; XML tool calls when
    the template writes `<function=`, Hermes when it writes `<tool_call>` (else by model type)."""
    if tokenizer is None:
        return ParserFamily(False, None)
    cached = _families.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    reasoning = _single_token(tokenizer, THINK_START) and _single_token(tokenizer, THINK_END)
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else str(template)
    tool_format = None
    if _single_token(tokenizer, TOOL_CALL_START) and _single_token(tokenizer, TOOL_CALL_END):
        if "<function=" in template:
            tool_format = "qwen3_coder"
        elif TOOL_CALL_START in template:
            tool_format = "hermes"
        else:
            tool_format = _FORMAT_BY_MODEL_TYPE.get(model_type or "")
    family = ParserFamily(reasoning, tool_format)
    _families[id(tokenizer)] = (tokenizer, family)
    return family


class OutputParser:
    """One sample's parser: text deltas in, events out (reasoning first, then content and
    tool calls). `finish()` flushes what is held back at the end of the output."""

    def __init__(
        self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None
    ):
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        events = self.reasoning.feed(text) if self.reasoning is not None else [ContentDelta(text)]
        return self._through_tools(events, final=False)

    def finish(self, cut_off: bool = False) -> list[Event]:
        """The events held back, at the end of the output; `cut_off` when max_tokens ended it
        (a tool call's unfinished markup is then dropped: ToolCallParser.finish)."""
        events = self.reasoning.finish() if self.reasoning is not None else []
        return self._through_tools(events, final=True, cut_off=cut_off)

    def _through_tools(
        self, events: list[Event], final: bool, cut_off: bool = False
    ) -> list[Event]:
        if self.tools is None:
            return coalesce(events)
        out: list[Event] = []
        for event in events:
            out += self.tools.feed(event.text) if isinstance(event, ContentDelta) else [event]
        if final:
            out += self.tools.finish(cut_off)
        return coalesce(out)


def coalesce(events: list[Event]) -> list[Event]:
    """Adjacent text events of one kind (and argument fragments of one call) merged."""
    merged: list[Event] = []
    for event in events:
        last = merged[-1] if merged else None
        if type(event) is type(last) and isinstance(event, ReasoningDelta | ContentDelta):
            merged[-1] = type(event)(last.text + event.text)
        elif (
            isinstance(event, ToolCallArguments)
            and isinstance(last, ToolCallArguments)
            and last.index == event.index
        ):
            merged[-1] = ToolCallArguments(event.index, last.fragment + event.fragment)
        else:
            merged.append(event)
    return merged


def make_output_parser(
    family: ParserFamily,
    prompt: str | None = None,
    tools: list[dict] | None = None,
    enable_thinking: bool = True,
    parse_tools: bool = True,
) -> OutputParser:
    """The parser of one sample of a request to a model of `family`: reasoning unless
    `enable_thinking` is False (starting inside it when `prompt` opened it), tool calls when
    the request has `tools` and `parse_tools`."""
    reasoning = None
    if family.reasoning and enable_thinking:
        reasoning = ReasoningParser(in_reasoning=prompt_opens_reasoning(prompt))
    tool_parser = None
    if family.tool_format is not None and tools and parse_tools:
        tool_parser = TOOL_PARSERS[family.tool_format](tools)
    return OutputParser(reasoning, tool_parser)


__all__ = [
    "ContentDelta",
    "Event",
    "MARKER_TOKENS",
    "OutputParser",
    "ParserFamily",
    "ReasoningDelta",
    "ReasoningParser",
    "ToolCallArguments",
    "ToolCallStart",
    "TOOL_PARSERS",
    "coalesce",
    "make_output_parser",
    "parser_family",
    "prompt_opens_reasoning",
]
