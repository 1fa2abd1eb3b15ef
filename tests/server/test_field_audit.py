"""Every request field of the OpenAI chat / completions / responses, vLLM-extension and Anthropic
messages schemas that a client can send is honoured (an observable effect) or refused with a 400
naming it, never accepted and dropped.

The field lists come from the installed official clients' request types, so a client upgrade
that adds a field fails `test_every_client_field_is_classified` until the field is decided.
Honoured fields are checked end to end where one or two tokens show the effect (a word-level
tiny model: token 50 is the word `w50`, decoded with a leading space), through the built
SamplingParams where the sampler's own tests cover the effect, or by the test named in
HONOURED_ELSEWHERE.
"""

from __future__ import annotations

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from axon.server.sampling import build_sampling_params
from axon.server.schemas import unsupported
from axon.server.schemas.anthropic_protocol import MessagesRequest
from axon.server.schemas.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from axon.server.schemas.responses import ResponsesRequest

from .conftest import MODEL_ID

MESSAGES = [{"role": "user", "content": "hello"}]
FORCE_W50 = {"50": 100}  # logit_bias that makes every sampled token `w50`
EOS_ID, IM_START_ID = 2, 1

# Taken, no effect by design (unsupported.py's docstring says why).
NO_EFFECT = unsupported.NO_EFFECT
# Honoured, its effect tested elsewhere.
HONOURED_ELSEWHERE = {
    "tools": "tests/parsers/test_structured_output.py::test_forced_tool_call",
    "tool_choice": "tests/parsers/test_structured_output.py::test_forced_tool_call",
    "parallel_tool_calls": "tests/parsers/test_structured_output.py",
    "response_format": "tests/parsers/test_structured_output.py::test_response_format_json_schema",
    "text": "tests/parsers/test_responses_text_format.py",
    "chat_template_kwargs": "tests/parsers/test_structured_output.py (enable_thinking)",
    "add_special_tokens": "tests/server/test_openai_api.py (token-id and text prompts)",
    "input": "tests/server/test_openai_api.py::test_responses_input_items",
    "previous_response_id": "a 400 chained_conversation_not_supported (test_openai_api.py)",
    "echo": "tests/server/test_prompt_logprobs.py",
    "suffix": "a 400 naming it (openai_completions.py)",
    "prompt_logprobs": "tests/server/test_prompt_logprobs.py (a 400 on /v1/responses)",
    "best_of": "equal to n, else a 400 naming it",
    "thinking_token_budget": "tests/parsers/test_reasoning_budget.py",
    "reasoning_effort": "tests/parsers/test_reasoning_budget.py",
    "reasoning": "tests/parsers/test_reasoning_budget.py (reasoning.effort)",
}
VLLM_FIELDS = set(unsupported._VLLM_COMMON) | {
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "prompt_logprobs",
}
ROUTES = {
    "chat": (
        ChatCompletionRequest,
        unsupported.CHAT,
        {*chat_create_params.CompletionCreateParamsBase.__annotations__, "stream"},
        {
            "continue_final_message",
            "add_generation_prompt",
            "echo",
            "documents",
            "chat_template_kwargs",
        },
    ),
    "completions": (
        CompletionRequest,
        unsupported.COMPLETIONS,
        {*completion_create_params.CompletionCreateParamsBase.__annotations__, "stream"},
        {"add_special_tokens", "response_format"},
    ),
    "responses": (
        ResponsesRequest,
        unsupported.RESPONSES,
        {*response_create_params.ResponseCreateParamsBase.__annotations__, "stream"},
        set(),
    ),
}
PATHS = {"chat": "/chat/completions", "completions": "/completions", "responses": "/responses"}


def minimal(route: str, **fields) -> dict:
    body = {"model": MODEL_ID}
    if route == "chat":
        body.update(messages=MESSAGES, max_tokens=1)
    elif route == "completions":
        body.update(prompt="hello", max_tokens=1)
    else:
        body.update(input="hello", max_output_tokens=1)
    return {**body, **fields}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.openai_url, timeout=60) as client:
        yield client


def post(http, route: str, **fields) -> httpx.Response:
    return http.post(PATHS[route], json=minimal(route, **fields))


