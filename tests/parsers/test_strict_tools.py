"""`tools[].function.strict: true` under tool_choice "auto": the answer stays free, and once the
model starts a call the grammar holds a strict tool's arguments to its schema (OpenAI's
meaning of strict; the OpenAI Agents SDK sends it on every tool). Non-strict tools beside them
are called with any arguments. (A `response_format` keeps its own grammar, which allows no call.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.parsers.test_structured_output import (
    HERMES,
    MESSAGES,
    NO_THINKING,
    TOOLS,
    WEATHER,
    XML,
    accepts,
    ll_tokenizer,  # noqa: F401 - the fixture
)

from .conftest import MODEL_ID, byte_tokenizer


def _auto(fmt: str = "hermes", **extra) -> dict:
    spec = {"type": "tool_call", "format": fmt, "tools": TOOLS, "optional": True}
    return {**spec, "free_tools": [], **extra}


BAD_HERMES = HERMES.replace('"Rome"', '"Oslo"')
OTHER = '<tool_call>\n{"name": "search", "arguments": {"q": 1}}\n</tool_call>'


@pytest.mark.parametrize(
    ("spec", "text", "ok"),
    [
        (_auto(), "Just text,\nno call.", True),
        (_auto(), "", True),
        (_auto(), HERMES, True),
        (_auto(), f"Let me look.\n\n{HERMES}", True),
        (_auto(), BAD_HERMES, False),
        (_auto(), f"{HERMES}\n{HERMES}", False),
        (_auto(parallel=True), f"{HERMES}\n{HERMES}", True),
        (_auto(), OTHER, False),
        (_auto(free_tools=["search"]), OTHER, True),
        (_auto(free_tools=["search"]), BAD_HERMES, False),
        (_auto("qwen3_coder"), f"Text first.\n{XML}", True),
        (_auto("qwen3_coder"), XML.replace("\nRome\n", "\nOslo\n"), False),
        (_auto("qwen3_coder", free_tools=["search"]), "<tool_call>\n<function=search>\nq", False),
        (
            _auto("qwen3_coder", free_tools=["search"]),
            "<tool_call>\n<function=search>\n<parameter=q>\nanything\n</parameter>\n"
            "</function>\n</tool_call>",
            True,
        ),
        (_auto(thinking="optional"), f"<think>\nhm\n</think>\n\n{HERMES}", True),
    ],
)
def test_auto_grammar_accepts(ll_tokenizer, spec, text, ok):  # noqa: F811
    assert accepts(ll_tokenizer, spec, text) is ok


# Closed, as strict schemas are (random weights would write extra properties forever).
CLOSED = {**WEATHER["function"]["parameters"], "additionalProperties": False}
STRICT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": CLOSED, "strict": True},
}


def test_a_started_call_keeps_a_strict_tools_schema(byte_client):
    """The call marker pushed by logit_bias makes the random model start a call at once: the
    strict tool's arguments then validate, though tool_choice left the model free."""
    marker = byte_tokenizer().convert_tokens_to_ids("<tool_call>")
    for seed in (1, 2, 3):
        reply = byte_client.chat.completions.create(
            model=MODEL_ID,
            messages=MESSAGES,
            tools=[STRICT_WEATHER],
            tool_choice="auto",
            parallel_tool_calls=False,
            logit_bias={str(marker): 100},
            max_tokens=300,
            seed=seed,
            extra_body=NO_THINKING,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), CLOSED)


def test_strict_must_be_a_boolean(byte_client):
    from openai import BadRequestError

    tool = {"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}
    with pytest.raises(BadRequestError) as refused:
        byte_client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, tools=[tool], max_tokens=4
        )
    assert refused.value.response.json()["error"]["param"] == "tools[0].function.strict"
