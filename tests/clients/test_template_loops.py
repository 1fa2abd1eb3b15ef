"""The `openai` client's two-step tool loop on tiny models carrying other real chat templates
from llama.cpp's corpus (Llama 3.1 to 3.3, Qwen3.5's XML calls, Gemma 4; the corpus has no
Gemma 3): the forced call, then the assistant's `tool_calls` turn (content null) and the tool's
result, rendered by that template.

One server for the module, a model per template (an engine process each, seconds to start),
hence slow."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.clients.conftest import CITY_SCHEMA, RESULT
from tests.parsers.conftest import byte_model_with_corpus_template
from tests.server.conftest import start_multi_server, stop_server

pytestmark = pytest.mark.slow

DAYS_SCHEMA = {
    "type": "object",
    "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["days"],
    "additionalProperties": False,
}
CASES = (
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", CITY_SCHEMA),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", CITY_SCHEMA),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", CITY_SCHEMA),
    ("google-gemma-4-31B-it.jinja", CITY_SCHEMA),
    ("Qwen3.5-4B.jinja", DAYS_SCHEMA),
    # A string enum in Qwen3.5's XML calls: the bare member, as the model writes it (the grammar
    # had written it JSON-quoted, and the parser keeps a string parameter's text as written).
    pytest.param(("Qwen3.5-4B.jinja", CITY_SCHEMA), id="Qwen3.5-enum"),
)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def template_server(tmp_path_factory: pytest.TempPathFactory):
    """The byte-level tiny Qwen3 once per template of CASES, served under the template's name."""
    root = tmp_path_factory.mktemp("tiny_template_loop")
    cases = [case.values[0] if hasattr(case, "values") else case for case in CASES]
    names = sorted({_name(template) for template, _ in cases})
    models = {name: byte_model_with_corpus_template(root / name, f"{name}.jinja") for name in names}
    running = start_multi_server(models)
    yield running
    stop_server(running)


def _name(template: str) -> str:
    return template.removesuffix(".jinja")


@pytest.fixture(params=CASES, ids=lambda case: _name(case[0]))
def template_case(request, template_server):
    """(server, served model, tool) of one case."""
    template, schema = request.param
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    return template_server, _name(template), tool


def test_openai_tool_loop_on_template(template_case):
    from openai import OpenAI

    server, model, weather = template_case
    url = server.openai_url
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as client:
        first = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[weather],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
            max_tokens=300,
            seed=7,
            extra_body=NO_THINKING,
        )
        message = first.choices[0].message
        (call,) = message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
        messages.append(message.model_dump(exclude_unset=True, exclude_none=False))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": RESULT})
        second = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[weather],
            max_tokens=8,
            seed=7,
            extra_body=NO_THINKING,
        )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    body = {"model": model, "messages": messages, "tools": [weather], **NO_THINKING}
    tokens = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["count"] == second.usage.prompt_tokens
    text = httpx.post(
        server.base_url + "/detokenize", json={"model": model, "tokens": tokens.json()["tokens"]}
    )
    assert RESULT in text.json()["prompt"]
