"""Prompt logprobs under tensor parallelism on CPU (gloo, a real rank-1 subprocess): every rank
runs the prompt rows through its shard of the LM head, and TP=2 scores what TP=1 does."""

from __future__ import annotations

import pytest

from axon import LLM, SamplingParams
from tests.engine.test_tensor_parallel import ENGINE_ARGS, PROMPT_LENGTHS
from tests.model.tiny_models import get_tiny_model, random_prompts


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return get_tiny_model("qwen3", tiny_model_root)


def _scored(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [output.prompt_logprobs for output in outputs]


def test_prompt_logprobs_equal_single_rank(tiny):
    prompts = random_prompts(PROMPT_LENGTHS, seed=4)
    expected = _scored(LLM(str(tiny.path), **ENGINE_ARGS), prompts)
    pair = LLM(str(tiny.path), tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        got = _scored(pair, prompts)
    finally:
        pair.engine.close()
    for want, have in zip(expected, got):
        assert have[0] is None and len(have) == len(want)
        for want_entry, have_entry in zip(want[1:], have[1:]):
            assert want_entry.keys() == have_entry.keys()
            for token_id, lp in want_entry.items():
                assert abs(have_entry[token_id].logprob - lp.logprob) <= 1e-5
