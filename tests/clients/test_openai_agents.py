"""The OpenAI Agents SDK's loop against `axon serve`: an Agent with one function tool, on the
chat-completions model and on the SDK's default Responses model, `Runner.run_sync`. The first
step is forced to the tool (the SDK resets tool_choice after a call, so the second step answers).
The SDK treats an incomplete response as an error, so the Responses agent has a structured
output (`text.format`): the grammar ends the random model's answer."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel

from lazy_modules import lazy
from tests.clients.conftest import MODEL_ID, RESULT, assert_chat_tool_loop, rendered_prompt

agents = lazy("agents")


class Report(BaseModel):
    sky: Literal["sunny", "rainy"]


def _weather_tool(calls: list[str]):
    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return RESULT

    return get_weather


def _settings():
    return agents.ModelSettings(
        tool_choice="get_weather",
        parallel_tool_calls=False,
        max_tokens=100,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "seed": 7},
    )


@pytest.fixture()
def client(recorder):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK exports traces to OpenAI otherwise
    return AsyncOpenAI(base_url=recorder.url + "/v1", api_key="unused", max_retries=0)


def test_openai_agents_tool_loop(client, recorder, qwen3_server):
    calls = []
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[_weather_tool(calls)],
        model=agents.OpenAIChatCompletionsModel(model=MODEL_ID, openai_client=client),
        model_settings=_settings(),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls in (["Paris"], ["Rome"])
    assert isinstance(result.final_output, str)
    requests = assert_chat_tool_loop(recorder, qwen3_server)
    assert requests[0]["tool_choice"]["function"]["name"] == "get_weather"
    assert "tool_choice" not in requests[1] or requests[1]["tool_choice"] == "auto"


def test_openai_agents_responses_loop(client, recorder):
    calls = []
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[_weather_tool(calls)],
        output_type=Report,
        model=agents.OpenAIResponsesModel(model=MODEL_ID, openai_client=client),
        model_settings=_settings(),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls in (["Paris"], ["Rome"])
    assert isinstance(result.final_output, Report)
    posts = recorder.posts("/v1/responses")
    assert [post.status for post in posts] == [200, 200]
    first, second = (json.loads(post.answer) for post in posts)
    outputs = [
        i for i in json.loads(posts[1].body)["input"] if i.get("type") == "function_call_output"
    ]
    assert [i["output"] for i in outputs] == [RESULT]
    # The byte-level tokenizer spells the result (and the call) one token per byte.
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + len(RESULT)


def test_openai_agents_streamed_loop(client, recorder, qwen3_server):
    """`Runner.run_streamed` (what chat front ends use): the call assembled from stream chunks."""
    import asyncio

    calls = []
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[_weather_tool(calls)],
        model=agents.OpenAIChatCompletionsModel(model=MODEL_ID, openai_client=client),
        model_settings=_settings(),
    )

    async def run():
        streamed = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return streamed

    streamed = asyncio.run(run())
    assert calls in (["Paris"], ["Rome"])
    assert isinstance(streamed.final_output, str)
    posts = recorder.posts("/chat/completions")
    assert [post.status for post in posts] == [200, 200]
    assert all(json.loads(post.body)["stream"] for post in posts)
    second = json.loads(posts[1].body)
    prompt, _ = rendered_prompt(qwen3_server, second)
    assert RESULT in prompt
