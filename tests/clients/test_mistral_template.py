"""The `openai` client's two-step tool loop on a tiny model carrying Mistral Small 3.2's real chat
template (llama.cpp's corpus). The template raises on any tool call id but 9 alphanumeric
characters, and axon's ids (`call_...`) are not: the normalised messages carry each id mapped to
such an id, the call and the result answering it alike (vLLM maps them for Mistral too), so the
second step renders instead of a 400."""

from __future__ import annotations

import json

import httpx
import pytest

from axon.tokenizer.messages import fixed_length_id
from tests.clients.conftest import CITY_SCHEMA, MODEL_ID, RESULT
from tests.parsers.conftest import byte_model_with_corpus_template
from tests.server.conftest import start_server, stop_server

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY_SCHEMA}}


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny_mistral_template")
    model = byte_model_with_corpus_template(path, "Mistral-Small-3.2-24B-Instruct-2506.jinja")
    running = start_server(model)
    yield running
    stop_server(running)


def test_openai_tool_loop_on_mistral_template(mistral_server):
    from openai import OpenAI

    server = mistral_server
    # A system prompt of its own: the template's default one is over 2,000 bytes (tokens here).
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    with OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
        first = c.chat.completions.create(
            model=MODEL_ID,
            messages=messages,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=300,
            seed=7,
        )
        (call,) = first.choices[0].message.tool_calls
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        messages.append(first.choices[0].message.model_dump(exclude_unset=True, exclude_none=False))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": RESULT})
        second = c.chat.completions.create(
            model=MODEL_ID, messages=messages, tools=[WEATHER], max_tokens=8, seed=7
        )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    body = {"model": MODEL_ID, "messages": messages, "tools": [WEATHER]}
    tokens = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["count"] == second.usage.prompt_tokens
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens.json()["tokens"]})
    prompt = text.json()["prompt"]
    short = fixed_length_id(call.id, 9)
    assert short != call.id and call.id not in prompt
    assert f"[TOOL_CALLS]get_weather[CALL_ID]{short}[ARGS]" in prompt
    assert f"[TOOL_RESULTS]{short}[TOOL_CONTENT]{RESULT}[/TOOL_RESULTS]" in prompt
