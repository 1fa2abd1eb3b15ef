"""LiteLLM's tool loop against `axon serve` (an OpenAI-compatible base URL): `completion` with a
forced tool, then the assistant turn as LiteLLM returns it and the tool's result."""

from __future__ import annotations

import json
import os

from lazy_modules import lazy
from tests.clients.conftest import (
    CITY_SCHEMA,
    MODEL_ID,
    RESULT,
    assert_chat_tool_loop,
    rendered_prompt,
)

# LiteLLM fetches its model price map from GitHub at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = lazy("litellm")

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": CITY_SCHEMA},
}


def _common(recorder) -> dict:
    return {
        "model": "openai/" + MODEL_ID,  # LiteLLM's prefix for any OpenAI-compatible server
        "api_base": recorder.url + "/v1",
        "api_key": "unused",
        "tools": [WEATHER],
        "max_tokens": 300,
        "seed": 7,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }


FORCED = {"type": "function", "function": {"name": "get_weather"}}


def test_litellm_tool_loop(recorder, qwen3_server):
    common = _common(recorder)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = litellm.completion(messages=messages, tool_choice=FORCED, **common)
    message = first.choices[0].message
    (call,) = message.tool_calls
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    messages.append(message.model_dump())
    messages.append({"role": "tool", "tool_call_id": call.id, "content": RESULT})
    second = litellm.completion(messages=messages, **{**common, "max_tokens": 8})
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert_chat_tool_loop(recorder, qwen3_server)


def test_litellm_streamed_tool_loop(recorder, qwen3_server):
    """Streamed: LiteLLM's own chunk builder assembles the call from the deltas."""
    common = {**_common(recorder), "stream": True}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    chunks = list(litellm.completion(messages=messages, tool_choice=FORCED, **common))
    message = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
    (call,) = message.tool_calls
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    messages.append(message.model_dump())
    messages.append({"role": "tool", "tool_call_id": call.id, "content": RESULT})
    list(litellm.completion(messages=messages, **{**common, "max_tokens": 8}))
    posts = recorder.posts("/chat/completions")
    assert [post.status for post in posts] == [200, 200]
    assert all(json.loads(post.body)["stream"] for post in posts)
    prompt, _ = rendered_prompt(qwen3_server, json.loads(posts[1].body))
    assert RESULT in prompt
