"""Drafts under penalties and thinking budgets are exact: each verified row is sampled as the
output position it stands for, after the drafts before it (their penalty counts, the forced
end of thinking), so greedy and seeded output with drafts is the output without, token for
token. The oracle drafter (test_speculative.py) makes every step see accepted and rejected
drafts; the counters show both happened."""

from __future__ import annotations

import random

import pytest
import torch

from axon import LLM, SamplingParams
from axon.sampling.metadata import forced_token
from axon.sampling.penalties import PenaltyCounts, penalty_tensors_ref
from axon.sampling.sampler import apply_penalties_
from axon.sampling.thinking import ThinkingBudget
from axon.sequence import Sequence, SequenceStatus
from tests.engine.test_speculative import NGRAM, _repeating_prompts, _requests, _tokens, _use_oracle
from tests.model.tiny_models import engine_kwargs, get_tiny_model

# Mostly rewarding repeats: the random tiny model then copies itself, so n-gram drafts are
# accepted, and a draft's count decides the rows after it.
PENALTIES = {
    "repetition": {"repetition_penalty": 0.5},
    "frequency": {"frequency_penalty": -0.5},
    "presence": {"presence_penalty": -2.0},
    "mixed": {"frequency_penalty": 0.6, "presence_penalty": -1.0, "repetition_penalty": 1.2},
}
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 1.0, "top_k": 20, "seed": 11, "n": 2},
}
END, NEWLINES = 9, 11  # stand-ins for </think> and "\n\n"


@pytest.fixture(scope="module")
def engines(tiny_model_root):
    """(without drafts, with drafts at every step) on a tiny Qwen3: chunked prefill over
    4-token blocks, prefix caching on."""
    tiny = get_tiny_model("qwen3", tiny_model_root)
    kwargs = engine_kwargs(tiny, block_size=4, max_num_batched_tokens=16)
    spec = LLM(**kwargs, speculative_config=NGRAM)
    spec.engine.speculator.max_seqs = 8  # every running sequence drafts, whatever it accepts
    spec.engine.speculator.row_cost = 0.0
    return LLM(**kwargs), spec


def _counters(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]


def _check_exact(base: LLM, spec: LLM, prompts, params: SamplingParams) -> None:
    """Spec's output equals base's with the n-gram drafter, then with the oracle's accepted
    and rejected drafts; both made drafts, the oracle's accepted and rejected some."""
    drafter = spec.engine.speculator.drafter
    try:
        reference = base.generate(_requests(prompts), params)
        drafted = _counters(spec)[0]
        assert _tokens(spec.generate(_requests(prompts), params)) == _tokens(reference)
        assert _counters(spec)[0] > drafted, "the n-gram drafter drafted"
        _use_oracle(spec, reference)
        drafted, accepted = _counters(spec)
        assert _tokens(spec.generate(_requests(prompts), params)) == _tokens(reference)
    finally:
        spec.engine.speculator.drafter = drafter
    new_drafted, new_accepted = _counters(spec)
    assert new_accepted > accepted, "drafts were accepted"
    assert new_drafted - drafted > new_accepted - accepted, "drafts were rejected"


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("penalty", PENALTIES)
def test_penalties_draft_and_stay_exact(engines, penalty, sampling):
    base, spec = engines
    params = SamplingParams(
        max_tokens=20, ignore_eos=True, **PENALTIES[penalty], **SAMPLING[sampling]
    )
    _check_exact(base, spec, _repeating_prompts(seed=8)[:3], params)


@pytest.fixture(scope="module")
def budget_engines(tiny_model_root):
    tiny = get_tiny_model("llama", tiny_model_root)
    kwargs = engine_kwargs(tiny, block_size=4, max_num_batched_tokens=16)
    spec = LLM(**kwargs, speculative_config=NGRAM)
    spec.engine.speculator.max_seqs = 8
    spec.engine.speculator.row_cost = 0.0
    return LLM(**kwargs), spec


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("budget", [2, 6])
def test_thinking_budget_drafts_and_ends_thinking_at_the_same_position(
    budget_engines, budget, sampling
):
    base, spec = budget_engines
    params = SamplingParams(
        max_tokens=20,
        ignore_eos=True,
        thinking_token_budget=budget,
        thinking_end_token_ids=[END, NEWLINES],
        thinking_in_prompt=True,
        **SAMPLING[sampling],
    )
    prompts = _repeating_prompts(seed=9)[:3]
    _check_exact(base, spec, prompts, params)
    for sample in base.generate(_requests(prompts), params)[0].outputs:
        assert sample.token_ids.index(END) <= budget


def test_a_rows_forced_token_is_that_of_its_position():
    params = SamplingParams(
        thinking_token_budget=2, thinking_end_token_ids=[END, NEWLINES], thinking_in_prompt=True
    )
    seq = Sequence("r", [1, 2, 3], params)
    seq.thinking_budget = ThinkingBudget.of(params)
    seq.spec_token_ids = [4, 5, END, NEWLINES]
    assert [forced_token(seq, offset) for offset in range(5)] == [None, None, END, NEWLINES, None]
    assert seq.thinking_budget.forced_token() is None  # the budget itself is left as it was


def _running(params: SamplingParams, rng: random.Random, vocab: int) -> Sequence:
    seq = Sequence("req", [rng.randrange(vocab) for _ in range(6)], params)
    seq.status = SequenceStatus.RUNNING
    for _ in range(5):
        seq.append_token(rng.randrange(vocab))
    return seq


@pytest.mark.parametrize("penalty", PENALTIES)
def test_a_drafted_rows_penalties_count_the_drafts_before_it(penalty):
    vocab, rng = 12, random.Random(3)
    seq = _running(SamplingParams(**PENALTIES[penalty]), rng, vocab)
    other = _running(SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5), rng, vocab)
    seq.spec_token_ids = [seq.output_token_ids[0], 11, 11, vocab + 1, 2]  # seen, new, past vocab
    batch, offsets = [other, *[seq] * 6], [0, 0, 1, 2, 3, 4, 5]
    logits = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(0))
    counts = PenaltyCounts(vocab, torch.device("cpu"))
    counts.tensors(batch[:2])  # counted once before, as in a running engine
    for penalties in (
        counts.tensors(batch, offsets),
        penalty_tensors_ref(batch, vocab, torch.device("cpu"), offsets),
    ):
        got = logits.clone()
        apply_penalties_(got, penalties)
        for row, (row_seq, offset) in enumerate(zip(batch, offsets)):
            alone = Sequence("alone", row_seq.prompt_token_ids, row_seq.sampling_params)
            for token_id in [*row_seq.output_token_ids, *row_seq.spec_token_ids[:offset]]:
                alone.append_token(token_id)
            want = logits[row : row + 1].clone()
            apply_penalties_(want, penalty_tensors_ref([alone], vocab, torch.device("cpu")))
            assert torch.equal(got[row], want[0]), (row, offset)
