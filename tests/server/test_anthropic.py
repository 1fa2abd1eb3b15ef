"""Anthropic's Messages API against a real `axon serve`, driven by the official `anthropic` client:
shape and greedy text equal to /v1/chat/completions, streaming events, stop sequences,
count_tokens, tools (a forced tool_use), thinking blocks, and errors in Anthropic's shape.

Text, streaming and errors run on the session's word-level model; tools and thinking on a
byte-level model whose tokenizer has `<think>` and `<tool_call>` (`thinking_server`).
"""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from lazy_modules import lazy
from tests.parsers.conftest import byte_tokenizer

from .conftest import MODEL_ID

anthropic = lazy("anthropic")

HELLO = [{"role": "user", "content": "hello world"}]
PROMPT_TOKENS = 7  # <|im_start|> user hello world <|im_end|> <|im_start|> assistant
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # Anthropic's default
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
FORCED = {"type": "tool", "name": "get_weather"}
# The newest `anthropic` clients no longer name the sampling fields; the API still takes them.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture()
def claude(server):
    """The official Anthropic client on the session's server (no retries: errors surface)."""
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture()
def byte_claude(thinking_server):
    url = thinking_server.base_url
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as c:
        yield c


def create(claude, **fields):
    return claude.messages.create(model=MODEL_ID, messages=HELLO, **fields)


