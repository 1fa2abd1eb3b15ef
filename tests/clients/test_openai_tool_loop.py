"""An agent's two-step tool loop with the `openai` client against the clients' `axon serve` (a
tiny model carrying Qwen3's real chat template from llama.cpp's corpus): a forced call, then the
assistant's `tool_calls` turn (content null, as every client sends it) and the tool's result."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.clients.conftest import MODEL_ID

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture()
def client(qwen3_server):
    from openai import OpenAI

    url = qwen3_server.openai_url
    with OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_tool_loop_second_step_answers(client, qwen3_server):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=300,
        seed=7,
        extra_body=NO_THINKING,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # What the SDK's users append: the assistant message as returned (content None) + a result.
    messages.append(message.model_dump(exclude_unset=True, exclude_none=False))
    assert messages[-1]["content"] is None
    result = [{"type": "text", "text": '{"temp_c": 21}'}]
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    second = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER], max_tokens=8, seed=7
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    body = {"model": MODEL_ID, "messages": messages, "tools": [WEATHER]}
    tokens = httpx.post(qwen3_server.base_url + "/tokenize", json=body, timeout=60)
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["count"] == second.usage.prompt_tokens
