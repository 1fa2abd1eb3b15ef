"""Greedy continuations through the real engine equal transformers' `generate(do_sample=False)`.

Each mode forces one engine path: chunked prefill, prefix-cache hits, and preemption by recompute.
The reference's top-1/top-2 logit gaps are checked first, so a failure here is the engine's and not
a near-tie that fp32 noise could flip.
"""

from __future__ import annotations

import pytest

from axon import LLM, SamplingParams

from .tiny_models import (
    ARCHS,
    TinyModel,
    engine_kwargs,
    get_tiny_model,
    random_prompt,
    random_prompts,
)

MAX_TOKENS = 32
# 10x the logits tolerance of test_logits: an engine within it cannot flip these argmaxes.
MIN_REFERENCE_MARGIN = 1e-3
# Seeds picked so every arch's reference margin clears MIN_REFERENCE_MARGIN.
PROMPT_LENGTHS = (1, 5, 17, 33, 40)
PROMPT_SEED = 11
PREFIX_LENGTH = 40  # two full 16-token blocks and a partial one
PREFIX_SEED = 101
SUFFIX_LENGTHS = (6, 3, 9, 17, 24)  # the first is the warm-up request

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tiny_model_root):
    return get_tiny_model(request.param, tiny_model_root)


def _generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], GREEDY)


def _check_reference_margins(tiny: TinyModel, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        margin = tiny.greedy(prompt, MAX_TOKENS).min_margin
        assert margin > MIN_REFERENCE_MARGIN, (
            f"test setup: {tiny.arch} prompt of {len(prompt)} has a near-tie ({margin:.1e}); "
            "pick another PROMPT_SEED"
        )


def _assert_same_as_transformers(tiny: TinyModel, prompts: list[list[int]], outputs) -> None:
    assert len(outputs) == len(prompts)
    failures = []
    for prompt, output in zip(prompts, outputs):
        assert list(output.prompt_token_ids) == prompt, "outputs out of order or prompt altered"
        completion = output.outputs[0]
        got = list(completion.token_ids)
        want = tiny.greedy(prompt, MAX_TOKENS).token_ids
        if got != want:
            failures.append(_describe_divergence(tiny, prompt, got, want))
        elif completion.finish_reason != "length":
            failures.append(f"prompt of {len(prompt)}: finish_reason {completion.finish_reason!r}")
    assert not failures, f"{tiny.arch}: " + "; ".join(failures)


def _describe_divergence(tiny: TinyModel, prompt: list[int], got: list[int], want: list[int]):
    if len(got) != len(want):
        return f"prompt of {len(prompt)}: {len(got)} tokens, expected {len(want)}"
    step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    margin = tiny.greedy(prompt, MAX_TOKENS).margins[step]
    return (
        f"prompt of {len(prompt)}: first differs at step {step}: axon {got[step]}, "
        f"transformers {want[step]} (reference margin {margin:.3f})"
    )


@pytest.mark.parametrize(
    ("block_size", "max_num_batched_tokens"),
    [(16, None), (4, 16)],
    ids=["default-budget", "chunked-prefill"],
)
def test_greedy_matches_transformers(tiny, block_size, max_num_batched_tokens):
    prompts = random_prompts(PROMPT_LENGTHS, PROMPT_SEED)
    _check_reference_margins(tiny, prompts)
    overrides = {}
    if max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = max_num_batched_tokens
    llm = LLM(**engine_kwargs(tiny, block_size=block_size, **overrides))

    _assert_same_as_transformers(tiny, prompts, _generate(llm, prompts))


def test_greedy_with_prefix_cache_hits(tiny):
    block_size = 16
    prefix = random_prompt(PREFIX_LENGTH, PREFIX_SEED)
    first, *batch = [prefix + suffix for suffix in random_prompts(SUFFIX_LENGTHS, PREFIX_SEED)]
    _check_reference_margins(tiny, [first, *batch])
    llm = LLM(**engine_kwargs(tiny, block_size=block_size, enable_prefix_caching=True))

    _assert_same_as_transformers(tiny, [first], _generate(llm, [first]))
    before = llm.get_stats()
    _assert_same_as_transformers(tiny, batch, _generate(llm, batch))
    after = llm.get_stats()

    full_prefix_tokens = PREFIX_LENGTH // block_size * block_size
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    assert hits >= full_prefix_tokens * len(batch), (
        f"{tiny.arch}: {hits} prefix-cache hit tokens for {len(batch)} prompts sharing "
        f"{full_prefix_tokens} cached tokens ({queries} queried)"
    )


def test_greedy_under_preemption(tiny):
    block_size = 16
    prompts = random_prompts(PROMPT_LENGTHS, PROMPT_SEED)
    _check_reference_margins(tiny, prompts)
    longest = max(len(prompt) for prompt in prompts) + MAX_TOKENS  # 72 tokens: 5 blocks
    max_model_len = 96  # 6 blocks
    # 8 blocks: every sequence fits alone, but the batch needs 17, so decode must preempt.
    kwargs = engine_kwargs(
        tiny, block_size=block_size, kv_cache_blocks=8, max_model_len=max_model_len
    )
    assert longest <= max_model_len
    llm = LLM(**kwargs)

    _assert_same_as_transformers(tiny, prompts, _generate(llm, prompts))
    assert llm.get_stats()["num_preemptions"] > 0, f"{tiny.arch}: nothing was preempted"
