"""Message normalisation for chat templates: the shapes vLLM's OpenAI server hands transformers'
`apply_chat_template` (content always present, parts joined, arguments parsed, reasoning passed),
and the real Qwen3 template rendering the agent loop's second step."""

from __future__ import annotations

import copy

import pytest

from axon.tokenizer.chat_template import ChatTemplateRefused, call_id_length, render_chat
from axon.tokenizer.messages import conversation_shapes, fixed_length_id, normalize_messages

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def _one(message: dict, fmt: str = "string") -> dict:
    return normalize_messages([message], fmt)[0]


@pytest.mark.parametrize("fmt", ["string", "openai"])
def test_null_or_missing_content_is_present(fmt):
    expected = ""  # the reference's [] for part-looping templates fails Devstral's
    assert _one({"role": "assistant", "content": None}, fmt)["content"] == expected
    assert _one({"role": "assistant", "tool_calls": [CALL]}, fmt)["content"] == expected
    assert _one({"role": "tool", "tool_call_id": "call_1"}, fmt)["content"] == ""


def test_text_parts_join_with_newlines_for_string_templates():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert _one({"role": "user", "content": parts})["content"] == "a\nb"
    image = {"type": "image_url", "image_url": {"url": "data:x"}}
    assert _one({"role": "user", "content": [image, *parts]})["content"] == "a\nb"


def test_parts_for_part_looping_templates():
    image = {"type": "image_url", "image_url": {"url": "data:x"}}
    text = {"type": "text", "text": "a"}
    content = _one({"role": "user", "content": [text, image]}, "openai")["content"]
    assert content == [{"type": "text", "text": "a"}, {"type": "image", "url": "data:x"}]
    assert _one({"role": "user", "content": "plain"}, "openai")["content"] == "plain"


@pytest.mark.parametrize("fmt", ["string", "openai"])
def test_tool_results_with_text_parts_become_a_string(fmt):
    parts = [{"type": "text", "text": "21"}, {"type": "text", "text": "C"}]
    message = {"role": "tool", "tool_call_id": "call_1", "content": parts}
    assert _one(message, fmt)["content"] == "21\nC"
    assert _one({**message, "content": "21"}, fmt)["content"] == "21"


def test_arguments_parsed_like_the_reference():
    def args(arguments):
        call = {**CALL, "function": {"name": "f", "arguments": arguments}}
        message = _one({"role": "assistant", "content": None, "tool_calls": [call]})
        return message["tool_calls"][0]["function"]["arguments"]

    assert args('{"city": "Paris", "n": [1, 2]}') == {"city": "Paris", "n": [1, 2]}
    assert args({"city": "Paris"}) == {"city": "Paris"}
    assert args("not json") == {}
    assert args("") == {}
    assert args(None) == {}


def test_empty_tool_calls_dropped_and_input_untouched():
    messages = [{"role": "assistant", "content": "hi", "tool_calls": []}]
    assert "tool_calls" not in normalize_messages(messages)[0]
    calls = [{"role": "assistant", "content": None, "tool_calls": [CALL]}]
    before = copy.deepcopy(calls)
    normalize_messages(calls)
    assert calls == before


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_passed_under_both_names(field):
    message = _one({"role": "assistant", "content": "4", field: "2+2"})
    assert message["reasoning"] == message["reasoning_content"] == "2+2"
    assert "reasoning" not in _one({"role": "user", "content": "q"})


def test_extras_pass_through():
    message = {"role": "tool", "content": "x", "tool_call_id": "call_1", "name": "get_weather"}
    assert _one(message) == message


def test_shapes_named():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "system", "content": "s"},
        {"role": "assistant", "tool_calls": [CALL, CALL], "reasoning_content": "r"},
        {"role": "tool", "content": "x"},
    ]
    assert conversation_shapes(messages, [{"type": "function"}]) == [
        "a system message after the first turn",
        "content parts",
        "assistant tool_calls (several in one turn)",
        "tool results",
        "reasoning of an earlier turn",
        "tools",
    ]


def test_qwen3_tool_loop_second_step_renders(template_dir, qwen3_tokenizer):
    """The agent loop's second step on Qwen3's real template: the assistant turn that called a
    tool carries `content: null` (it failed with "'dict object' has no attribute 'content'")."""
    template = (template_dir / "Qwen-Qwen3-0.6B.jinja").read_text()
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [CALL], "reasoning_content": "Use the tool."},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "21C"}]},
    ]
    text = render_chat(qwen3_tokenizer, messages, chat_template=template)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n21C\n</tool_response>" in text
    reference = qwen3_tokenizer.apply_chat_template(
        normalize_messages(messages),
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == reference


def test_template_refusal_names_the_shapes(qwen3_tokenizer):
    template = "{{ raise_exception('no tools here') if messages[1].tool_calls }}"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [CALL]}]
    with pytest.raises(ChatTemplateRefused) as info:
        render_chat(qwen3_tokenizer, messages, chat_template=template)
    assert "(assistant tool_calls): no tools here" in info.value.message


def test_fixed_length_ids_are_alphanumeric_stable_and_kept_when_already_so():
    mapped = fixed_length_id("call_1", 9)
    assert len(mapped) == 9 and mapped.isalnum()
    assert fixed_length_id("call_1", 9) == mapped != fixed_length_id("call_2", 9)
    assert fixed_length_id("abcDEF123", 9) == "abcDEF123"
    assert fixed_length_id("abc_EF123", 9) != "abc_EF123"


MISTRAL_TEMPLATES = ["Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Mistral-Nemo-Instruct-2407"]


@pytest.mark.parametrize("name", MISTRAL_TEMPLATES)
def test_mistral_templates_get_nine_character_call_ids(template_dir, qwen3_tokenizer, name):
    """Mistral's templates raise on any tool call id but 9 alphanumeric characters: a client's
    `call_...` ids are mapped, the call and its result alike, and nothing else changes."""
    template = (template_dir / f"{name}.jinja").read_text()
    assert call_id_length(template) == 9
    second = {**CALL, "id": "call_2"}
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, second]},
        {"role": "tool", "tool_call_id": "call_2", "content": "22C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    ]
    sent = copy.deepcopy(messages)
    text = render_chat(qwen3_tokenizer, messages, chat_template=template)
    assert messages == sent
    one, two = fixed_length_id("call_1", 9), fixed_length_id("call_2", 9)
    assert "call_1" not in text and "call_2" not in text
    calls, *results = text.split("[TOOL_RESULTS]")
    assert calls.index(one) < calls.index(two)
    assert [(two in r, "22C" in r, one in r, "21C" in r) for r in results] == [
        (True, True, False, False),
        (False, False, True, True),
    ]
    assert call_id_length((template_dir / "Qwen-Qwen3-0.6B.jinja").read_text()) is None
