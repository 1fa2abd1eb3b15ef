"""The reasoning parser: `<think>…</think>` split from content, however the text arrives."""

from __future__ import annotations

import pytest

from axon.tokenizer.parsers import (
    OutputParser,
    ParserFamily,
    ReasoningParser,
    make_output_parser,
    prompt_opens_reasoning,
)

from .helpers import assert_no_markup, parse_every_way


def reasoning_parser(in_reasoning: bool = False):
    return lambda: OutputParser(ReasoningParser(in_reasoning=in_reasoning))


CASES = [
    # (output, starts inside reasoning, expected reasoning, expected content)
    (
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        False,
        "Let me think.",
        "The answer is 4.",
    ),
    ("<think>\n\n</think>\n\nHello", False, "", "Hello"),
    ("Just content, no thinking.", False, "", "Just content, no thinking."),
    ("  spaced content", False, "", "  spaced content"),
    ("Mentions <think> later", False, "", "Mentions <think> later"),
    ("<thinking is not a marker", False, "", "<thinking is not a marker"),
    ("step 1\nstep 2\n</think>\n\nDone.", True, "step 1\nstep 2", "Done."),
    ("<think>\nunfinished reasoning <", False, "unfinished reasoning <", ""),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),
    ("<think>x < y and </thin k></think>ok", False, "x < y and </thin k>", "ok"),
    ("", False, "", ""),
    ("<thi", False, "", "<thi"),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_reasoning_split_however_fed(text, inside, reasoning, content):
    parsed = parse_every_way(reasoning_parser(inside), text)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)
    assert parsed.calls == []
    if "</think>" not in content and "<think>" not in content:
        assert_no_markup(parsed.content)


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert not prompt_opens_reasoning(None)


def test_enable_thinking_false_leaves_text_as_content():
    family = ParserFamily(reasoning=True, tool_format=None)
    parser = make_output_parser(family, prompt="assistant\n", enable_thinking=False)
    events = parser.feed("<think>x</think>y") + parser.finish()
    assert [e.text for e in events] == ["<think>x</think>y"]


def test_family_without_think_tokens_has_no_reasoning_parser():
    parser = make_output_parser(ParserFamily(reasoning=False, tool_format=None))
    assert parser.reasoning is None and parser.tools is None
