"""Ollama's options, keep_alive, format, think and messages -> the chat request axon runs."""

from __future__ import annotations

import pytest

from axon.server.errors import BadRequest
from axon.server.schemas.ollama import ChatRequest, Message, chat_message, to_chat_request
from axon.server.schemas.ollama_options import (
    keep_alive_seconds,
    response_format,
    sampling_fields,
    unload_after,
)


def test_honoured_options_map_to_the_chat_fields():
    fields, num_ctx = sampling_fields(
        {
            "temperature": 0.2,
            "top_k": 40,
            "top_p": 0.9,
            "min_p": 0.05,
            "repeat_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "stop": ["\n"],
            "seed": 3,
            "num_predict": 7,
            "num_ctx": 64,
        }
    )
    assert fields == {
        "temperature": 0.2,
        "top_k": 40,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "stop": ["\n"],
        "seed": 3,
        "max_tokens": 7,
    }
    assert num_ctx == 64
    # Ollama's "no limit", "fill the context" and "random seed" leave the fields unset.
    assert sampling_fields({"num_predict": -1, "seed": -1}) == ({}, None)
    assert sampling_fields({"num_predict": -2, "temperature": None}) == ({}, None)


@pytest.mark.parametrize(
    "neutral",
    [
        {"mirostat": 0},
        {"typical_p": 1.0},
        {"tfs_z": 1},
        {"repeat_last_n": -1},
        {"penalize_newline": False},
    ],
)
def test_options_at_the_value_that_changes_nothing_are_accepted(neutral):
    assert sampling_fields(neutral) == ({}, None)


@pytest.mark.parametrize(
    "option",
    [
        {"mirostat": 1},
        {"mirostat": False},
        {"typical_p": 0.9},
        {"repeat_last_n": 64},
        {"penalize_newline": True},
        {"mirostat_tau": 5.0},
        {"num_keep": 4},
        {"num_gpu": 1},
        {"use_mmap": True},
        {"num_thread": 8},
        {"nonsense": 1},
        {"num_predict": 0},
        {"num_ctx": 0},
    ],
)
def test_options_axon_cannot_honour_are_a_400_naming_them(option):
    (name,) = option
    with pytest.raises(BadRequest) as refused:
        sampling_fields(option)
    assert refused.value.param == f"options.{name}"
    assert f"options.{name}" in refused.value.message


def test_a_wrong_type_names_the_option():
    body = ChatRequest(model="m", options={"repeat_penalty": "high"})
    with pytest.raises(BadRequest) as refused:
        to_chat_request(body, [{"role": "user", "content": "hi"}])
    assert refused.value.param == "options.repeat_penalty"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (-1, -1.0),
        ("-1", -1.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("0s", 0.0),
        ("-1m", -60.0),
        (1.5, 1.5),
        ("250ms", 0.25),
    ],
)
def test_keep_alive_durations(value, seconds):
    assert keep_alive_seconds(value) == seconds


def test_keep_alive_zero_unloads_negative_keeps_positive_is_refused():
    assert unload_after(0) and unload_after("0") and unload_after("0s")
    assert not unload_after(None) and not unload_after(-1) and not unload_after("-1m")
    for value in ("5m", 300, "forever", True):
        with pytest.raises(BadRequest) as refused:
            unload_after(value)
        assert refused.value.param == "keep_alive"


def test_format_and_think():
    assert response_format("json") == {"type": "json_object"}
    assert response_format("") is None and response_format(None) is None
    schema = {"type": "object"}
    assert response_format(schema)["json_schema"]["schema"] == schema
    with pytest.raises(BadRequest):
        response_format("yaml")
    body = ChatRequest(model="m", think="high", format="json")
    chat, _ = to_chat_request(body, [{"role": "user", "content": "hi"}])
    assert chat.reasoning_effort == "high" and chat.response_format == {"type": "json_object"}
    off, _ = to_chat_request(ChatRequest(model="m", think=False), [{"role": "user", "content": ""}])
    assert off.chat_template_kwargs == {"enable_thinking": False}


def test_messages_translate_to_chat_messages():
    assistant = Message(
        role="assistant",
        content="",
        thinking="hmm",
        tool_calls=[{"function": {"name": "f", "arguments": {"x": 1}}}],
    )
    assert chat_message(assistant) == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hmm",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        ],
    }
    assert chat_message(Message(role="assistant", content=None))["content"] == ""
    tool = chat_message(Message(role="tool", content="ok", tool_name="f"))
    assert tool == {"role": "tool", "content": "ok", "name": "f"}
    user = chat_message(Message(role="user", content="see", images=["iVBORw0KGgo="]))
    assert user["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:;base64,iVBORw0KGgo="},
    }


def test_every_field_the_ollama_client_sends_is_decided():
    """The installed client's request fields: each one declared by axon's schema (honoured or
    refused by its own check), or refused as unknown (image generation's); each option honoured,
    neutral or refused by name, none "unknown" to axon. A client upgrade that adds one fails
    here until it is decided."""
    types = pytest.importorskip("ollama._types")
    from axon.server.schemas import ollama as schemas
    from axon.server.schemas.ollama_options import _check_option

    image_generation = {"width", "height", "steps"}
    pairs = [
        (types.ChatRequest, schemas.ChatRequest),
        (types.GenerateRequest, schemas.GenerateRequest),
        (types.EmbedRequest, schemas.EmbedRequest),
        (types.EmbeddingsRequest, schemas.EmbeddingsRequest),
        (types.ShowRequest, schemas.ShowRequest),
        (types.PullRequest, schemas.PullRequest),
    ]
    for client_type, ours in pairs:
        undecided = set(client_type.model_fields) - set(ours.model_fields) - image_generation
        assert not undecided, (client_type.__name__, undecided)
    for name in types.Options.model_fields:
        try:
            _check_option(name, None)
        except BadRequest as refused:
            assert "not an option axon knows" not in refused.message, name
