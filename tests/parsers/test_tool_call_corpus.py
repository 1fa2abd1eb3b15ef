"""The route-side assembly (ChoiceOutput) of every case in tool_call_cases.py: whole
(`message`) and streamed (`deltas`) in random-sized pieces and one character at a time, each
must give exactly the expected calls, content and finish_reason, and no markup reaches content
unless the case returns the whole output as text."""

from __future__ import annotations

import json
import random

import pytest

from axon.server.chat_output import ChatOutputPlan, ChoiceOutput
from axon.tokenizer.parsers import ParserFamily

from .helpers import assert_no_markup
from .tool_call_cases import END, HERMES, TOOLS, XML, h, x


def plan(tool_format: str) -> ChatOutputPlan:
    family = ParserFamily(reasoning=True, tool_format=tool_format)
    return ChatOutputPlan(family, "assistant\n", TOOLS, True, True, False, True)


def whole(tool_format: str, text: str, reason: str):
    output = ChoiceOutput(plan(tool_format))
    message = output.message(text, reason)
    calls = [
        [c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls", [])
    ]
    assert all(c["id"].startswith("call_") for c in message.get("tool_calls", []))
    return calls, message["content"] or "", output.finish_reason(reason)


def streamed(tool_format: str, pieces: list[str], reason: str):
    output = ChoiceOutput(plan(tool_format))
    calls: list[list[str]] = []
    content = ""
    for number, piece in enumerate(pieces):
        final = number == len(pieces) - 1
        for delta in output.deltas(piece, final, reason if final else None):
            assert "reasoning_content" not in delta
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(calls)
                    calls.append([call["function"]["name"], ""])
                calls[call["index"]][1] += call["function"]["arguments"]
    return calls, content, output.finish_reason(reason)


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, start = [], 0
    while start < len(text):
        size = rng.randint(1, 9)
        pieces.append(text[start : start + size])
        start += size
    return pieces or [""]


def check(tool_format, text, reason, calls, content, finish_reason):
    answers = [whole(tool_format, text, reason), streamed(tool_format, list(text) or [""], reason)]
    answers += [streamed(tool_format, random_pieces(text, seed), reason) for seed in range(8)]
    for got_calls, got_content, got_reason in answers:
        assert got_content == content
        assert got_reason == finish_reason
        assert [name for name, _ in got_calls] == [name for name, _ in calls]
        for (_, got), (_, expected) in zip(got_calls, calls, strict=True):
            assert got == expected if isinstance(expected, str) else json.loads(got) == expected
    if text not in content:  # content that is not the whole output returned as text
        assert_no_markup(content)


@pytest.mark.parametrize(
    ("text", "reason", "calls", "content", "finish_reason"),
    [case[1:] for case in HERMES],
    ids=[case[0] for case in HERMES],
)
def test_hermes_corpus(text, reason, calls, content, finish_reason):
    check("hermes", text, reason, calls, content, finish_reason)


@pytest.mark.parametrize(
    ("text", "reason", "calls", "content", "finish_reason"),
    [case[1:] for case in XML],
    ids=[case[0] for case in XML],
)
def test_qwen3_coder_corpus(text, reason, calls, content, finish_reason):
    check("qwen3_coder", text, reason, calls, content, finish_reason)


FULL = {
    "hermes": "Let me check.\n\n"
    + h('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    + "\n"
    + h('{"name": "now", "arguments": {"hours": [1, 2]}}'),
    "qwen3_coder": "Let me check.\n\n"
    + x("get_weather", [("city", "Paris")], END)
    + "\n"
    + x("get_weather", [("days", "3"), ("hours", "[1]")], END),
}


@pytest.mark.parametrize("tool_format", sorted(FULL))
def test_a_cut_anywhere_leaks_no_markup(tool_format):
    """max_tokens may end the output at any character: content is then a prefix of the text
    before the calls, never a piece of markup, and streaming agrees with the whole answer."""
    text = FULL[tool_format]
    for cut in range(len(text) + 1):
        answer = whole(tool_format, text[:cut], "length")
        calls, content, finish_reason = answer
        assert "Let me check.\n\n".startswith(content), (cut, content)
        assert finish_reason == "length"
        assert len(calls) <= 2
        for seed in range(3):
            pieces = random_pieces(text[:cut], seed)
            assert streamed(tool_format, pieces, "length") == answer, cut
