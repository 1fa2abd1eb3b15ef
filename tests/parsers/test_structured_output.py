"""Structured output: grammars accept what they should, and a random-weight tiny model forced
by them still writes JSON that parses and validates (engine and server), and tool calls for
tool_choice required / named."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from axon.server.chat_output import ChatOutputPlan, ChoiceOutput
from axon.structured import build_grammar, unpack_bitmask
from axon.tokenizer.parsers import ParserFamily

from .conftest import MODEL_ID, byte_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def ll_tokenizer():
    import llguidance.hf

    tokenizer = byte_tokenizer()
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=320, eos_token=[258])


def accepts(ll_tokenizer, spec: dict, text: str) -> bool:
    from llguidance import LLMatcher

    tokenizer, info = ll_tokenizer
    matcher = LLMatcher(info, build_grammar(spec), log_level=0)
    ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    return ok and matcher.is_accepting()


TOOLS = [{"name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
HERMES = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
)
XML = (
    '<tool_call>\n<function=get_weather>\n<parameter=city>\n"Rome"\n</parameter>\n'
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


@pytest.mark.parametrize(
    ("spec", "text", "ok"),
    [
        ({"type": "json_object"}, '{"a": [1, {"b": null}]}', True),
        ({"type": "json_object"}, "[1]", False),
        ({"type": "json_schema", "schema": SCHEMA}, '{"name": "x", "age": 3}', True),
        ({"type": "json_schema", "schema": SCHEMA}, '{"name": "x", "age": -1}', False),
        ({"type": "json_schema", "schema": SCHEMA}, '{"name": "x"}', False),
        ({"type": "json_object", "thinking": "optional"}, "<think>\nhm\n</think>\n\n{}", True),
        ({"type": "json_object", "thinking": "optional"}, "{}", True),
        ({"type": "json_object", "thinking": "started"}, "hm\n</think>\n\n{}", True),
        ({"type": "tool_call", "format": "hermes", "tools": TOOLS}, HERMES, True),
        ({"type": "tool_call", "format": "hermes", "tools": TOOLS}, f"{HERMES}\n{HERMES}", False),
        (
            {"type": "tool_call", "format": "hermes", "tools": TOOLS, "parallel": True},
            f"{HERMES}\n{HERMES}",
            True,
        ),
        ({"type": "tool_call", "format": "qwen3_coder", "tools": TOOLS}, XML, True),
    ],
)
def test_grammar_accepts(ll_tokenizer, spec, text, ok):
    assert accepts(ll_tokenizer, spec, text) is ok


def test_unpack_bitmask():
    bitmask = torch.tensor([[0b101, -1], [0, -(1 << 31)]], dtype=torch.int32)  # [2, 2]
    allowed = unpack_bitmask(bitmask, 70)
    assert allowed.shape == (2, 70)
    assert allowed[0, :3].tolist() == [True, False, True] and allowed[0, 32:64].all()
    assert not allowed[0, 64:].any() and allowed[1].nonzero().flatten().tolist() == [63]


def test_engine_output_follows_the_schema(byte_model):
    from axon.engine.llm import LLM
    from axon.sampling_params import SamplingParams

    llm = LLM(str(byte_model), max_model_len=1024, kv_cache_memory=8 << 20, dtype="float32")
    spec = {"type": "json_schema", "schema": SCHEMA}
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=400, structured_output=spec)
    (output,) = llm.generate(["hello"], params)
    for sample in output.outputs:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), SCHEMA)


# ---- the server -----------------------------------------------------------------------------


def test_response_format_json_object(byte_client):
    reply = byte_client.chat.completions.create(
        model=MODEL_ID,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=1500,
        seed=3,
        extra_body=NO_THINKING,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_response_format_json_schema(byte_client):
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    reply = byte_client.chat.completions.create(
        model=MODEL_ID,
        messages=MESSAGES,
        response_format=response_format,
        max_tokens=1000,
        seed=5,
        n=2,
        extra_body=NO_THINKING,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_invalid_schema_is_a_400(byte_client):
    import openai

    bad = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError):
        byte_client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, response_format=bad, max_tokens=10
        )


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_call(byte_client, tool_choice):
    reply = byte_client.chat.completions.create(
        model=MODEL_ID,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=300,
        seed=7,
        extra_body=NO_THINKING,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert not choice.message.content


def test_streamed_tool_call_deltas(byte_client):
    stream = byte_client.chat.completions.create(
        model=MODEL_ID,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        seed=7,
        stream=True,
        extra_body=NO_THINKING,
    )
    chunks = list(stream)
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    first = calls[0][0]
    assert first.index == 0 and first.id.startswith("call_")
    assert first.function.name == "get_weather"
    assert all(call.index == 0 for delta in calls for call in delta)
    arguments = "".join(call[0].function.arguments or "" for call in calls)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert len(calls) > 2, "arguments arrive in fragments"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "<tool_call>" not in content and "{" not in content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# ---- reasoning in the chat output ------------------------------------------------------------


def plan(include_thinking: bool) -> ChatOutputPlan:
    family = ParserFamily(reasoning=True, tool_format="hermes")
    return ChatOutputPlan(family, "assistant\n", [WEATHER], True, True, include_thinking, True)


def test_reasoning_content_and_x_include_thinking():
    text = "<think>\nhmm\n</think>\n\nHi."
    assert ChoiceOutput(plan(False)).message(text) == {
        "role": "assistant",
        "content": "Hi.",
        "reasoning_content": "hmm",
    }
    wrapped = ChoiceOutput(plan(True)).message(text)
    assert wrapped == {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHi."}
    stream = ChoiceOutput(plan(True))
    deltas = [d for ch in text for d in stream.deltas(ch)] + stream.deltas("", final=True)
    assert "".join(d["content"] for d in deltas) == "<think>\nhmm\n</think>\n\nHi."


def test_x_include_thinking_header_reaches_the_route(byte_server):
    import httpx

    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    headers = {"x-include-thinking": "1"}
    reply = httpx.post(byte_server.openai_url + "/chat/completions", json=body, headers=headers)
    message = reply.json()["choices"][0]["message"]
    assert "reasoning_content" not in message and isinstance(message["content"], str)


def test_responses_forced_tool_call_is_a_function_call_item(byte_client):
    tool = {"type": "function", **WEATHER["function"]}
    response = byte_client.responses.create(
        model=MODEL_ID,
        input="hello",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        extra_body={"seed": 7, **NO_THINKING},
    )
    (item,) = response.output
    assert item.type == "function_call" and item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), WEATHER["function"]["parameters"])


def test_responses_reasoning_is_its_own_output_item():
    from axon.server.protocol import ResponsesRequest
    from axon.server.responses import _ResponseContext

    body = ResponsesRequest(model=MODEL_ID, input="hi")
    context = _ResponseContext(body, type("M", (), {"id": MODEL_ID})(), None, plan(False))
    items = context.output_items("<think>\nhmm\n</think>\n\nHi.", "completed")
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == "hmm"
    assert items[1]["content"][0]["text"] == "Hi."
