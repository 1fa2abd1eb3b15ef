"""Prompt logprobs through the real engine (batched, paged, chunked, prefix cache on) equal the
log_softmax of transformers' logits on the same prompt: each prompt token's logprob given the
ones before it, its rank and the top k, the first token None."""

from __future__ import annotations

import pytest
import torch

from axon import LLM, SamplingParams

from .tiny_models import ARCHS, engine_kwargs, get_tiny_model, random_prompts

ATOL = 1e-4  # fp32
PROMPT_LENGTHS = (1, 5, 17, 40)
TOP_K = 3


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tiny_model_root):
    return get_tiny_model(request.param, tiny_model_root)


@torch.no_grad()
def reference(tiny, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax [P, V] at every prompt position."""
    logits = tiny.hf_model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)


def check(tiny, prompt: list[int], got) -> None:
    assert len(got) == len(prompt) and got[0] is None
    scores = reference(tiny, prompt)
    for position in range(1, len(prompt)):
        entry, row = got[position], scores[position - 1]
        token = prompt[position]
        assert abs(entry[token].logprob - float(row[token])) <= ATOL
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_values, top_ids = row.topk(TOP_K)
        ranked = sorted((lp.rank, tok) for tok, lp in entry.items() if tok != token)
        for tok, value in zip(top_ids.tolist(), top_values.tolist()):
            if tok != token:
                assert abs(entry[tok].logprob - value) <= ATOL
        assert {tok for _, tok in ranked} <= set(top_ids.tolist())


@pytest.mark.parametrize(
    ("block_size", "max_num_batched_tokens"),
    [(16, None), (4, 16)],
    ids=["default-budget", "chunked-block4"],
)
def test_prompt_logprobs_match_transformers(tiny, block_size, max_num_batched_tokens):
    overrides = {}
    if max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = max_num_batched_tokens
    llm = LLM(**engine_kwargs(tiny, block_size=block_size, **overrides))
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP_K, n=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        check(tiny, prompt, output.prompt_logprobs)
        assert [len(o.token_ids) for o in output.outputs] == [2, 2]


def test_a_cached_prefix_is_scored_again(tiny):
    """A prompt whose blocks the prefix cache holds still gets every position scored."""
    llm = LLM(**engine_kwargs(tiny, block_size=4))
    prompt = random_prompts((40,), seed=6)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": prompt}], plain)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_K)
    output = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    check(tiny, prompt, output.prompt_logprobs)
    again = llm.generate([{"prompt_token_ids": prompt}], plain)[0]
    assert again.prompt_logprobs is None and again.num_cached_tokens > 0
