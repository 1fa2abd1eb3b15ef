"""A tool call cut off by max_tokens, through `axon serve` and the openai client: the tiny
byte-level Qwen3 is forced into a Hermes call (tool_choice "required") and stopped inside its
markup. No markup reaches content, finish_reason is "length", and streaming answers as the
whole response does (issue 31: `'<tool_call>\\n{"name": "get_ti'` leaked into content)."""

from __future__ import annotations

import pytest

from .conftest import MODEL_ID
from .helpers import assert_no_markup

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


def request(max_tokens: int, **extra) -> dict:
    return dict(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **extra,
    )


def streamed(client, max_tokens: int) -> tuple[str, list[list[str]], str | None]:
    content, calls, finish_reason = "", [], None
    for chunk in client.chat.completions.create(**request(max_tokens, stream=True)):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id:
                calls.append([call.function.name, ""])
            calls[call.index][1] += call.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return content, calls, finish_reason


# 8 tokens end inside `{"name": "get_weather"` (no call yet); 45 inside the arguments.
@pytest.mark.parametrize("max_tokens", [8, 45])
def test_cut_off_call_leaks_no_markup(byte_client, max_tokens):
    reply = byte_client.chat.completions.create(**request(max_tokens))
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == max_tokens
    content = choice.message.content or ""
    assert_no_markup(content)
    assert "{" not in content
    calls = [[c.function.name, c.function.arguments] for c in choice.message.tool_calls or []]
    if max_tokens == 8:
        assert calls == []
    else:
        assert [name for name, _ in calls] == ["get_weather"]
    assert streamed(byte_client, max_tokens) == (content, calls, "length")


def test_responses_cut_off_call_leaks_no_markup(byte_client):
    fields = dict(
        model=MODEL_ID,
        input="weather?",
        tools=[{"type": "function", **WEATHER["function"]}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    response = byte_client.responses.create(**fields)
    assert response.status == "incomplete"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == ""
    deltas = [
        event.delta
        for event in byte_client.responses.create(**fields, stream=True)
        if event.type == "response.output_text.delta"
    ]
    assert "".join(deltas) == ""


def test_anthropic_cut_off_call_leaks_no_markup(byte_server):
    import anthropic

    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    fields = dict(
        model=MODEL_ID,
        max_tokens=8,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    with anthropic.Anthropic(base_url=byte_server.base_url, api_key="unused", max_retries=0) as c:
        message = c.messages.create(**fields)
        assert message.stop_reason == "max_tokens"
        assert [(block.type, block.text) for block in message.content] == [("text", "")]
        with c.messages.stream(**fields) as stream:
            streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens"
    assert [(block.type, block.text) for block in streamed.content] == [("text", "")]
