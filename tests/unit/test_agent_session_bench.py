"""benchmarks/agent_session.py's own parts: the session is the same every run and, through the
corpus template both servers render it with and the real Qwen tokenizer, each turn's prompt
extends the previous turn's (the premise of every prefix cache it measures); what each server
reports as cached is read; the targets are judged (nothing is built or started)."""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path

import pytest

from axon.tokenizer.chat_template import load_template_file, render_chat
from llama_cpp_sdist import extract_llama_cpp

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield (
            importlib.import_module("agent_session"),
            importlib.import_module("agent_session_text"),
        )
    finally:
        sys.path.remove(str(BENCH))


def _session(text, turns: int = 4, system_tokens: int = 1500):
    rng = random.Random(0)
    return text.tool_schemas(rng, system_tokens), text.session_messages(rng, turns, system_tokens)


def test_the_session_is_deterministic_and_grows_by_one_tool_turn(bench):
    _, text = bench
    tools, turns = _session(text)
    assert (tools, turns) == _session(text)
    assert [len(messages) for messages in turns] == [4, 6, 8, 10]
    for before, after in zip(turns, turns[1:]):
        assert after[: len(before)] == before
        assert [m["role"] for m in after[len(before) :]] == ["assistant", "tool"]
        assert after[-2]["tool_calls"][0]["id"] == after[-1]["tool_call_id"]


def test_each_turn_renders_as_an_extension_of_the_last(bench, qwen3_tokenizer):
    agent_session, text = bench
    name = agent_session.TEMPLATE
    directory = extract_llama_cpp("models/templates/", lambda path: path == name, "-agent")
    template = load_template_file(directory / name)
    tools, turns = _session(text)
    prompts = [render_chat(qwen3_tokenizer, m, tools, chat_template=template) for m in turns]
    for before, after in zip(prompts, prompts[1:]):
        assert after.startswith(before)
    assert "<tools>" in prompts[0] and prompts[-1].count("<tool_response>") == 4


def test_cached_tokens_are_read_from_either_server(bench):
    agent_session, _ = bench
    row = {"prompt_tokens": None, "cached": None}
    usage = {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 880}}
    agent_session.read_counts({"usage": usage}, row)
    assert row == {"prompt_tokens": 900, "cached": 880}
    row = {"prompt_tokens": None, "cached": None}
    agent_session.read_counts({"usage": {"prompt_tokens": 900}}, row)
    assert row == {"prompt_tokens": 900, "cached": 0}
    row = {"prompt_tokens": None, "cached": None}
    agent_session.read_counts({"timings": {"cache_n": 700, "prompt_n": 200}}, row)
    assert row == {"prompt_tokens": 900, "cached": 700}


def _rows(ttfts: list[float]) -> list[dict]:
    return [{"ttft": t, "total": 2 * t, "prompt_tokens": 100, "cached": 0} for t in ttfts]


def test_the_targets_are_judged(bench):
    agent_session, _ = bench
    llama = {"cold": _rows([10.0, 4.0, 4.0]), "restart": _rows([10.0, 4.0, 4.0])}
    llama["restart"][0]["restore"] = 0.1
    passing = {"cold": _rows([8.0, 1.0, 2.0]), "restart": _rows([1.0, 1.0, 1.0])}
    report = agent_session.summarize({"axon": passing, "llama-server": llama})
    assert "worst 0.50x" in report and ": pass" in report and "MISS" not in report
    missing = {"cold": _rows([8.0, 1.0, 3.0]), "restart": _rows([2.0, 1.0, 1.0])}
    report = agent_session.summarize({"axon": missing, "llama-server": llama})
    assert "worst 0.75x, mean 0.50x: MISS" in report and "0.25x: MISS" in report
