"""LangChain's tool loop against `axon serve`: `ChatOpenAI.bind_tools` forcing the tool, then the
AIMessage as returned and a ToolMessage with the result."""

from __future__ import annotations

import json

from lazy_modules import lazy
from tests.clients.conftest import (
    CITY_SCHEMA,
    MODEL_ID,
    RESULT,
    assert_chat_tool_loop,
    rendered_prompt,
)

langchain_openai = lazy("langchain_openai")
messages_module = lazy("langchain_core.messages")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": CITY_SCHEMA,
    },
}


def test_langchain_tool_loop(recorder, qwen3_server, monkeypatch):
    monkeypatch.setenv("LANGSMITH_TRACING", "false")  # nothing goes online
    chat = langchain_openai.ChatOpenAI(
        model=MODEL_ID,
        base_url=recorder.url + "/v1",
        api_key="unused",
        max_retries=0,
        seed=7,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    messages = [messages_module.HumanMessage("What is the weather in Paris?")]
    forced = chat.bind_tools([WEATHER], tool_choice="get_weather", parallel_tool_calls=False)
    answer = forced.invoke(messages, max_tokens=300)
    (call,) = answer.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome")
    messages += [answer, messages_module.ToolMessage(RESULT, tool_call_id=call["id"])]
    final = chat.bind_tools([WEATHER]).invoke(messages, max_tokens=8)
    assert final.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert_chat_tool_loop(recorder, qwen3_server)


def test_langchain_streamed_tool_loop(recorder, qwen3_server):
    """The same loop streamed, as chat UIs run it: the call arrives as tool_call_chunks that
    LangChain adds up into one call."""
    chat = langchain_openai.ChatOpenAI(
        model=MODEL_ID,
        base_url=recorder.url + "/v1",
        api_key="unused",
        max_retries=0,
        seed=7,
        streaming=True,
        max_tokens=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    messages = [messages_module.HumanMessage("What is the weather in Paris?")]
    forced = chat.bind_tools([WEATHER], tool_choice="get_weather", parallel_tool_calls=False)
    chunks = list(forced.stream(messages, max_tokens=300))  # the call needs the room
    answer = chunks[0]
    for chunk in chunks[1:]:
        answer += chunk
    (call,) = answer.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome")
    messages += [answer, messages_module.ToolMessage(RESULT, tool_call_id=call["id"])]
    reasons = {chunk.response_metadata.get("finish_reason") for chunk in chat.stream(messages)}
    assert reasons - {None} in ({"stop"}, {"length"}, {"tool_calls"})
    posts = recorder.posts("/chat/completions")
    assert [post.status for post in posts] == [200, 200]
    assert all(json.loads(post.body)["stream"] for post in posts)
    second = json.loads(posts[1].body)
    assert [m["tool_call_id"] for m in second["messages"] if m["role"] == "tool"] == [call["id"]]
    prompt, _ = rendered_prompt(qwen3_server, second)
    assert RESULT in prompt