def prompt_tokens(usage) -> int:
    """Anthropic's input_tokens leave out what the prefix cache read; together they are all."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


# ---- text -----------------------------------------------------------------------------------


def test_message_shape_and_greedy_text_equal_chat(claude, client):
    message = create(claude, max_tokens=8, **GREEDY)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL_ID
    (block,) = message.content
    assert block.type == "text" and block.text
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=HELLO, max_tokens=8, temperature=0, extra_body=NO_THINKING
    )
    assert block.text == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert prompt_tokens(message.usage) == PROMPT_TOKENS
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.stop_sequence is None


def test_stream_text_equals_the_whole_message(claude):
    expected = create(claude, max_tokens=8, **GREEDY)
    with claude.messages.stream(model=MODEL_ID, messages=HELLO, max_tokens=8, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.content[0].text == final.content[0].text
    assert final.stop_reason == expected.stop_reason and final.id.startswith("msg_")
    assert final.usage.output_tokens == expected.usage.output_tokens
    assert prompt_tokens(final.usage) == PROMPT_TOKENS


def test_stream_event_sequence(http):
    body = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names  # each event's name is its type
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert data[2]["content_block"] == {"type": "text", "text": ""}
    assert all(d["delta"]["type"] == "text_delta" for d in data[3:-3])
    delta = data[-2]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] >= len(data[3:-3])  # one delta per visible token


def test_stop_sequences(claude):
    full = create(claude, max_tokens=8, **GREEDY).content[0].text
    words = full.split()
    assert len(words) >= 3, "the greedy answer is long enough to cut"
    stop = words[2]
    message = create(claude, max_tokens=8, stop_sequences=[stop, "never"], **GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text
    assert message.content[0].text == full[: full.index(stop)]


def test_system_prompt_and_sampling_fields(claude, client):
    system = [{"type": "text", "text": "story"}]
    sampling = {"temperature": 0.0, "top_p": 0.9, "top_k": 5}
    message = create(
        claude, max_tokens=4, system=system, metadata={"user_id": "u-1"}, extra_body=sampling
    )
    chat = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "system", "content": "story"}, *HELLO],
        max_tokens=4,
        temperature=0,
        extra_body=NO_THINKING,
    )
    assert message.content[0].text == chat.choices[0].message.content
    assert prompt_tokens(message.usage) == chat.usage.prompt_tokens


# ---- count_tokens ---------------------------------------------------------------------------


def test_count_tokens_equals_the_requests_input_tokens(claude):
    counted = claude.messages.count_tokens(model=MODEL_ID, messages=HELLO, system="story")
    message = create(claude, max_tokens=2, system="story")
    assert counted.input_tokens == prompt_tokens(message.usage) == PROMPT_TOKENS + 4


def test_count_tokens_of_a_conversation_equals_chat(claude, client):
    turns = [*HELLO, {"role": "assistant", "content": "tell me"}, {"role": "user", "content": "a"}]
    blocks = [{"type": "text", "text": "tell"}, {"type": "text", "text": "me"}]
    anthropic_turns = [turns[0], {"role": "assistant", "content": blocks}, turns[2]]
    counted = claude.messages.count_tokens(model=MODEL_ID, messages=anthropic_turns)
    chat = client.chat.completions.create(model=MODEL_ID, messages=turns, max_tokens=1)
    assert counted.input_tokens == chat.usage.prompt_tokens


# ---- errors ---------------------------------------------------------------------------------


def error_of(exc) -> dict:
    assert exc.body["type"] == "error", exc.body
    error = exc.body["error"]
    assert set(error) == {"type", "message"} and error["message"]
    return error


@pytest.mark.parametrize(
    "fields",
    [
        {"extra_body": {"frequency_penalty": 1.0}},  # not Anthropic's: refused, not ignored
        {"metadata": {"user_id": "u", "team": "x"}},
        {"extra_body": {"temperature": 1.5}},
        {"messages": [*HELLO, {"role": "assistant", "content": "w9"}]},  # a prefill
        {"thinking": {"type": "enabled", "budget_tokens": 64}},  # not below max_tokens
        {"output_config": {"effort": "high"}},
    ],
    ids=["unknown-field", "metadata-field", "temperature", "prefill", "budget", "effort"],
)
def test_bad_requests_are_400s_in_anthropics_shape(claude, fields):
    fields = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 8, **fields}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(**fields)
    assert caught.value.status_code == 400
    assert error_of(caught.value)["type"] == "invalid_request_error"


def test_unknown_model_is_not_found(claude):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="no-such-model", messages=HELLO, max_tokens=4)
    assert error_of(caught.value)["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="no-such-model", messages=HELLO)


@pytest.mark.parametrize("source", ["base64", "url"])
def test_images_reach_the_chat_paths_image_check(claude, source):
    if source == "base64":
        data = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
        source = {"type": "base64", "media_type": "image/png", "data": data}
    else:
        source = {"type": "url", "url": "https://example.com/cat.png"}
    content = [{"type": "image", "source": source}, {"type": "text", "text": "hello"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model=MODEL_ID, messages=[{"role": "user", "content": content}], max_tokens=4
        )
    assert "vision" in error_of(caught.value)["message"]


class _Any:
    """Equal to any non-empty string (an error's message)."""

    def __eq__(self, other) -> bool:
        return isinstance(other, str) and bool(other)


ANY = _Any()


def in_process(api_key: str | None, registry, http_module=httpx):
    """An ASGI transport (of `http_module`) into the app over `registry`, in this process."""
    from axon.server.app import create_app

    app = create_app(SimpleNamespace(config=SimpleNamespace(api_key=api_key), registry=registry))
    return http_module.ASGITransport(app=app)


def sdk_httpx():
    """The httpx the installed client is built on (newer releases use the `httpx2` fork)."""
    from anthropic import _base_client

    return getattr(_base_client, "httpx2", None) or _base_client.httpx


def test_api_key_as_x_api_key_or_bearer():
    from axon.server.errors import ModelNotFound

    def missing(model_id):
        raise ModelNotFound(f"model {model_id!r} is not loaded", param="model")

    registry = SimpleNamespace(get=missing, list_models=lambda: [])
    module = sdk_httpx()
    transport = in_process("sekrit", registry, module)

    async def scenario() -> list:
        outcomes = []
        async with module.AsyncClient(transport=transport, base_url="http://app") as http:
            for key in ({"api_key": "wrong"}, {"api_key": "sekrit"}, {"auth_token": "sekrit"}):
                claude = anthropic.AsyncAnthropic(
                    base_url="http://app", http_client=http, max_retries=0, **key
                )
                try:
                    await claude.messages.create(model="m", messages=HELLO, max_tokens=2)
                except anthropic.APIStatusError as exc:
                    outcomes.append(exc)
            outcomes.append(await http.get("/v1/models", headers={"x-api-key": "sekrit"}))
        return outcomes

    wrong, by_x_api_key, by_bearer, openai_route = asyncio.run(scenario())
    assert isinstance(wrong, anthropic.AuthenticationError)
    assert error_of(wrong)["type"] == "authentication_error"
    # The right key gets past the check to the model look-up (none is loaded here).
    assert isinstance(by_x_api_key, anthropic.NotFoundError)
    assert isinstance(by_bearer, anthropic.NotFoundError)
    # The OpenAI routes keep their bearer-only check and their own envelope.
    assert openai_route.status_code == 401 and openai_route.json()["error"]["code"]


def test_server_side_errors_take_anthropics_types():
    from axon.server.errors import ModelUnavailable, Overloaded

    failures = {
        "busy": Overloaded("queue full", headers={"Retry-After": "1"}),
        "loading": ModelUnavailable("loading", headers={"Retry-After": "5"}),
        "broken": RuntimeError("boom"),
    }

    def get(model_id):
        raise failures[model_id]

    transport = in_process(None, SimpleNamespace(get=get))

    async def scenario() -> dict:
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            body = {"messages": HELLO, "max_tokens": 2}
            return {m: await http.post("/v1/messages", json={**body, "model": m}) for m in failures}

    responses = asyncio.run(scenario())
    expected = {
        "busy": (429, "rate_limit_error"),
        "loading": (503, "overloaded_error"),
        "broken": (500, "api_error"),
    }
    for model_id, (status, kind) in expected.items():
        response = responses[model_id]
        assert response.status_code == status
        assert response.json() == {"type": "error", "error": {"type": kind, "message": ANY}}
    assert responses["busy"].headers["retry-after"] == "1"


# ---- tools and thinking (the byte-level model) ----------------------------------------------


def test_forced_tool_use(byte_claude):
    message = byte_claude.messages.create(
        model=MODEL_ID, messages=HELLO, max_tokens=200, tools=[WEATHER], tool_choice=FORCED,
        **GREEDY,
    )  # fmt: skip
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER["input_schema"])


