"""Every chat template in llama.cpp's corpus x the message shapes real clients send.

For each pair, axon's prompt (the request parsed as the chat route parses it, then rendered)
equals transformers' `apply_chat_template` of the same messages normalised as vLLM's OpenAI
server hands them (`normalize_messages`), or both refuse. Never a 422 where the reference renders;
where the template itself refuses a shape (its `raise_exception`), axon answers a 400 naming the
shape: those pairs are listed in REFUSED, so a change in either direction shows here. Render only,
no model: the whole matrix takes a few seconds.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jinja2
import pytest

from axon.server.errors import BadRequest, Unprocessable
from axon.server.lifecycle.served_model import ServedModel
from axon.server.schemas.protocol import ChatCompletionRequest, parse_request
from axon.tokenizer.chat_template import call_id_length, content_format, select_template
from axon.tokenizer.messages import normalize_messages
from llama_cpp_sdist import extract_llama_cpp

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def _call(number: int, arguments: str = '{"city": "Paris", "days": 2}') -> dict:
    function = {"name": "get_weather", "arguments": arguments}
    return {"id": f"call_{number}", "type": "function", "function": function}


def _result(number: int, content) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{number}", "content": content}


SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "Weather in Paris?"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
LIST_RESULT = [{"type": "text", "text": '{"temp": 21}'}, {"type": "text", "text": "sunny"}]
SHAPES = {  # name -> (messages as a client sends them, tools)
    "system_first": ([SYSTEM, {"role": "user", "content": "Hi"}], None),
    "content_parts": (
        [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "a"}] * 2}],
        None,
    ),
    "tool_call_content_null": (
        [ASK, {"role": "assistant", "content": None, "tool_calls": [_call(1)]}, _result(1, "21")],
        TOOLS,
    ),
    "several_tool_calls": (
        [
            ASK,
            {"role": "assistant", "content": None, "tool_calls": [_call(1), _call(2)]},
            _result(1, "21"),
            _result(2, "22"),
        ],
        TOOLS,
    ),
    "tool_result_parts": (
        [ASK, {"role": "assistant", "content": None, "tool_calls": [_call(1)]}],
        TOOLS,
    ),
    "arguments_not_json": (
        [ASK, {"role": "assistant", "content": "", "tool_calls": [_call(1, "{oops")]}],
        TOOLS,
    ),
    "earlier_reasoning": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
            {"role": "user", "content": "And 3+3?"},
        ],
        None,
    ),
    "tools_given": ([SYSTEM, ASK], TOOLS),
    # Part-looping templates render the image themselves; the others get the text alone (the
    # chat route refuses images for a model without a vision tower before rendering).
    "image_parts": (
        [{"role": "user", "content": [{"type": "text", "text": "What?"}, IMAGE]}],
        None,
    ),
}
SHAPES["tool_result_parts"][0].append(_result(1, LIST_RESULT))
SHAPES["arguments_not_json"][0].append(_result(1, "error"))

TOOL_TURNS = {"tool_call_content_null", "several_tool_calls", "tool_result_parts"}
TOOL_TURNS |= {"arguments_not_json"}
# The shapes each template refuses itself (its raise_exception): axon answers a 400 naming them.
# (Mistral's templates take only 9-character alphanumeric tool call ids: normalize_messages maps
# the clients' ids to such ones, as vLLM does, so they render every tool turn.)
REFUSED: dict[str, set[str]] = {
    "google-gemma-2-2b-it": {"system_first", "content_parts", "tools_given", *TOOL_TURNS},
    "meta-llama-Llama-3.1-8B-Instruct": {"several_tool_calls"},
    "meta-llama-Llama-3.2-3B-Instruct": {"several_tool_calls"},
    "meta-llama-Llama-3.3-70B-Instruct": {"several_tool_calls"},
    "Spark2.5": {"image_parts"},  # a text-only model: text blocks only
}
# Shapes a template fails on by a bug of its own under transformers' Jinja (vLLM fails alike):
# a 422 with the template's error, in both.
ALL = set(SHAPES)
BROKEN: dict[str, set[str]] = {
    # Tool-use-only templates: they iterate `tools` unconditionally.
    "CohereForAI-c4ai-command-r-plus-tool_use": ALL,  # and want flat tools (tool.description)
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": {
        "system_first",
        "content_parts",
        "earlier_reasoning",
        "image_parts",
    },
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": {
        "system_first",
        "content_parts",
        "earlier_reasoning",
        "image_parts",
    },
    "fireworks-ai-llama-3-firefunction-v2": ALL,  # reads a `functions` variable
    "Kimi-K2-Instruct": TOOL_TURNS,  # list.append: refused by transformers' sandbox
    "Kimi-K2-Thinking": TOOL_TURNS,
    "llama-cpp-deepseek-r1": TOOL_TURNS | {"tools_given"},  # tojson of a generator (minja only)
}
# Templates that concatenate a call's arguments as a string: they fail on the parsed mapping
# the reference gives them, and axon renders them with the client's string instead.
STRING_ARGUMENTS = {"meetkai-functionary-medium-v3.2"}
# Pairs axon renders where vLLM's messages fail: the string arguments above, and Devstral's
# `content[0]['text']` of an assistant turn whose content is null (vLLM gives it []).
BEYOND_VLLM = {name: TOOL_TURNS for name in STRING_ARGUMENTS}
BEYOND_VLLM["unsloth-mistral-Devstral-Small-2507"] = {
    "tool_call_content_null",
    "several_tool_calls",
    "tool_result_parts",
}


@functools.cache
def word_tokenizer():
    """A tokenizer that knows only its specials: rendering reads no more of it than those."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _served(tokenizer, template: str) -> ServedModel:
    model = ServedModel.__new__(ServedModel)  # the render path only: no engine behind it
    model.id, model.tokenizer, model.chat_template = "m", tokenizer, template
    return model


