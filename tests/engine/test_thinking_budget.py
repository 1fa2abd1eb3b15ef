"""The engine's thinking budget: once thinking has taken its budget, the end-of-thinking tokens
are emitted whatever the logits, for every sample, with logprobs of what was emitted."""

from __future__ import annotations

import math

import pytest
import torch

from axon import LLM, SamplingParams
from axon.sampling.thinking import ThinkingBudget
from tests.model.tiny_models import get_tiny_model, random_prompts

ENGINE_ARGS = dict(dtype="float32", block_size=4, max_model_len=128, kv_cache_memory=2 << 20)
START, END, NEWLINES = 7, 9, 11  # stand-ins for <think>, </think> and "\n\n"


@pytest.fixture(scope="module")
def llm(tiny_model_root):
    return LLM(str(get_tiny_model("llama", tiny_model_root).path), **ENGINE_ARGS)


def budget_params(budget, **extra):
    values = dict(
        max_tokens=24,
        ignore_eos=True,
        thinking_token_budget=budget,
        thinking_end_token_ids=[END, NEWLINES],
        thinking_in_prompt=True,
    )
    return SamplingParams(**{**values, **extra})


def forced_run(budget: ThinkingBudget, tokens: list[int]) -> list[int | None]:
    """The forced token before each of `tokens`, advancing the budget with them."""
    forced = []
    for token in tokens:
        forced.append(budget.forced_token())
        budget.advance(token)
    return forced


def test_budget_forces_the_end_then_leaves_the_answer_free():
    budget = ThinkingBudget(budget_params(2))
    assert forced_run(budget, [1, 2, END, NEWLINES, 3, 4]) == [
        None,
        None,
        END,
        NEWLINES,
        None,
        None,
    ]
    assert budget.done


def test_a_model_that_closes_thinking_itself_is_left_alone():
    budget = ThinkingBudget(budget_params(5))
    assert forced_run(budget, [1, END, 1, 2, 3, 4, 5, 6]) == [None] * 8


def test_thinking_opened_by_the_first_token_or_not_at_all():
    opened = budget_params(1, thinking_in_prompt=False, thinking_start_token_id=START)
    assert forced_run(ThinkingBudget(opened), [START, 1, END, NEWLINES]) == [
        None,
        None,
        END,
        NEWLINES,
    ]
    assert forced_run(ThinkingBudget(opened), [1, 2, 3, 4]) == [None] * 4


def test_answer_reserve_cuts_thinking_earlier():
    params = budget_params(100, max_tokens=20, answer_reserve_tokens=8)
    assert params.thinking_limit() == 20 - 2 - 8
    assert budget_params(0).thinking_limit() == 0


def test_budget_needs_the_end_token():
    with pytest.raises(ValueError, match="end-of-thinking"):
        SamplingParams(thinking_token_budget=4)
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1, thinking_end_token_ids=[END])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_emits_the_end_at_the_budget_for_every_sample(llm, temperature):
    prompt = random_prompts((10,), seed=3)[0]
    params = budget_params(5, n=3, temperature=temperature, seed=1, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs
    for output in outputs:
        tokens = output.token_ids
        cut = tokens.index(END)
        assert cut <= 5
        if cut == 5:  # the budget ended thinking: the template's newlines follow
            assert tokens[6] == NEWLINES
        assert len(tokens) == 24
        assert END in output.logprobs[cut]  # the emitted token's logprob, forced or not


def test_forced_tokens_show_in_logprobs_under_the_model(llm):
    prompt = random_prompts((10,), seed=4)[0]
    params = budget_params(0, temperature=0.0, logprobs=1, max_tokens=3)
    output = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    assert output.token_ids[:2] == [END, NEWLINES]
    reference = torch.log_softmax(llm.compute_logits([prompt])[0], dim=-1)
    entry = output.logprobs[0][END]
    assert math.isclose(entry.logprob, reference[END].item(), abs_tol=1e-5)
    assert entry.rank == 1 + int((reference > reference[END]).sum())


def test_the_budget_holds_across_preemption(tiny_model_root):
    # A KV cache too small for every sample at once: the scheduler preempts and recomputes.
    small = {**ENGINE_ARGS, "kv_cache_memory": 48 << 10, "max_model_len": 64}
    llm = LLM(str(get_tiny_model("llama", tiny_model_root).path), **small)
    prompts = [{"prompt_token_ids": p} for p in random_prompts((12,) * 6, seed=8)]
    params = budget_params(9, temperature=1.0, seed=3, max_tokens=40)
    outputs = llm.generate(prompts, params)
    assert llm.get_stats()["num_preemptions"] > 0
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        assert END in tokens and tokens.index(END) <= 9
        # Seeded: a recomputed sample emits what it would have alone, forced tokens included.
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == tokens
