"""The `anthropic` client's tool loop on /v1/messages against `axon serve`: a forced `tool_use`,
then the assistant's content as returned and a user turn with the `tool_result` block."""

from __future__ import annotations

import json

import jsonschema

from axon.server.schemas.anthropic_protocol import MessagesRequest, chat_messages
from lazy_modules import lazy
from tests.clients.conftest import CITY_SCHEMA, MODEL_ID, RESULT, rendered_prompt

anthropic = lazy("anthropic")

WEATHER = {"name": "get_weather", "description": "The weather.", "input_schema": CITY_SCHEMA}


def test_anthropic_tool_loop(recorder, qwen3_server):
    fields = {"model": MODEL_ID, "tools": [WEATHER]}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with anthropic.Anthropic(base_url=recorder.url, api_key="unused", max_retries=0) as claude:
        forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
        first = claude.messages.create(
            messages=messages, tool_choice=forced, max_tokens=300, **fields
        )
        assert first.stop_reason == "tool_use"
        (use,) = [block for block in first.content if block.type == "tool_use"]
        jsonschema.validate(use.input, CITY_SCHEMA)
        messages.append({"role": "assistant", "content": first.content})
        result = {"type": "tool_result", "tool_use_id": use.id, "content": RESULT}
        messages.append({"role": "user", "content": [result]})
        second = claude.messages.create(messages=messages, max_tokens=8, **fields)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    posts = recorder.posts("/v1/messages")
    assert [post.status for post in posts] == [200, 200]
    # The prompt axon rendered for the second turn (its conversion of the recorded request).
    body = MessagesRequest.model_validate(json.loads(posts[1].body))
    prompt, _ = rendered_prompt(qwen3_server, {"model": MODEL_ID, "messages": chat_messages(body)})
    assert RESULT in prompt and f'"{use.input["city"]}"' in prompt
    # Anthropic's input_tokens leaves out the prefix cache's hits; together they are the prompt.
    second_prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    count = claude_count(qwen3_server, {"messages": messages, **fields})
    assert second_prompt == count > first.usage.input_tokens + len(RESULT)


def claude_count(server, fields: dict) -> int:
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as claude:
        return claude.messages.count_tokens(**fields).input_tokens


def test_anthropic_streamed_tool_loop(recorder, qwen3_server):
    """The same loop streamed, as coding agents run it: the tool_use input assembled from
    `input_json_delta` events by the client's own stream accumulator."""
    fields = {"model": MODEL_ID, "tools": [WEATHER]}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    with anthropic.Anthropic(base_url=recorder.url, api_key="unused", max_retries=0) as claude:
        with claude.messages.stream(
            messages=messages, tool_choice=forced, max_tokens=300, **fields
        ) as stream:
            first = stream.get_final_message()
        (use,) = [block for block in first.content if block.type == "tool_use"]
        jsonschema.validate(use.input, CITY_SCHEMA)
        messages.append({"role": "assistant", "content": first.content})
        result = {"type": "tool_result", "tool_use_id": use.id, "content": RESULT}
        messages.append({"role": "user", "content": [result]})
        with claude.messages.stream(messages=messages, max_tokens=8, **fields) as stream:
            second = stream.get_final_message()
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    posts = recorder.posts("/v1/messages")
    assert [post.status for post in posts] == [200, 200]
    body = MessagesRequest.model_validate(json.loads(posts[1].body))
    prompt, _ = rendered_prompt(qwen3_server, {"model": MODEL_ID, "messages": chat_messages(body)})
    assert RESULT in prompt