# ---- every field is classified --------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_every_client_field_is_classified(route):
    schema, refused, client_fields, vllm_extras = ROUTES[route]
    sent = client_fields | VLLM_FIELDS | vllm_extras
    unclassified = sent - set(schema.model_fields) - set(refused) - NO_EFFECT
    assert not unclassified, f"{route}: decide honoured or refused for {sorted(unclassified)}"


def test_every_anthropic_field_is_declared_or_refused(http):
    from anthropic.types import message_create_params  # lazy: a 1.5 s import for one test

    for name in message_create_params.MessageCreateParamsBase.__annotations__:
        if name in MessagesRequest.model_fields:
            continue
        body = {"model": MODEL_ID, "max_tokens": 1, "messages": MESSAGES, name: {"x": 1}}
        reply = http.post("/messages", json=body)
        assert reply.status_code == 400, (name, reply.text)
        assert name in reply.json()["error"]["message"]


# ---- refused fields ---------------------------------------------------------------------------


def _refused_cases():
    for route, (schema, refused, _, _) in ROUTES.items():
        for name in sorted(refused):
            if name not in schema.model_fields:
                yield route, name


@pytest.mark.parametrize(("route", "name"), list(_refused_cases()))
def test_refused_field_is_a_400_naming_it(http, route, name):
    reply = post(http, route, **{name: {"unsupported": True}})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == name and name in error["message"]


@pytest.mark.parametrize(
    ("route", "fields"),
    [
        ("chat", {"store": False, "service_tier": "auto", "modalities": ["text"]}),
        ("chat", {"verbosity": "medium", "metadata": {}, "use_beam_search": False}),
        ("chat", {"user": "u1", "safety_identifier": "s", "prompt_cache_key": "k"}),
        ("chat", {"prompt_cache_retention": "in_memory", "priority": 0}),
        ("completions", {"length_penalty": 1.0, "spaces_between_special_tokens": True}),
        ("responses", {"store": False, "truncation": "disabled", "include": []}),
        ("responses", {"background": False, "user": "u1", "service_tier": "default"}),
    ],
)
def test_values_that_ask_for_what_axon_does_pass(http, route, fields):
    assert post(http, route, **fields).status_code == 200


# ---- honoured fields, end to end ------------------------------------------------------------


def chat_text(http, **fields) -> tuple[str, dict]:
    reply = post(http, "chat", **fields)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["choices"][0]["message"]["content"], body


def test_logit_bias_max_tokens_n_and_logprobs(http):
    text, body = chat_text(
        http, logit_bias=FORCE_W50, max_tokens=2, n=2, logprobs=True, top_logprobs=2
    )
    assert [c["message"]["content"].split() for c in body["choices"]] == [["w50", "w50"]] * 2
    assert body["usage"]["completion_tokens"] == 4
    assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    _, body = chat_text(http, logit_bias=FORCE_W50, max_tokens=None, max_completion_tokens=1)
    assert body["usage"]["completion_tokens"] == 1


def test_stop_fields(http):
    text, body = chat_text(http, logit_bias=FORCE_W50, stop=["w50"], max_tokens=2)
    assert (text.strip(), body["choices"][0]["finish_reason"]) == ("", "stop")
    text, _ = chat_text(
        http, logit_bias=FORCE_W50, stop="w50", include_stop_str_in_output=True, max_tokens=2
    )
    assert text.strip() == "w50"
    _, body = chat_text(http, logit_bias=FORCE_W50, stop_token_ids=[50], max_tokens=2)
    assert body["usage"]["completion_tokens"] == 1


def test_eos_fields_and_special_tokens(http):
    to_eos = {str(EOS_ID): 100}
    _, body = chat_text(http, logit_bias=to_eos, max_tokens=2)
    assert body["usage"]["completion_tokens"] == 1
    for fields in ({"min_tokens": 2}, {"ignore_eos": True}):
        _, body = chat_text(http, logit_bias=to_eos, max_tokens=2, **fields)
        assert body["usage"]["completion_tokens"] == 2
    bias = {str(IM_START_ID): 100}
    text, _ = chat_text(http, logit_bias=bias, max_tokens=1, skip_special_tokens=False)
    assert text.strip() == "<|im_start|>"


