"""What coding agents send to `/v1/messages` beyond the basics, with the official `anthropic`
client against a real `axon serve`: `role: "system"` messages (folded into the system prompt)
and Claude Code's `context_management` (clear_thinking honoured; clearing tool results a 400
naming the edit)."""

from __future__ import annotations

import json

import httpx
import pytest

from axon.server.schemas.anthropic_protocol import MessagesRequest, chat_messages
from lazy_modules import lazy

from .conftest import MODEL_ID

anthropic = lazy("anthropic")

HELLO = [{"role": "user", "content": "hello world"}]
THINK = {"type": "enabled", "budget_tokens": 16}
KEEP_ALL = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
BETA = ["context-management-2025-06-27"]
CLEAR_TOOL_USES = {
    "type": "clear_tool_uses_20250919",
    "trigger": {"type": "input_tokens", "value": 30000},
    "keep": {"type": "tool_uses", "value": 3},
}


@pytest.fixture()
def claude(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture()
def byte_claude(thinking_server):
    url = thinking_server.base_url
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as c:
        yield c


def _error(exc) -> dict:
    assert exc.value.status_code == 400 and exc.value.body["type"] == "error"
    return exc.value.body["error"]


# ---- role: "system" inside messages ----------------------------------------------------------


def test_system_messages_fold_into_the_system_prompt(claude):
    folded = [
        {"role": "system", "content": "b"},
        *HELLO,
        {"role": "system", "content": [{"type": "text", "text": "c"}]},
    ]
    blocks = [{"type": "text", "text": text} for text in "abc"]
    fields = {"model": MODEL_ID, "max_tokens": 6, "extra_body": {"temperature": 0}}
    message = claude.messages.create(messages=folded, system="a", **fields)
    expected = claude.messages.create(messages=HELLO, system=blocks, **fields)
    assert message.content[0].text == expected.content[0].text
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == (
        expected.usage.input_tokens + (expected.usage.cache_read_input_tokens or 0)
    )
    count = claude.messages.count_tokens
    assert (
        count(model=MODEL_ID, messages=folded, system="a").input_tokens
        == count(model=MODEL_ID, messages=HELLO, system=blocks).input_tokens
    )
    alone = count(model=MODEL_ID, messages=[{"role": "system", "content": "a"}, *HELLO])
    assert alone.input_tokens == count(model=MODEL_ID, messages=HELLO, system="a").input_tokens


def test_system_messages_hold_text_and_need_a_turn_besides(claude):
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    system_image = [{"role": "system", "content": [image]}, *HELLO]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL_ID, messages=system_image, max_tokens=4)
    assert "messages[0].content[0].type" in _error(caught)["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        only = [{"role": "system", "content": "a"}]
        claude.messages.create(model=MODEL_ID, messages=only, max_tokens=4)
    assert _error(caught)["message"].startswith("messages:")


def test_a_system_message_after_an_assistant_turn_is_still_a_prefill(claude):
    turns = [*HELLO, {"role": "assistant", "content": "w"}, {"role": "system", "content": "s"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL_ID, messages=turns, max_tokens=4)
    assert "messages[1]" in _error(caught)["message"]


# ---- context_management ------------------------------------------------------------------------


def test_claude_codes_context_management_is_honoured(byte_claude):
    fields = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 24, "thinking": THINK}
    message = byte_claude.beta.messages.create(context_management=KEEP_ALL, betas=BETA, **fields)
    assert message.context_management.applied_edits == []
    plain = byte_claude.messages.create(**fields)
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == (
        plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)
    )
    assert not hasattr(plain, "context_management") or plain.context_management is None


def test_context_management_in_the_stream(thinking_server):
    body = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 24, "thinking": THINK}
    body |= {"stream": True, "context_management": KEEP_ALL}
    url = thinking_server.base_url + "/v1/messages"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    (delta,) = [event for event in events if event["type"] == "message_delta"]
    assert delta["context_management"] == {"applied_edits": []}


@pytest.mark.parametrize(
    ("context_management", "thinking", "param"),
    [
        ({"edits": [CLEAR_TOOL_USES]}, THINK, "edits[0].type: Value error, 'clear_tool_uses"),
        (KEEP_ALL, None, "edits[0].type"),  # clearing thinking needs thinking (Anthropic's rule)
        ({"edits": [{"type": "clear_thinking_20251015", "keep": 2}]}, THINK, "edits[0].keep"),
        ({"edits": [], "clear": True}, THINK, "context_management.clear"),
    ],
    ids=["clear-tool-uses", "thinking-off", "bad-keep", "unknown-field"],
)
def test_what_context_management_cannot_do_is_a_400(
    byte_claude, context_management, thinking, param
):
    fields = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 24, "betas": BETA}
    fields |= {"thinking": thinking} if thinking else {}
    with pytest.raises(anthropic.BadRequestError) as caught:
        byte_claude.beta.messages.create(context_management=context_management, **fields)
    assert param in _error(caught)["message"]


# ---- the pieces ------------------------------------------------------------------------------


def _tool_loop(keep) -> MessagesRequest:
    """Three assistant turns with thinking, each calling a tool whose result follows."""
    turns = [*HELLO]
    for step in range(3):
        call = {"type": "tool_use", "id": f"t{step}", "name": "f", "input": {}}
        thinking = {"type": "thinking", "thinking": f"step {step}", "signature": ""}
        result = {"type": "tool_result", "tool_use_id": f"t{step}", "content": "ok"}
        turns += [{"role": "assistant", "content": [thinking, call]}]
        turns += [{"role": "user", "content": [result]}]
    edits = {"edits": [{"type": "clear_thinking_20251015", **keep}]}
    body = {"model": "m", "max_tokens": 32, "messages": turns, "thinking": THINK}
    return MessagesRequest.model_validate({**body, "context_management": edits})


@pytest.mark.parametrize(
    ("keep", "kept"),
    [
        ({}, ["step 2"]),  # Anthropic's default: the last thinking turn
        ({"keep": {"type": "thinking_turns", "value": 2}}, ["step 1", "step 2"]),
        ({"keep": {"type": "thinking_turns", "value": 5}}, ["step 0", "step 1", "step 2"]),
        ({"keep": "all"}, ["step 0", "step 1", "step 2"]),
    ],
)
def test_clear_thinking_keeps_the_last_turns(keep, kept):
    messages = chat_messages(_tool_loop(keep))
    assistant = [m for m in messages if m["role"] == "assistant"]
    assert [m["reasoning_content"] for m in assistant if "reasoning_content" in m] == kept
    assert len(assistant) == 3 and all(m["tool_calls"] for m in assistant)  # calls stay


class _CharModel:
    """Renders the messages as JSON, one token a character: enough for chat_prompt."""

    def render_chat(self, messages, tools, kwargs, add_generation_prompt):
        return json.dumps(messages)

    def encode(self, text, add_special_tokens, param):
        return list(text)


def test_applied_edits_count_the_cleared_turns_and_tokens():
    from axon.server.routes.anthropic import _applied_edits

    body = _tool_loop({})
    full = len(json.dumps(chat_messages(body, clear_thinking=False)))
    kept = len(json.dumps(chat_messages(body)))
    (edit,) = _applied_edits(_CharModel(), body)["applied_edits"]
    assert edit == {
        "type": "clear_thinking_20251015",
        "cleared_thinking_turns": 2,
        "cleared_input_tokens": full - kept,
    }
    assert full > kept
    assert _applied_edits(_CharModel(), _tool_loop({"keep": "all"})) == {"applied_edits": []}
