"""The OpenAI Agents SDK's loop against `axon serve`: an Agent with one function tool on the
chat-completions model at a base URL, `Runner.run_sync`. The first step is forced to the tool
(the SDK resets tool_choice after a call, so the second step answers in text)."""

from __future__ import annotations

from typing import Literal

import pytest

from tests.clients.conftest import MODEL_ID, RESULT, assert_chat_tool_loop

agents = pytest.importorskip("agents")


def test_openai_agents_tool_loop(recorder, qwen3_server):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK exports traces to OpenAI otherwise
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return RESULT

    client = AsyncOpenAI(base_url=recorder.url + "/v1", api_key="unused", max_retries=0)
    settings = agents.ModelSettings(
        tool_choice="get_weather",
        parallel_tool_calls=False,
        max_tokens=100,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "seed": 7},
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model=MODEL_ID, openai_client=client),
        model_settings=settings,
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls in (["Paris"], ["Rome"])
    assert isinstance(result.final_output, str)
    requests = assert_chat_tool_loop(recorder, qwen3_server)
    assert requests[0]["tool_choice"]["function"]["name"] == "get_weather"
    assert "tool_choice" not in requests[1] or requests[1]["tool_choice"] == "auto"
