"""Reasoning, tool calls and structured output for the chat-shaped routes.

`ChatOutputPlan.of(model, body, prompt, headers)` decides, once per request, what the output is
parsed for (the model family's reasoning markers and tool-call form, the request's tools and
tool_choice, `enable_thinking`, the `x-include-thinking` header) and which grammar, if any,
the engine must enforce (`response_format`, `tool_choice` required or named, `strict` tools'
arguments under "auto"). `ChoiceOutput` turns one sample's text into OpenAI message fields or
stream deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from axon.server.errors import BadRequest
from axon.tokenizer.parsers import (
    ContentDelta,
    OutputParser,
    ParserFamily,
    ReasoningDelta,
    ToolCallStart,
    make_output_parser,
    parser_family,
    prompt_opens_reasoning,
)

_TRUE = ("1", "true", "yes")


def include_thinking(headers) -> bool:
    """neuron's `x-include-thinking: 1|true|yes`: reasoning goes into content, with markers."""
    return (headers.get("x-include-thinking") or "").strip().lower() in _TRUE


def call_arguments(arguments: str) -> dict:
    """A call's arguments as an object (Anthropic's `input`, Ollama's `arguments`); {} when the
    model's text is not a JSON object (a call cut off by max_tokens), which the stop reason then
    explains."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _function(tool: dict) -> dict:
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    return function if isinstance(function, dict) else {}


@dataclass
class ChatOutputPlan:
    family: ParserFamily
    prompt: str | None
    tools: list[dict] | None
    parse_tools: bool
    enable_thinking: bool
    include_thinking: bool
    parallel_tool_calls: bool
    structured_output: dict | None = None

    @classmethod
    def of(cls, model, body, prompt: str | None, headers) -> ChatOutputPlan:
        """The plan of a chat request; raises BadRequest for a tool_choice or response_format
        this model cannot honour (images: openai_chat.request_image_parts)."""
        info = getattr(getattr(model, "client", None), "info", None) or {}
        family = parser_family(model.tokenizer, info.get("model_type"))
        kwargs = getattr(body, "chat_template_kwargs", None) or {}
        plan = cls(
            family=family,
            prompt=prompt,
            tools=getattr(body, "tools", None),
            parse_tools=getattr(body, "tool_choice", None) != "none",
            enable_thinking=kwargs.get("enable_thinking", True) is not False,
            include_thinking=include_thinking(headers),
            parallel_tool_calls=getattr(body, "parallel_tool_calls", True) is not False,
        )
        plan.structured_output = plan._structured(body)
        return plan

    def parser(self) -> OutputParser:
        return make_output_parser(
            self.family, self.prompt, self.tools, self.enable_thinking, self.parse_tools
        )

    def _thinking(self) -> str | None:
        if not (self.family.reasoning and self.enable_thinking):
            return None
        return "started" if prompt_opens_reasoning(self.prompt) else "optional"

    def _structured(self, body) -> dict | None:
        tool_choice = getattr(body, "tool_choice", None)
        spec, param = self._forced_tool_call(tool_choice)
        if spec is None:
            spec, param = (
                _response_format(getattr(body, "response_format", None)),
                "response_format",
            )
        if spec is None:
            spec, param = self._strict_tool_calls(tool_choice), "tools"
        if spec is None:
            return None
        spec["thinking"] = self._thinking()
        from axon.structured import check_grammar  # lazy: torch and llguidance, on demand

        try:
            check_grammar(spec)
        except ValueError as exc:
            raise BadRequest(f"{param}: {exc}", param=param) from None
        return spec

    def _forced_tool_call(self, tool_choice) -> tuple[dict | None, str]:
        """The tool_call grammar spec of tool_choice "required" or a named function."""
        if tool_choice in (None, "auto", "none"):
            return None, "tool_choice"
        # Shapes were checked at parsing (request_checks.check_tools); nameless ones are skipped
        # here so that a request built in code cannot reach a KeyError.
        tools = [t for t in map(_function, self.tools or []) if isinstance(t.get("name"), str)]
        if not tools:
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        if self.family.tool_format is None:
            raise BadRequest("this model has no known tool-call format", param="tool_choice")
        parallel = self.parallel_tool_calls
        if isinstance(tool_choice, dict):
            name = _function(tool_choice).get("name")
            tools = [t for t in tools if t.get("name") == name]
            if not tools:
                raise BadRequest(f"tool_choice names no given tool: {name!r}", param="tool_choice")
            parallel = False
        elif tool_choice != "required":
            raise BadRequest(f"tool_choice {tool_choice!r} is not supported", param="tool_choice")
        compact = [{"name": t["name"], "parameters": t.get("parameters")} for t in tools]
        spec = {"type": "tool_call", "format": self.family.tool_format, "tools": compact}
        return {**spec, "parallel": parallel}, "tool_choice"

    def _strict_tool_calls(self, tool_choice) -> dict | None:
        """tool_choice "auto" with `strict: true` tools: the grammar that leaves the answer free
        and, once the model starts a call, holds a strict tool's arguments to its schema (the
        other tools' calls stay free). A response_format's grammar, which comes first, allows
        no call at all, so nothing is left to hold then."""
        if tool_choice not in (None, "auto") or self.family.tool_format is None:
            return None
        tools = [t for t in map(_function, self.tools or []) if isinstance(t.get("name"), str)]
        strict = [t for t in tools if t.get("strict") is True]
        if not strict:
            return None
        return {
            "type": "tool_call",
            "format": self.family.tool_format,
            "tools": [{"name": t["name"], "parameters": t.get("parameters")} for t in strict],
            "free_tools": [t["name"] for t in tools if t.get("strict") is not True],
            "parallel": self.parallel_tool_calls,
            "optional": True,
        }


def _response_format(response_format) -> dict | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest(
                "response_format.json_schema.schema must be an object",
                param="response_format.json_schema.schema",
            )
        return {"type": "json_schema", "schema": schema}
    raise BadRequest(
        f"response_format.type {kind!r} is not one of text, json_object, json_schema",
        param="response_format.type",
    )


class ChoiceOutput:
    """One sample's parsed output: stream deltas as text arrives, or the whole message."""

    def __init__(self, plan: ChatOutputPlan):
        self.plan = plan
        self.parser = plan.parser()
        self.in_wrapped_reasoning = False  # x-include-thinking: `<think>` sent, `</think>` not
        self.num_calls = 0

    def deltas(self, text: str, final: bool = False, reason: str | None = None) -> list[dict]:
        """The chat deltas for the next piece of `text` (and, when `final`, the rest; `reason`
        is then the sample's finish reason: at "length" unfinished tool-call markup is dropped,
        never content)."""
        events = self.parser.feed(text)
        if final:
            events += self.parser.finish(cut_off=reason == "length")
        deltas = [d for event in events for d in self._delta(event)]
        if final and self.in_wrapped_reasoning:
            deltas.append({"content": "\n</think>\n\n"})
            self.in_wrapped_reasoning = False
        return _merge(deltas)

    def _delta(self, event) -> list[dict]:
        deltas = []
        if self.in_wrapped_reasoning and not isinstance(event, ReasoningDelta):
            deltas.append({"content": "\n</think>\n\n"})
            self.in_wrapped_reasoning = False
        if isinstance(event, ReasoningDelta):
            if not self.plan.include_thinking:
                return [{"reasoning_content": event.text}]
            opening = "" if self.in_wrapped_reasoning else "<think>\n"
            self.in_wrapped_reasoning = True
            return [{"content": opening + event.text}]
        if isinstance(event, ContentDelta):
            return [*deltas, {"content": event.text}]
        if event.index > 0 and not self.plan.parallel_tool_calls:
            return deltas
        call: dict = {"index": event.index}
        if isinstance(event, ToolCallStart):
            self.num_calls += 1
            call.update(id=event.id, type="function", function={"name": event.name})
            call["function"]["arguments"] = ""
        else:
            call["function"] = {"arguments": event.fragment}
        return [*deltas, {"tool_calls": [call]}]

    def message(self, text: str, reason: str | None = None) -> dict:
        """The whole assistant message of a finished sample whose text is `text` and finish
        reason `reason`."""
        content, reasoning, calls = "", "", []
        for delta in self.deltas(text, final=True, reason=reason):
            content += delta.get("content", "")
            reasoning += delta.get("reasoning_content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    calls.append(call)
                else:
                    calls[-1]["function"]["arguments"] += call["function"]["arguments"]
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if self.plan.family.reasoning and not self.plan.include_thinking:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        reason = "stop" if reason == "abort" else reason
        return "tool_calls" if self.num_calls and reason == "stop" else reason


def _merge(deltas: list[dict]) -> list[dict]:
    """Adjacent content (or reasoning) deltas joined: fewer, larger chunks."""
    merged: list[dict] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if last is not None and last.keys() == delta.keys() and len(delta) == 1:
            key = next(iter(delta))
            if key in ("content", "reasoning_content"):
                merged[-1] = {key: last[key] + delta[key]}
                continue
        merged.append(delta)
    return merged
