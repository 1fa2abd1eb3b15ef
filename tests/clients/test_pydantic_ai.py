"""pydantic-ai's agent loop against `axon serve`: an Agent with one tool on the OpenAI-compatible
chat model at a base URL, `run_sync`. A capability forces the tool until it has answered (the
documented way to vary tool_choice per step), so the second step answers in text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from lazy_modules import lazy
from tests.clients.conftest import MODEL_ID, RESULT, assert_chat_tool_loop, rendered_prompt

pydantic_ai = lazy("pydantic_ai")


def _tool_answered(ctx) -> bool:
    from pydantic_ai.messages import ToolReturnPart

    parts = (part for message in ctx.messages for part in getattr(message, "parts", ()))
    return any(isinstance(part, ToolReturnPart) for part in parts)


def _force_weather_first():
    """A capability that forces the tool until it has answered (a class defined here, as
    pydantic-ai is imported only when a test runs)."""

    @dataclass(init=False)
    class ForceWeatherFirst(pydantic_ai.capabilities.AbstractCapability):
        def get_model_settings(self):
            return lambda ctx: {} if _tool_answered(ctx) else {"tool_choice": ["get_weather"]}

    return ForceWeatherFirst()


def _agent(recorder, calls: list[str]):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=recorder.url + "/v1", api_key="unused")
    settings = {
        "max_tokens": 100,
        "seed": 7,
        "parallel_tool_calls": False,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    agent = pydantic_ai.Agent(
        OpenAIChatModel(MODEL_ID, provider=provider),
        model_settings=settings,
        capabilities=[_force_weather_first()],
    )

    @agent.tool_plain
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return RESULT

    return agent


def test_pydantic_ai_tool_loop(recorder, qwen3_server):
    calls = []
    result = _agent(recorder, calls).run_sync("What is the weather in Paris?")
    assert calls in (["Paris"], ["Rome"])
    assert isinstance(result.output, str)
    assert_chat_tool_loop(recorder, qwen3_server)


def test_pydantic_ai_streamed_tool_loop(recorder, qwen3_server):
    """`run_stream`: the call assembled from stream chunks, then the answer streamed."""
    import asyncio

    calls = []

    async def run() -> str:
        agent = _agent(recorder, calls)
        async with agent.run_stream("What is the weather in Paris?") as streamed:
            return await streamed.get_output()

    assert isinstance(asyncio.run(run()), str)
    assert calls in (["Paris"], ["Rome"])
    posts = recorder.posts("/chat/completions")
    assert [post.status for post in posts] == [200, 200]
    assert all(json.loads(post.body)["stream"] for post in posts)
    prompt, _ = rendered_prompt(qwen3_server, json.loads(posts[1].body))
    assert RESULT in prompt