def outcome_axon(tokenizer, template: str, shape: str) -> tuple[str, str]:
    """("ok", prompt), ("refused", message) for a 400, ("failed", message) for a 422."""
    messages, tools = SHAPES[shape]
    body = {"model": "m", "messages": messages, "tools": tools}
    request = parse_request(json.dumps(body).encode(), ChatCompletionRequest)
    dicts = [message.template_dict() for message in request.messages]
    try:
        return "ok", _served(tokenizer, template).render_chat(dicts, request.tools)
    except BadRequest as exc:
        return "refused", exc.message
    except Unprocessable as exc:
        return "failed", exc.message


def outcome_reference(
    tokenizer, template: str, shape: str, string_arguments: bool = False
) -> tuple[str, str]:
    """The same for transformers on the normalised messages (vLLM's OpenAI server), the
    arguments left as strings with `string_arguments`: ("ok", prompt), ("refused", the
    template's raise_exception message), ("failed", its error)."""
    messages, tools = SHAPES[shape]
    fmt = content_format(select_template(template, tools))
    parse = not (string_arguments and shape in TOOL_TURNS)
    ids = call_id_length(template)
    try:
        text = tokenizer.apply_chat_template(
            normalize_messages(messages, fmt, parse_arguments=parse, call_id_length=ids),
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
        )
    except jinja2.TemplateError as exc:
        return ("refused" if type(exc) is jinja2.TemplateError else "failed"), str(exc)
    except Exception as exc:  # noqa: BLE001 - any other failure is the template's
        return "failed", f"{type(exc).__name__}: {exc}"
    return "ok", text


def _as_vllm_gives_them(messages: list[dict], fmt: str, template: str) -> list[dict]:
    """normalize_messages, except where axon departs from vLLM on purpose: null content is []
    (not "") for part-looping templates, tool messages aside."""
    normalized = normalize_messages(messages, fmt, call_id_length=call_id_length(template))
    for sent, message in zip(messages, normalized, strict=True):
        if fmt == "openai" and sent.get("content") is None and sent["role"] != "tool":
            message["content"] = []
    return normalized


def vllm_renders(tokenizer, template: str, shape: str) -> bool:
    messages, tools = SHAPES[shape]
    fmt = content_format(select_template(template, tools))
    try:
        tokenizer.apply_chat_template(
            _as_vllm_gives_them(messages, fmt, template),
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:  # noqa: BLE001 - whatever the failure, it is not a render
        return False
    return True


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    directory = extract_llama_cpp(
        "models/templates/", lambda rest: rest.endswith(".jinja"), suffix="-templates"
    )
    return {path.stem: path.read_text() for path in sorted(Path(directory).glob("*.jinja"))}


def _case_ids():
    directory = extract_llama_cpp(
        "models/templates/", lambda rest: rest.endswith(".jinja"), suffix="-templates"
    )
    return sorted(path.stem for path in Path(directory).glob("*.jinja"))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", _case_ids())
def test_axon_renders_what_transformers_renders(templates, name, shape):
    tokenizer = word_tokenizer()
    template = templates[name]
    ours = outcome_axon(tokenizer, template, shape)
    reference = outcome_reference(tokenizer, template, shape, name in STRING_ARGUMENTS)
    expected = "refused" if shape in REFUSED.get(name, ()) else "ok"
    expected = "failed" if shape in BROKEN.get(name, ()) else expected
    assert reference[0] == expected, reference[1]
    assert ours[0] == expected, ours[1]
    if expected == "ok":
        assert ours[1] == reference[1]
    else:
        assert reference[1] in ours[1]
    if expected == "refused":
        assert "cannot render this conversation (" in ours[1]
    # Never a 422 (nor a 400) where vLLM renders; where it fails, axon's extra renders are listed.
    beyond = shape in BEYOND_VLLM.get(name, ())
    assert vllm_renders(tokenizer, template, shape) is (expected == "ok" and not beyond)
