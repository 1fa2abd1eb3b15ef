"""`continue_final_message`: the prompt ends right after the final assistant message's content,
its turn left open, exactly as transformers' `apply_chat_template(continue_final_message=True)`
cuts it, for every template of llama.cpp's corpus; where transformers cannot (a template that
rewrites the message), axon refuses too. And vLLM's request rules around it (a 400 naming it)."""

from __future__ import annotations

import json

import pytest

from axon.server.errors import BadRequest, Unprocessable
from axon.server.schemas.protocol import ChatCompletionRequest, parse_request
from axon.tokenizer.chat_template import content_format, select_template
from axon.tokenizer.messages import normalize_messages

from .test_template_matrix import _case_ids, _served, templates, word_tokenizer  # noqa: F401

PARTIAL = "The weather in Paris is"
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": PARTIAL},
]
# Templates that write the final assistant turn other than as sent: transformers cannot find
# its text to cut after, and axon answers a 400.
CANNOT_CONTINUE: set[str] = set()
# Templates that fail on these plain turns already (see test_template_matrix's BROKEN).
BROKEN = {
    "CohereForAI-c4ai-command-r-plus-tool_use",
    "fireworks-ai-llama-3-firefunction-v2",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
}
OPEN_TURN = {  # what follows the partial text with the generation prompt instead
    "Qwen-Qwen3-0.6B": "<|im_end|>",
    "meta-llama-Llama-3.1-8B-Instruct": "<|eot_id|>",
    "google-gemma-4-31B-it": "<turn|>",
}


def _request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": MESSAGES, **fields}
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


def outcome_axon(template: str) -> tuple[str, str]:
    request = _request(continue_final_message=True)
    dicts = [message.template_dict() for message in request.messages]
    model = _served(word_tokenizer(), template)
    try:
        text = model.render_chat(
            dicts, None, None, request.generation_prompt(), continue_final_message=True
        )
    except BadRequest as exc:
        return "refused", exc.message
    except Unprocessable as exc:
        return "failed", exc.message
    return "ok", text


def outcome_reference(template: str) -> tuple[str, str]:
    fmt = content_format(select_template(template, None))
    try:
        text = word_tokenizer().apply_chat_template(
            normalize_messages(MESSAGES, fmt),
            chat_template=template,
            tokenize=False,
            add_generation_prompt=False,
            continue_final_message=True,
        )
    except ValueError as exc:
        return "refused", str(exc)
    except Exception as exc:  # noqa: BLE001 - any other failure is the template's
        return "failed", f"{type(exc).__name__}: {exc}"
    return "ok", text


@pytest.mark.parametrize("name", _case_ids())
def test_the_final_turn_is_left_open_as_transformers_leaves_it(templates, name):  # noqa: F811
    ours, reference = outcome_axon(templates[name]), outcome_reference(templates[name])
    expected = "failed" if name in BROKEN else "ok"
    expected = "refused" if name in CANNOT_CONTINUE else expected
    assert (reference[0], ours[0]) == (expected, expected), (reference[1], ours[1])
    if expected == "ok":
        assert ours[1] == reference[1]
        assert ours[1].endswith(PARTIAL)
    elif expected == "refused":
        assert "continue_final_message" in ours[1]


@pytest.mark.parametrize("name", sorted(OPEN_TURN))
def test_real_templates_leave_the_turn_open(templates, name):  # noqa: F811
    model = _served(word_tokenizer(), templates[name])
    dicts = [dict(message) for message in MESSAGES]
    closed = model.render_chat(dicts, None, None, False)
    opened = model.render_chat(dicts, None, None, False, continue_final_message=True)
    assert closed.startswith(opened) and opened.endswith(PARTIAL)
    assert closed[len(opened) :].startswith(OPEN_TURN[name])


@pytest.mark.parametrize(
    "fields, messages",
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, MESSAGES),
        ({"continue_final_message": True, "add_generation_prompt": False}, MESSAGES[:1]),
        ({"continue_final_message": True}, MESSAGES[:1]),
    ],
)
def test_vllm_rules_are_a_400_naming_the_field(fields, messages):
    body = {"model": "m", "messages": messages, **fields}
    with pytest.raises(BadRequest) as caught:
        parse_request(json.dumps(body).encode(), ChatCompletionRequest)
    assert caught.value.param == "continue_final_message"


def test_generation_prompt_is_off_while_continuing():
    assert _request(continue_final_message=True).generation_prompt() is False
    assert (
        _request(continue_final_message=True, add_generation_prompt=False).generation_prompt()
        is False
    )
    assert _request().generation_prompt() is True
    assert _request(add_generation_prompt=False).generation_prompt() is False


def test_a_template_that_rewrites_the_final_message_is_a_400():
    upper = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    model = _served(word_tokenizer(), upper)
    with pytest.raises(BadRequest) as caught:
        model.render_chat(
            [dict(m) for m in MESSAGES], None, None, False, continue_final_message=True
        )
    assert "continue_final_message" in caught.value.message
