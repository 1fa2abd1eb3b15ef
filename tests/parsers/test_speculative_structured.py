"""Structured output under speculative decoding: the grammar masks each verified row as after
the drafts before it, a draft it rejects ends the draft, and the matcher keeps only the
accepted tokens. So greedy and seeded output with drafts is the output without them, token for
token, for a json_schema and for tool-call grammars (tool_choice required and named): in the
engine (n-gram drafts, and the oracle's accepted and rejected ones) and end to end through
`axon serve` with a real chat template and the `openai` client."""

from __future__ import annotations

import json

import pytest

from axon import LLM, SamplingParams
from axon.engine.speculation import grammar_prefix
from axon.sequence import Sequence
from tests.engine.test_speculative import NGRAM, _tokens, _use_oracle
from tests.parsers.conftest import byte_model_with_corpus_template
from tests.parsers.test_structured_output import SCHEMA, TOOLS, WEATHER
from tests.server.conftest import _ENGINE_ARGS, _wait_until_serving, spawn_serve, stop_server

CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
GRAMMARS = {
    "json_schema": {"type": "json_schema", "schema": SCHEMA},
    "tool_required": {"type": "tool_call", "format": "hermes", "tools": [*TOOLS, CLOCK]},
    "tool_named": {"type": "tool_call", "format": "hermes", "tools": TOOLS},
}
# Prompts that show the output's shape: the n-gram drafter finds it to copy.
PROMPTS = [
    'Reply as {"name": "ab", "age": 30, "tags": ["a", "b"]} does.',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
]
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 1.0, "seed": 5, "n": 2},
}


@pytest.fixture(scope="module")
def engines(byte_model):
    """(without drafts, with drafts at every step) on the byte-level tiny Qwen3: chunked
    prefill over 4-token blocks."""
    kwargs = dict(
        model=str(byte_model),
        max_model_len=1024,
        kv_cache_memory=8 << 20,
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,
    )
    spec = LLM(**kwargs, speculative_config=NGRAM)
    spec.engine.speculator.max_seqs = 8  # every running sequence drafts, whatever it accepts
    spec.engine.speculator.row_cost = 0.0
    return LLM(**kwargs), spec


def _count_proposals(oracle) -> list[int]:
    """A list that `oracle` appends the length of each draft it proposes to."""
    lengths, propose = [], oracle.propose

    def counted(seqs, max_tokens):
        drafts = propose(seqs, max_tokens)
        lengths.extend(len(draft) for draft in drafts)
        return drafts

    oracle.propose = counted
    return lengths


def _counters(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("grammar", GRAMMARS)
def test_grammar_drafts_and_stays_exact(engines, grammar, sampling):
    base, spec = engines
    params = SamplingParams(
        max_tokens=60, structured_output=GRAMMARS[grammar], **SAMPLING[sampling]
    )
    drafter = spec.engine.speculator.drafter
    try:
        reference = base.generate(PROMPTS, params)
        drafted, accepted = _counters(spec)
        assert _tokens(spec.generate(PROMPTS, params)) == _tokens(reference)
        assert _counters(spec)[1] > accepted, "n-gram drafts were accepted"
        proposed = _count_proposals(_use_oracle(spec, reference))
        drafted, accepted = _counters(spec)
        assert _tokens(spec.generate(PROMPTS, params)) == _tokens(reference)
    finally:
        spec.engine.speculator.drafter = drafter
    new_drafted, new_accepted = _counters(spec)
    assert new_accepted > accepted, "the oracle's drafts were accepted"
    # Every other proposal has a wrong token: the grammar ends the draft before it, or the
    # target rejects it.
    rejected = new_drafted - drafted - (new_accepted - accepted)
    assert rejected + sum(proposed) - (new_drafted - drafted) > 0
    if grammar == "json_schema":
        for output in reference:
            for sample in output.outputs:
                if sample.finish_reason == "stop":
                    json.loads(sample.text)


def test_a_draft_ends_where_the_grammar_rejects_it(engines):
    _, spec = engines
    tokenizer = spec.tokenizer
    seq = Sequence("r", [1], SamplingParams())
    seq.grammar = spec.engine.structured.matcher(GRAMMARS["json_schema"])
    valid = tokenizer.encode('{"name": "x", "age"', add_special_tokens=False)
    wrong = tokenizer.encode("}", add_special_tokens=False)
    assert grammar_prefix(seq, valid + wrong + valid) == valid
    assert grammar_prefix(seq, valid) == valid
    assert seq.grammar.validate_tokens(valid) == len(valid)  # the matcher is left as it was


# ---- end to end: `axon serve` with a real chat template ---------------------------------------

TEMPLATE = "Qwen-Qwen3-0.6B.jinja"
SPEC_TABLE = (
    '{method = "ngram", num_speculative_tokens = 4, prompt_lookup_min = 1, prompt_lookup_max = 3}'
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """One `axon serve` with the byte-level tiny Qwen3 (Qwen3's real chat template) twice:
    `base` without drafts, `spec` with n-gram drafts."""
    model = byte_model_with_corpus_template(tmp_path_factory.mktemp("spec_qwen3"), TEMPLATE)
    path = json.dumps(str(model))
    tables = (
        f'{{model_id = {path}, served_model_name = "base"}}, '
        f'{{model_id = {path}, served_model_name = "spec", speculative_config = {SPEC_TABLE}}}'
    )
    env = {"AXON_DEFAULT_MODELS": f"[{tables}]", "AXON_ALLOWED_LOCAL_MODEL_PATHS": str(model)}
    server = spawn_serve(["--no-demo", *_ENGINE_ARGS], env)
    try:
        for name in ("base", "spec"):
            _wait_until_serving(server, model_id=name)
    except BaseException:
        stop_server(server)
        raise
    yield server
    stop_server(server)


REQUESTS = {
    "json_schema": {
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    },
    "tool_named": {
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    },
}


def _said(choice) -> tuple:
    """A choice's content and tool calls (their ids are random)."""
    calls = choice.message.tool_calls or []
    return choice.message.content, [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.parametrize("request_kind", REQUESTS)
def test_served_structured_output_with_drafts_is_the_output_without(served, request_kind):
    from openai import OpenAI

    replies = {}
    with OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
        for model in ("base", "spec"):
            replies[model] = c.chat.completions.create(
                model=model,
                max_tokens=200,
                seed=3,
                n=2,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                **REQUESTS[request_kind],
            )
    base, spec = (replies[m].choices for m in ("base", "spec"))
    assert list(map(_said, spec)) == list(map(_said, base))
    assert [c.finish_reason for c in spec] == [c.finish_reason for c in base]
    if request_kind == "json_schema":
        assert all(c.finish_reason == "stop" for c in spec)
        assert all(isinstance(json.loads(c.message.content), dict) for c in spec)
    else:
        assert all(c.message.tool_calls[0].function.name == "get_weather" for c in spec)
    details = replies["spec"].usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0, "drafts were made and accepted"
