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


# ---- marker tokens flagged special: the real detokenizer in front of the parser --------------

OUTPUT = '<think>\nHmm, 2 + 2.\n</think>\n\nIt is 4.<tool_call>\n{"name": "add", "arguments": {}}'
OUTPUT += "\n</tool_call><|im_end|>"
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def _chat_message(tokenizer, text: str, streamed: bool) -> dict:
    """The chat message that `text`, generated token by token, becomes: through SampleState
    (the detokenizer, skip_special_tokens on) and ChoiceOutput, streamed as the route streams
    (SampleCursor deltas) or whole."""
    from axon.engine.output_processor import SampleState
    from axon.outputs import TokenUpdate
    from axon.sampling_params import SamplingParams
    from axon.server.chat_output import ChatOutputPlan, ChoiceOutput
    from axon.server.schemas.protocol import SampleCursor
    from axon.tokenizer.parsers import parser_family

    prompt = "<|im_start|>user\nadd<|im_end|>\n<|im_start|>assistant\n"
    plan = ChatOutputPlan(
        family=parser_family(tokenizer, "qwen3"),
        prompt=prompt,
        tools=[ADD_TOOL],
        parse_tools=True,
        enable_thinking=True,
        include_thinking=False,
        parallel_tool_calls=True,
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    sample = SampleState(0, SamplingParams(max_tokens=100), prompt_ids, tokenizer)
    output, cursor, deltas = ChoiceOutput(plan), SampleCursor(), []
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    for number, token_id in enumerate(token_ids, 1):
        finish = "stop" if number == len(token_ids) else None
        sample.add(TokenUpdate("r", 0, token_id, finish_reason=finish))
        step = cursor.advance(sample) if streamed else None
        if step is not None:
            deltas += output.deltas(step[0], final=cursor.done)
    if not streamed:
        return ChoiceOutput(plan).message(sample.text)
    message = {"content": "", "reasoning_content": "", "tool_calls": []}
    for delta in deltas:
        message["content"] += delta.get("content", "")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                message["tool_calls"].append(call)
            else:  # an arguments fragment of the call before
                message["tool_calls"][-1]["function"]["arguments"] += call["function"]["arguments"]
    return message


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("markers_special", [False, True], ids=["plain", "special"])
def test_special_marker_tokens_reach_the_parsers(markers_special, streamed):
    from .conftest import byte_tokenizer

    tokenizer = byte_tokenizer(markers_special)
    think_id = tokenizer.convert_tokens_to_ids("<think>")
    assert tokenizer.added_tokens_decoder[think_id].special is markers_special
    message = _chat_message(tokenizer, OUTPUT, streamed)
    assert message["reasoning_content"] == "Hmm, 2 + 2."
    assert message["content"] == "It is 4."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "add" and call["function"]["arguments"] == "{}"
    assert_no_markup(message["content"] + message["reasoning_content"])
