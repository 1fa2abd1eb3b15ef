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
XML = (  # a string enum's member bare, as Qwen3.5 writes it and the parser keeps it
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
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
        (
            {"type": "tool_call", "format": "qwen3_coder", "tools": TOOLS},
            XML.replace("\nRome\n", '\n"Rome"\n'),
            False,
        ),
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


def test_json_schema_with_thinking_when_the_markers_are_special(special_markers_model):
    # The tokenizer flags `<think>` and `</think>` special; skip_special_tokens is on. The
    # reasoning must still be split off, so the content is the JSON alone.
    from axon.engine.llm import LLM
    from axon.sampling_params import SamplingParams
    from axon.tokenizer.parsers import parser_family

    llm = LLM(
        str(special_markers_model), max_model_len=1024, kv_cache_memory=8 << 20, dtype="float32"
    )
    tokenizer = llm.tokenizer
    think, end = (tokenizer.convert_tokens_to_ids(m) for m in ("<think>", "</think>"))
    assert tokenizer.added_tokens_decoder[think].special
    spec = {"type": "json_schema", "schema": SCHEMA, "thinking": "optional"}
    # Biased so that the output opens a reasoning block and closes it after a few tokens.
    bias = {think: 30.0, end: 3.0}
    params = SamplingParams(
        n=3, temperature=1.0, seed=1, max_tokens=400, structured_output=spec, logit_bias=bias
    )
    (output,) = llm.generate(["hello"], params)
    plan = ChatOutputPlan(
        family=parser_family(tokenizer),
        prompt="hello",
        tools=None,
        parse_tools=True,
        enable_thinking=True,
        include_thinking=False,
        parallel_tool_calls=True,
    )
    reasonings = []
    for sample in output.outputs:
        assert sample.finish_reason == "stop", sample.text
        message = ChoiceOutput(plan).message(sample.text)
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        reasonings.append(message["reasoning_content"] or "")
        assert "think>" not in reasonings[-1]
    assert any(reasonings), "some sample reasoned before its JSON"


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
    from axon.server.routes.responses import _ResponseContext
    from axon.server.schemas.responses import ResponsesRequest

    body = ResponsesRequest(model=MODEL_ID, input="hi")
    context = _ResponseContext(body, type("M", (), {"id": MODEL_ID})(), None, plan(False))
    items = context.output_items("<think>\nhmm\n</think>\n\nHi.", "completed")
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == "hmm"
    assert items[1]["content"][0]["text"] == "Hi."


# ---- validation and the grammar cache --------------------------------------------------------


def test_grammar_cache_is_a_bounded_lru(monkeypatch):
    from axon.structured import backend

    monkeypatch.setattr(backend, "GRAMMAR_CACHE_SIZE", 2)
    outputs = backend.StructuredOutputs("unused", 256, frozenset())
    specs = [{"type": "json_schema", "schema": {"title": f"s{i}"}} for i in range(3)]
    for spec in (specs[0], specs[1], specs[0], specs[2]):  # 0 used again: 1 is the oldest
        assert outputs._grammar(spec) == build_grammar(spec)
    assert list(outputs._grammars) == [backend._grammar_key(s) for s in (specs[0], specs[2])]


def test_malformed_response_format_and_tools_are_400s_not_crashes():
    from axon.server.chat_output import _response_format
    from axon.server.errors import BadRequest

    with pytest.raises(BadRequest) as raised:
        _response_format({"type": "json_schema", "json_schema": "x"})
    assert raised.value.param == "response_format.json_schema.schema"
    nameless = plan(False)
    nameless.tools = [{"type": "function"}, {"type": "function", "function": "x"}]
    with pytest.raises(BadRequest) as raised:
        nameless._forced_tool_call("required")
    assert raised.value.param == "tool_choice"


@pytest.mark.slow
def test_server_splits_reasoning_when_the_markers_are_special(special_markers_model):
    # End to end: `axon serve` on the special-markers model, a json_schema chat request with
    # thinking on, whole and streamed: the reasoning is in reasoning_content, the JSON alone in
    # content.
    import httpx

    from tests.server.conftest import start_server, stop_server

    tokenizer = byte_tokenizer(markers_special=True)
    think, end = (tokenizer.convert_tokens_to_ids(m) for m in ("<think>", "</think>"))
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    body = {
        "model": MODEL_ID,
        "messages": MESSAGES,
        "response_format": response_format,
        "logit_bias": {str(think): 30, str(end): 3},
        "n": 3,
        "seed": 1,
        "max_tokens": 400,
    }
    server = start_server(special_markers_model)
    try:
        url = server.openai_url + "/chat/completions"
        reply = httpx.post(url, json=body, timeout=120).json()
        messages = [choice["message"] for choice in reply["choices"]]
        whole = [(m["content"], m["reasoning_content"] or "") for m in messages]
        streamed = [["", ""] for _ in range(3)]
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as events:
            for line in events.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    delta = choice["delta"]
                    streamed[choice["index"]][0] += delta.get("content") or ""
                    streamed[choice["index"]][1] += delta.get("reasoning_content") or ""
    finally:
        stop_server(server)
    for content, reasoning in [*whole, *map(tuple, streamed)]:
        jsonschema.validate(json.loads(content), SCHEMA)
        assert "think>" not in reasoning
    assert any(reasoning for _, reasoning in whole), "some sample reasoned before its JSON"
    assert [tuple(s) for s in streamed] == whole  # the same seed: the same samples


def test_the_grammar_backend_builds_in_the_background(byte_model, tmp_path):
    """The engine parks structured requests while this build runs, and keeps stepping."""
    from axon.structured import backend

    outputs = backend.StructuredOutputs(str(byte_model), 256, frozenset({2}))
    assert not outputs.ready
    outputs.start_build()
    outputs.start_build()  # once
    spec = {"type": "json_schema", "schema": SCHEMA}
    assert outputs.matcher(spec) is not None  # waits for the build in progress
    assert outputs.ready

    broken = backend.StructuredOutputs(str(tmp_path), 256, frozenset())  # no tokenizer there
    broken.start_build()
    with pytest.raises(ValueError, match="structured output"):
        broken.matcher(spec)
    assert broken.ready  # failed: every later request fails at once, none waits