def test_streamed_tool_use(byte_claude, thinking_server):
    fields = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 200, **GREEDY}
    fields.update(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    with byte_claude.messages.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(fragments) > 2, "the input arrives in fragments"
    (block,) = final.content
    assert block.type == "tool_use" and final.stop_reason == "tool_use"
    assert json.loads("".join(fragments)) == block.input
    jsonschema.validate(block.input, WEATHER["input_schema"])


def thinking_request(**fields) -> dict:
    thinking = {"type": "enabled", "budget_tokens": 30}
    return dict(model=MODEL_ID, messages=HELLO, max_tokens=40, thinking=thinking, **GREEDY)


def test_thinking_blocks_whole_and_streamed(byte_claude, thinking_server):
    message = byte_claude.messages.create(**thinking_request())
    thought = message.content[0]
    assert thought.type == "thinking" and thought.thinking and thought.signature == ""
    body = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 40, "temperature": 0}
    body["thinking_token_budget"] = 30  # budget_tokens is enforced: chat's equivalent
    chat = httpx.post(thinking_server.openai_url + "/chat/completions", json=body).json()
    assert thought.thinking == chat["choices"][0]["message"]["reasoning_content"]
    with byte_claude.messages.stream(**thinking_request()) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == [block.type for block in message.content]
    thinking = [e.delta.thinking for e in events if e.type == "content_block_delta"
                and e.delta.type == "thinking_delta"]  # fmt: skip
    assert "".join(thinking) == thought.thinking == final.content[0].thinking
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    assert final.stop_reason == message.stop_reason