def test_add_generation_prompt_changes_the_prompt(http):
    _, with_prompt = chat_text(http)
    _, without = chat_text(http, add_generation_prompt=False)
    assert with_prompt["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]


def test_responses_fields(http):
    plain = post(http, "responses").json()
    reply = post(
        http,
        "responses",
        instructions="tell me a story",
        metadata={"k": "v"},
        temperature=0.5,
        top_p=0.5,
        logit_bias=FORCE_W50,
        max_output_tokens=2,
    ).json()
    assert reply["usage"]["input_tokens"] > plain["usage"]["input_tokens"]
    assert reply["metadata"] == {"k": "v"}
    assert reply["output"][0]["content"][0]["text"].split() == ["w50", "w50"]
    assert (reply["temperature"], reply["top_p"]) == (0.5, 0.5)


def test_completions_fields(http):
    reply = post(
        http, "completions", logit_bias=FORCE_W50, max_tokens=2, n=2, best_of=2, logprobs=1
    ).json()
    assert [c["text"].split() for c in reply["choices"]] == [["w50", "w50"]] * 2
    assert reply["choices"][0]["logprobs"]["tokens"]


def test_stream_options_continuous_usage_stats_is_refused(http):
    reply = post(http, "chat", stream=True, stream_options={"continuous_usage_stats": True})
    assert reply.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    options = {"include_usage": False, "include_obfuscation": True}
    assert post(http, "chat", stream=True, stream_options=options).status_code == 200


def test_stream_options_include_usage(http):
    body = minimal("chat", stream=True, stream_options={"include_usage": True})
    with http.stream("POST", PATHS["chat"], json=body) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: {")]
    assert '"usage":{' in lines[-1]


# ---- honoured sampling fields reach the sampler ----------------------------------------------

SAMPLING_VALUES = {
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "seed": 7,
    "stop": ["x"],
    "stop_token_ids": [5],
    "logit_bias": {"5": 1.0},
    "ignore_eos": True,
    "min_tokens": 1,
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
}
ROUTE_LEVEL = {"model", "stream", "stream_options", "user", "prompt_logprobs"}


def test_every_sampling_field_reaches_the_sampling_params():
    assert set(SamplingRequest.model_fields) == set(SAMPLING_VALUES) | ROUTE_LEVEL
    base = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 1}
    plain = build_sampling_params(ChatCompletionRequest(**base), 4, 64)
    for name, value in SAMPLING_VALUES.items():
        params = build_sampling_params(ChatCompletionRequest(**base, **{name: value}), 4, 64)
        assert params != plain, f"{name} has no effect on the SamplingParams"


def test_a_name_no_schema_knows_is_logged_once(caplog):
    raw = {"model": MODEL_ID, "max_tokenz": 3}
    with caplog.at_level("WARNING", logger=unsupported.__name__):
        ChatCompletionRequest.model_validate({**raw, "messages": MESSAGES})
        ChatCompletionRequest.model_validate({**raw, "messages": MESSAGES})
    assert [r.getMessage() for r in caplog.records].count(
        "request field 'max_tokenz' is not known to this server: ignored"
    ) == 1


@pytest.mark.parametrize(
    "fields",
    [{"thinking_token_budget": 4}, {"reasoning_effort": "low"}],
)
def test_reasoning_budget_on_a_model_without_thinking_is_a_400(http, fields):
    reply = post(http, "chat", **fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == next(iter(fields))


def test_continue_final_message_leaves_the_final_turn_open(http):
    partial = [*MESSAGES, {"role": "assistant", "content": "w50 w51"}]
    _, closed = chat_text(http, messages=partial, add_generation_prompt=False)
    _, opened = chat_text(http, messages=partial, continue_final_message=True)
    # ChatML: the open turn lacks the closing `<|im_end|>`.
    assert opened["usage"]["prompt_tokens"] < closed["usage"]["prompt_tokens"]
    both = {"continue_final_message": True, "add_generation_prompt": True}
    for fields in (both, {"continue_final_message": True}):
        messages = partial if fields is both else MESSAGES
        reply = post(http, "chat", messages=messages, **fields)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "continue_final_message"
