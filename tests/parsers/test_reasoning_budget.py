"""Reasoning budgets end to end: `axon serve` on a tiny Qwen3 carrying Qwen3.5's real chat
template (llama.cpp's corpus), which opens `<think>` in the prompt, through the `openai` and
`anthropic` clients. The thinking part never exceeds its budget, `</think>` (and the template's
"\\n\\n") is emitted, and the answer follows, streaming or not."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.parsers.conftest import MARKERS, MODEL_ID, byte_model_with_corpus_template
from tests.server.conftest import _serve_args, _wait_until_serving, spawn_serve, stop_server

pytestmark = pytest.mark.slow

TEMPLATE = "Qwen3.5-4B.jinja"
MAX_TOKENS = 40
FREE = {"ignore_eos": True}  # random weights: the answer runs to max_tokens
GREEDY = {"temperature": 0}  # this anthropic SDK's create() takes no temperature
EFFORT_BUDGETS = {"low": 4, "medium": 8, "high": 600, "max": 2}  # the operator's, per model
MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = byte_model_with_corpus_template(
        tmp_path_factory.mktemp("tiny_qwen35_template"), TEMPLATE
    )
    budgets = ",".join(f"{effort}={n}" for effort, n in EFFORT_BUDGETS.items())
    args = [*_serve_args(model), "--reasoning-effort-budgets", budgets]
    running = spawn_serve(args, {"AXON_ALLOWED_LOCAL_MODEL_PATHS": str(model)})
    try:
        _wait_until_serving(running)
    except BaseException:
        stop_server(running)
        raise
    yield running
    stop_server(running)


@pytest.fixture()
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def num_tokens(text: str | None) -> int:
    """At least the tokens `text` took: one byte each, a marker (`</tool_call>`) one token."""
    text = text or ""
    for marker in MARKERS:
        text = text.replace(marker, "M")
    return len(text)


def thinking_tokens(choice) -> list[str]:
    """The sampled tokens' texts up to and with `</think>`, from the choice's logprobs."""
    tokens = [entry.token for entry in choice.logprobs.content]
    assert "</think>" in tokens, tokens
    return tokens[: tokens.index("</think>") + 1]


def chat(client, **fields):
    # Seeded sampling: greedy decoding of random weights loops on "\n" after "\n\n".
    values = dict(model=MODEL_ID, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=7)
    return client.chat.completions.create(**{**values, **fields})


@pytest.mark.parametrize("budget", [0, 5, 12])
def test_thinking_token_budget_cuts_thinking_and_the_answer_follows(client, budget):
    reply = chat(client, logprobs=True, extra_body={"thinking_token_budget": budget, **FREE})
    choice = reply.choices[0]
    thought = thinking_tokens(choice)
    assert len(thought) - 1 <= budget
    if len(thought) - 1 == budget:  # the engine closed it, as Qwen's template does
        tokens = [entry.token for entry in choice.logprobs.content]
        assert tokens[budget + 1 : budget + 3] == ["\n", "\n"]
    assert num_tokens(choice.message.reasoning_content) <= budget
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert choice.message.content  # the answer's tokens after the closed thinking


def test_streaming_matches_non_streaming(client):
    fields = dict(extra_body={"thinking_token_budget": 6, **FREE})
    whole = chat(client, **fields).choices[0].message
    reasoning, content = "", ""
    for chunk in chat(client, stream=True, **fields):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content or "", whole.content)
    assert num_tokens(reasoning) <= 6


@pytest.mark.parametrize("effort", ["low", "medium", "max"])
def test_reasoning_effort_is_the_configured_budget(client, effort):
    reply = chat(client, logprobs=True, reasoning_effort=effort, extra_body=FREE)
    assert len(thinking_tokens(reply.choices[0])) - 1 <= EFFORT_BUDGETS[effort]


def test_a_budget_past_max_tokens_keeps_room_for_the_answer(client):
    # high is 600 tokens: max_tokens cuts it, leaving a quarter of max_tokens for the answer.
    reply = chat(client, logprobs=True, reasoning_effort="high", extra_body=FREE)
    thought = thinking_tokens(reply.choices[0])
    assert len(thought) - 1 <= MAX_TOKENS - 3 - MAX_TOKENS // 4
    assert reply.usage.completion_tokens == MAX_TOKENS


def test_reasoning_effort_none_turns_thinking_off(client):
    reply = chat(client, reasoning_effort="none", extra_body=FREE)
    assert not reply.choices[0].message.reasoning_content


def test_unknown_reasoning_effort_is_a_400_naming_it(server):
    body = {"model": MODEL_ID, "messages": MESSAGES, "reasoning_effort": "extreme"}
    reply = httpx.post(server.openai_url + "/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "reasoning_effort"


def test_models_lists_the_efforts(client):
    card = client.models.retrieve(MODEL_ID)
    assert card.model_extra["reasoning_efforts"] == [*EFFORT_BUDGETS, "none", "minimal"]


def test_responses_reasoning_effort(client):
    reply = client.responses.create(
        model=MODEL_ID,
        input="Think, then answer.",
        max_output_tokens=MAX_TOKENS,
        extra_body={"seed": 7, **FREE},
        reasoning={"effort": "low"},
    )
    reasoning = [item for item in reply.output if item.type == "reasoning"]
    text = reasoning[0].content[0].text if reasoning else ""
    assert num_tokens(text) <= EFFORT_BUDGETS["low"]
    assert reply.usage.output_tokens == MAX_TOKENS


@pytest.fixture()
def anthropic_client(server):
    from anthropic import Anthropic

    with Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def anthropic_request(**fields) -> dict:
    values = dict(model=MODEL_ID, max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body=GREEDY)
    return {**values, "thinking": {"type": "enabled", "budget_tokens": 8}, **fields}


def test_anthropic_budget_tokens_is_enforced(anthropic_client):
    reply = anthropic_client.messages.create(**anthropic_request())
    thinking = [block.thinking for block in reply.content if block.type == "thinking"]
    assert num_tokens("".join(thinking)) <= 8
    assert reply.usage.output_tokens <= MAX_TOKENS


def test_anthropic_streaming_budget(anthropic_client):
    whole = anthropic_client.messages.create(**anthropic_request())
    with anthropic_client.messages.stream(**anthropic_request()) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]


def test_anthropic_disabled_thinking(anthropic_client):
    reply = anthropic_client.messages.create(**anthropic_request(thinking={"type": "disabled"}))
    assert not [block for block in reply.content if block.type == "thinking"]


def test_structured_output_follows_the_closed_thinking(client):
    # The grammar leaves thinking free up to `</think>`: the forced end and its newlines are
    # what it allows there, then the JSON is enforced.
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["x", "y"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
    reply = chat(
        client,
        logprobs=True,
        response_format=response_format,
        extra_body={"thinking_token_budget": 4},
    )
    choice = reply.choices[0]
    assert len(thinking_tokens(choice)) - 1 <= 4
    assert json.loads(choice.message.content)["a"] in ("x", "y")


def test_every_sample_keeps_the_budget(client):
    reply = chat(client, n=3, logprobs=True, extra_body={"thinking_token_budget": 3, **FREE})
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert len(thinking_tokens(choice)) - 1 <= 3


OPENED = "<|im_start|>user\nThink.<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_completions_thinking_token_budget(client):
    reply = client.completions.create(
        model=MODEL_ID,
        prompt=OPENED,
        max_tokens=MAX_TOKENS,
        logprobs=0,
        seed=7,
        extra_body={"thinking_token_budget": 5, **FREE},
    )
    tokens = reply.choices[0].logprobs.tokens
    assert "</think>" in tokens and tokens.index("</think>") <= 5
    assert reply.usage.completion_tokens == MAX_TOKENS


def test_completions_prompts_that_disagree_on_thinking_are_a_400(server):
    body = {"model": MODEL_ID, "prompt": [OPENED, "plain"], "thinking_token_budget": 5}
    reply = httpx.post(server.openai_url + "/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "thinking_token_budget"