def test_thinking_is_off_unless_asked(byte_claude):
    """Off (Anthropic's default), the template closes an empty think block in the prompt; on,
    it opens one."""
    count = byte_claude.messages.count_tokens
    plain = count(model=MODEL_ID, messages=HELLO).input_tokens
    disabled = count(model=MODEL_ID, messages=HELLO, thinking={"type": "disabled"}).input_tokens
    thinking = {"type": "enabled", "budget_tokens": 1024}
    enabled = count(model=MODEL_ID, messages=HELLO, thinking=thinking).input_tokens
    tokenizer = byte_tokenizer()
    closed = tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    opened = tokenizer.encode("<think>", add_special_tokens=False)
    assert plain == disabled == enabled - len(opened) + len(closed)


def test_tool_history_renders_as_chats_tool_messages(byte_claude, thinking_server):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"}
    turns = [
        *HELLO,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, call]},
        {"role": "user", "content": [result, {"type": "text", "text": "and?"}]},
    ]
    counted = byte_claude.messages.count_tokens(model=MODEL_ID, messages=turns, tools=[WEATHER])
    function = {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}
    chat_turns = [
        *HELLO,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "user", "content": "and?"},
    ]  # fmt: skip
    tool = {"type": "function", "function": {**WEATHER, "parameters": WEATHER["input_schema"]}}
    del tool["function"]["input_schema"]
    body = {"model": MODEL_ID, "messages": chat_turns, "tools": [tool], "max_tokens": 1}
    chat = httpx.post(
        thinking_server.openai_url + "/chat/completions", json={**body, **NO_THINKING}
    )
    assert chat.status_code == 200, chat.text
    assert counted.input_tokens == chat.json()["usage"]["prompt_tokens"]


# ---- the pieces ------------------------------------------------------------------------------


def test_translation_of_blocks():
    from axon.server.schemas.anthropic_protocol import MessagesRequest, chat_messages

    image = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image", "source": image}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [
                        {"type": "text", "text": "one"}]}]},
            ],
        }
    )  # fmt: skip
    system, user, assistant, tool = chat_messages(body)
    assert system["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    url = "data:image/png;base64,AAAA"
    assert user["content"][1] == {"type": "image_url", "image_url": {"url": url}}
    function = {"name": "f", "arguments": '{"x": 1}'}
    assert assistant == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hmm",
        "tool_calls": [{"id": "t1", "type": "function", "function": function}],
    }
    assert tool == {"role": "tool", "tool_call_id": "t1", "content": "one"}


def test_stop_reasons():
    from axon.server.routes.anthropic import _MessageContext

    body = SimpleNamespace(max_tokens=100, stop_sequences=["END"])
    context = _MessageContext(body, None, None, SimpleNamespace(max_tokens=10))
    no_calls = SimpleNamespace(num_calls=0)

    def stop(finish, tokens=10, stop_reason=None, output=no_calls):
        sample = SimpleNamespace(finish_reason=finish, token_ids=[0] * tokens)
        sample.stop_reason = stop_reason
        return context.stop(sample, output)

    # The context left room for 10 of the 100 asked for: Anthropic's context-window stop.
    assert stop("length") == ("model_context_window_exceeded", None)
    assert stop("stop", stop_reason="END") == ("stop_sequence", "END")
    assert stop("stop", stop_reason=2) == ("end_turn", None)
    assert stop("stop", output=SimpleNamespace(num_calls=1)) == ("tool_use", None)
    context.context_bound = False
    assert stop("length") == ("max_tokens", None)


def test_output_config_format_is_enforced(byte_claude):
    schema = WEATHER["input_schema"]
    message = byte_claude.messages.create(
        model=MODEL_ID,
        messages=HELLO,
        max_tokens=100,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)
