"""The batched sampler against reference formulas, on tiny vocabularies and one real-sized one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from axon.sampling import Sampler, SamplerOutput, SamplingMetadata, TokenLogprobs
from axon.sampling.metadata import noise_key
from axon.sampling.penalties import PenaltyCounts
from axon.sampling.sampler import (
    apply_penalties_,
    exponential_noise,
    greedy,
    greedy_token_ids,
    hash32_,
)
from axon.sampling_params import SamplingParams
from axon.sequence import Sequence

CPU = torch.device("cpu")
QWEN_VOCAB = 151936


def make_seq(
    params: SamplingParams,
    prompt: tuple[int, ...] = (1, 2, 3),
    output: tuple[int, ...] = (),
    eos: frozenset[int] = frozenset(),
    index: int = 0,
) -> Sequence:
    seq = Sequence("req", list(prompt), params, index=index, eos_token_ids=eos)
    for token_id in output:
        seq.append_token(token_id)
    return seq


def run_sampler(logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
    meta = SamplingMetadata.from_sequences(seqs, logits.shape[-1], CPU)
    return Sampler()(logits, meta)


def seeded_draws(logits_row: torch.Tensor, num_draws: int = 4000, **params) -> list[int]:
    """Draw `num_draws` tokens from one distribution, one row per seed, in a single batch."""
    seqs = [make_seq(SamplingParams(seed=seed, **params)) for seed in range(num_draws)]
    return run_sampler(logits_row.expand(num_draws, -1), seqs).token_ids


def assert_distribution(draws: list[int], expected: torch.Tensor) -> None:
    """Empirical frequencies within 5 sigma of `expected` [V]; zero-probability tokens absent."""
    counts = torch.bincount(torch.tensor(draws), minlength=expected.numel()).double()
    expected = expected.double()
    assert counts[expected == 0].sum() == 0, "a filtered token was sampled"
    frequencies = counts / len(draws)
    sigma = (expected * (1 - expected) / len(draws)).sqrt()
    assert torch.all((frequencies - expected).abs() <= 5 * sigma + 1e-12), (frequencies, expected)


def renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference nucleus: the most likely tokens until their mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    keep_sorted = (sorted_probs.cumsum(0) - sorted_probs) < top_p
    return torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)


@pytest.fixture
def logits_row() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(16, generator=generator) * 1.5  # [V=16], no ties


# --- greedy -------------------------------------------------------------------------------


def test_greedy_is_argmax_and_ignores_filters() -> None:
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3),
        SamplingParams(temperature=1e-6),
    ]
    seqs = [make_seq(params[i % 3]) for i in range(6)]
    assert run_sampler(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_mixed_with_random_rows_keep_their_argmax() -> None:
    logits = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    seqs = [
        make_seq(SamplingParams(temperature=0.0 if i % 2 else 0.9, top_k=5 if i % 4 == 0 else 0))
        for i in range(8)
    ]
    out = run_sampler(logits, seqs)
    assert out.token_ids[1::2] == logits[1::2].argmax(dim=-1).tolist()
    assert all(isinstance(t, int) for t in out.token_ids)


def test_greedy_matches_torch_argmax_on_ties_nan_and_infinities() -> None:
    x = torch.randn(7, 262144, generator=torch.Generator().manual_seed(4))
    x[1, 10] = x[1, 200000] = x[1].max() + 1  # a tie: the first wins
    x[2, 150000] = float("nan")  # a NaN wins
    x[3, 5] = x[3, 9000] = float("nan")  # the first NaN
    x[4] = float("-inf")  # all -inf: index 0
    x[5, 3] = x[5, 262143] = float("inf")
    x[6] = 0.0
    x[6, :100] = -0.0  # -0.0 == 0.0: index 0
    expected = x.argmax(dim=-1)
    assert torch.equal(greedy(x), expected)
    assert greedy_token_ids(x) == expected.tolist()
    strided = torch.randn(3, 1000, generator=torch.Generator().manual_seed(5))[:, 7:907]
    assert greedy_token_ids(strided) == strided.argmax(dim=-1).tolist()


def test_plain_greedy_rows_take_the_argmax_only_path_with_the_same_metadata() -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    seqs = [make_seq(SamplingParams(temperature=0.0, top_k=3), output=(1,)) for _ in range(3)]
    meta = SamplingMetadata.from_sequences(seqs, 64, CPU, PenaltyCounts(64, CPU))
    assert meta.greedy_only and meta.greedy_rows.tolist() == [0, 1, 2]
    assert (meta.plain, meta.filtered, meta.penalties, meta.bias) == (None,) * 4
    assert (meta.banned_rows, meta.logprob_rows, meta.num_logprobs) == (None, None, [None] * 3)
    out = Sampler()(logits, meta)
    assert out.token_ids == logits.argmax(dim=-1).tolist() and out.logprobs == [None] * 3
    # Each of these needs more than the argmax of the raw row.
    for params, eos in [
        (SamplingParams(temperature=0.0, logprobs=0), frozenset()),
        (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), frozenset()),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), frozenset()),
        (SamplingParams(temperature=0.0, min_tokens=5), frozenset({2})),
        (SamplingParams(temperature=0.5), frozenset()),
    ]:
        mixed = [*seqs[:2], make_seq(params, output=(1,), eos=eos)]
        assert not SamplingMetadata.from_sequences(mixed, 64, CPU).greedy_only


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    seqs = [
        make_seq(SamplingParams(temperature=0.7, top_p=0.8, repetition_penalty=1.3), output=(4,)),
        make_seq(SamplingParams(temperature=0.5, min_tokens=2), eos=frozenset({0})),
        make_seq(SamplingParams(temperature=1.3, logprobs=2)),
    ]
    run_sampler(logits, seqs)
    assert torch.equal(logits, before)


def test_half_precision_logits_are_accepted_and_a_wrong_shape_is_an_error() -> None:
    seqs = [make_seq(SamplingParams(temperature=0.0))]
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert run_sampler(logits.bfloat16(), seqs).token_ids == [1]
    meta = SamplingMetadata.from_sequences(seqs, 4, CPU)
    with pytest.raises(ValueError, match="logits shape"):
        Sampler()(logits, meta)


# --- distributions --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_gives_softmax_of_scaled_logits(logits_row, temperature) -> None:
    draws = seeded_draws(logits_row, temperature=temperature)
    assert_distribution(draws, torch.softmax(logits_row / temperature, dim=-1))


@pytest.mark.parametrize("top_k", [1, 4, 15])
def test_top_k_keeps_the_k_most_likely(logits_row, top_k) -> None:
    probs = torch.softmax(logits_row, dim=-1)
    keep = probs >= probs.topk(top_k).values[-1]
    assert_distribution(seeded_draws(logits_row, top_k=top_k), renormalised(probs, keep))


@pytest.mark.parametrize("top_p", [0.3, 0.75, 0.97])
def test_top_p_keeps_the_nucleus(logits_row, top_p) -> None:
    probs = torch.softmax(logits_row, dim=-1)
    keep = top_p_keep(probs, top_p)
    assert 0 < keep.sum() < 16
    assert_distribution(seeded_draws(logits_row, top_p=top_p), renormalised(probs, keep))


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_drops_tokens_below_a_fraction_of_the_top(logits_row, min_p) -> None:
    probs = torch.softmax(logits_row, dim=-1)
    keep = probs >= min_p * probs.max()
    assert_distribution(seeded_draws(logits_row, min_p=min_p), renormalised(probs, keep))


def test_filters_compose_in_vllm_order(logits_row) -> None:
    """Temperature, then top_k, then top_p on the top_k-renormalised probs, then min_p."""
    temperature, top_k, top_p, min_p = 0.8, 8, 0.85, 0.1
    probs = torch.softmax(logits_row / temperature, dim=-1)
    keep = probs >= probs.topk(top_k).values[-1]
    keep &= top_p_keep(renormalised(probs, keep), top_p)
    keep &= probs >= min_p * probs.max()
    draws = seeded_draws(logits_row, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert_distribution(draws, renormalised(probs, keep))


def test_top_p_beyond_the_candidates_falls_back_to_the_full_sort() -> None:
    """A flat row's nucleus holds hundreds of tokens, more than the first candidate pass."""
    logits_row = torch.randn(2048, generator=torch.Generator().manual_seed(4)) * 0.3
    probs = torch.softmax(logits_row, dim=-1)
    keep = top_p_keep(probs, 0.6)
    assert keep.sum() > 300
    draws = torch.tensor(seeded_draws(logits_row, num_draws=3000, top_p=0.6))
    assert keep[draws].all()
    # Kept tokens are near-uniform here: compare the mass that lands on the top half of them.
    kept_sorted = probs[keep].sort(descending=True).values
    top_half = probs >= kept_sorted[kept_sorted.numel() // 2 - 1]
    expected = renormalised(probs, keep)[top_half].sum().item()
    assert abs(top_half[draws].double().mean().item() - expected) < 0.04


def test_candidate_pass_and_full_sort_pick_the_same_token() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 4096, generator=generator) * 3  # [B, V]
    kinds = [
        dict(top_k=20),
        dict(top_p=0.9),
        dict(min_p=0.05),
        dict(top_k=3000, top_p=0.95),
        dict(temperature=0.7, top_k=40, top_p=0.8, min_p=0.01),
    ]
    seqs = [make_seq(SamplingParams(seed=i, **kinds[i % len(kinds)])) for i in range(64)]
    meta = SamplingMetadata.from_sequences(seqs, 4096, CPU)
    assert meta.filtered.num_candidates < 4096
    full_sort = dataclasses.replace(
        meta, filtered=dataclasses.replace(meta.filtered, num_candidates=4096)
    )
    sampler = Sampler()
    assert sampler(logits, meta).token_ids == sampler(logits, full_sort).token_ids


def test_a_filter_that_keeps_everything_draws_like_no_filter() -> None:
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(6))
    plain = [make_seq(SamplingParams(seed=i)) for i in range(32)]
    top_k_all = [make_seq(SamplingParams(seed=i, top_k=1000)) for i in range(32)]
    assert run_sampler(logits, plain).token_ids == run_sampler(logits, top_k_all).token_ids


# --- seeds ----------------------------------------------------------------------------------


def _mixed_batch(size: int, generator: torch.Generator) -> list[Sequence]:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9),
        dict(top_k=2500, top_p=0.99),
        dict(top_p=0.5, repetition_penalty=1.2),
        dict(min_p=0.2, logprobs=3, min_tokens=5),
    ]
    seeds = torch.randint(0, 2**40, (size,), generator=generator).tolist()
    return [
        make_seq(SamplingParams(seed=seeds[i], **kinds[i % len(kinds)]), output=(7,) * (i % 3))
        for i in range(size)
    ]


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(top_k=50, temperature=0.8)])
def test_a_seeded_draw_does_not_depend_on_the_batch(params) -> None:
    generator = torch.Generator().manual_seed(7)
    row = torch.randn(QWEN_VOCAB, generator=generator) * 2  # [V]
    alone = run_sampler(row[None], [make_seq(SamplingParams(seed=1234, **params))]).token_ids[0]
    for size, position in [(5, 3), (12, 0), (12, 11)]:
        seqs = _mixed_batch(size, generator)
        seqs[position] = make_seq(SamplingParams(seed=1234, **params))
        logits = torch.randn(size, QWEN_VOCAB, generator=generator) * 2  # [B, V]
        logits[position] = row
        assert run_sampler(logits, seqs).token_ids[position] == alone


def test_the_same_seed_and_step_repeat_and_other_steps_differ() -> None:
    logits = torch.zeros(1, 4096)  # uniform: every draw is a fresh 1-in-4096 pick
    params = SamplingParams(seed=99, max_tokens=None)
    draws = [
        run_sampler(logits, [make_seq(params, output=(5,) * step)]).token_ids[0]
        for step in range(8)
    ]
    again = [
        run_sampler(logits, [make_seq(params, output=(5,) * step)]).token_ids[0]
        for step in range(8)
    ]
    assert draws == again
    assert len(set(draws)) >= 7


def test_samples_of_one_seeded_request_differ_by_index() -> None:
    logits = torch.zeros(4, 4096)
    seqs = [make_seq(SamplingParams(n=4, seed=5), index=i) for i in range(4)]
    assert len(set(run_sampler(logits, seqs).token_ids)) == 4


def test_noise_is_a_pure_function_of_key_and_token() -> None:
    vocab_hash = hash32_(torch.arange(64))
    keys = torch.tensor([noise_key(3, 0), noise_key(3, 1), noise_key(4, 0)])
    noise = exponential_noise(keys, vocab_hash)  # [3, 64]
    assert torch.equal(noise[1:2], exponential_noise(keys[1:2], vocab_hash))
    assert torch.equal(noise[:, 10:20], exponential_noise(keys, vocab_hash[10:20]))
    assert (noise > 0).all() and torch.isfinite(noise).all()
    large = exponential_noise(torch.tensor([noise_key(0, 0)]), hash32_(torch.arange(QWEN_VOCAB)))
    assert abs(large.mean().item() - 1.0) < 0.01
    assert abs((large > 1.0).double().mean().item() - torch.e**-1) < 0.005


# --- penalties and min_tokens ---------------------------------------------------------------


def reference_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    expected = logits.clone()
    for row, seq in enumerate(seqs):
        params = seq.sampling_params
        for token_id in set(seq.token_ids):
            value = expected[row, token_id]
            p = params.repetition_penalty
            expected[row, token_id] = value / p if value > 0 else value * p
        for token_id in set(seq.output_token_ids):
            count = seq.output_token_ids.count(token_id)
            expected[row, token_id] -= params.frequency_penalty * count + params.presence_penalty
    return expected


def test_penalties_match_the_reference_formulas() -> None:
    logits = torch.randn(4, 24, generator=torch.Generator().manual_seed(8)) * 3
    seqs = [
        make_seq(SamplingParams(repetition_penalty=1.5), prompt=(1, 2, 2), output=(3, 3, 4)),
        make_seq(SamplingParams(temperature=0.0)),
        make_seq(SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4), output=(5, 5, 5, 6)),
        make_seq(
            SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0),
            prompt=(9, 10, 11),
            output=(10, 12, 12),
        ),
    ]
    meta = SamplingMetadata.from_sequences(seqs, 24, CPU)
    penalised = logits.clone()
    apply_penalties_(penalised, meta.penalties)
    torch.testing.assert_close(penalised, reference_penalties(logits, seqs))


def test_penalties_change_the_greedy_choice_and_skip_unpenalised_batches() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    repeated = make_seq(SamplingParams(temperature=0.0, presence_penalty=0.5), output=(1,))
    assert run_sampler(logits, [repeated]).token_ids == [2]
    plain = make_seq(SamplingParams(temperature=0.0), output=(1,))
    assert SamplingMetadata.from_sequences([plain], 4, CPU).penalties is None


def test_logit_bias_moves_the_greedy_choice_and_leaves_logprobs_raw() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    unbiased = make_seq(SamplingParams(temperature=0.0))
    assert run_sampler(logits, [unbiased]).token_ids == [1]
    nudged = make_seq(SamplingParams(temperature=0.0, logit_bias={2: 0.2}, logprobs=0))
    banned = make_seq(SamplingParams(temperature=0.0, logit_bias={1: -100.0, 2: -100.0}))
    out = run_sampler(logits.expand(3, -1), [nudged, banned, unbiased])
    assert out.token_ids == [2, 0, 1]  # row 1: tokens 0 and 3 tie; argmax takes the first
    raw = torch.log_softmax(logits[0], dim=-1)[2].item()
    assert out.logprobs[0].logprob == pytest.approx(raw, abs=1e-6)
    assert torch.equal(logits, torch.tensor([[0.0, 3.0, 2.9, 0.0]]))


def test_logit_bias_past_the_vocabulary_is_ignored_and_random_rows_follow_it() -> None:
    past = make_seq(SamplingParams(temperature=0.0, logit_bias={4: 100.0, 99: 100.0}))
    assert SamplingMetadata.from_sequences([past], 4, CPU).bias is None
    logits = torch.zeros(200, 8)
    seqs = [make_seq(SamplingParams(seed=i, logit_bias={5: 100.0})) for i in range(200)]
    assert set(run_sampler(logits, seqs).token_ids) == {5}


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 7.0]])  # EOS=2, stop token 3, then 4
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    eos = frozenset({2})
    assert run_sampler(logits, [make_seq(params, output=(0, 0), eos=eos)]).token_ids == [4]
    assert run_sampler(logits, [make_seq(params, output=(0, 0, 0), eos=eos)]).token_ids == [2]
    ignore_eos = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert run_sampler(logits, [make_seq(ignore_eos, eos=eos)]).token_ids == [2]


def test_min_tokens_holds_for_random_rows() -> None:
    logits = torch.tensor([[5.0, 5.0, 5.0, 0.0]]).expand(500, -1)  # EOS=1 takes a third
    seqs = [
        make_seq(SamplingParams(seed=i, min_tokens=1), eos=frozenset({1}), prompt=(0,))
        for i in range(500)
    ]
    assert 1 not in run_sampler(logits, seqs).token_ids


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top_and_rank() -> None:
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(9)) * 2
    seqs = [
        make_seq(SamplingParams(seed=1, temperature=0.6, logprobs=5, repetition_penalty=2.0)),
        make_seq(SamplingParams(temperature=0.7)),
        make_seq(SamplingParams(seed=2, top_k=10, logprobs=0)),
    ]
    out = run_sampler(logits, seqs)
    assert out.logprobs[1] is None
    reference = torch.log_softmax(logits, dim=-1)
    for row in (0, 2):
        entry = out.logprobs[row]
        assert isinstance(entry, TokenLogprobs)
        token_id = out.token_ids[row]
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(reference[row, token_id].item(), abs=1e-5)
        assert entry.rank == 1 + int((reference[row] > reference[row, token_id]).sum())
        k = seqs[row].sampling_params.logprobs
        values, ids = reference[row].topk(k)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)


def test_greedy_logprob_rank_is_one() -> None:
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(10))
    out = run_sampler(logits, [make_seq(SamplingParams(temperature=0.0, logprobs=3))] * 2)
    assert [entry.rank for entry in out.logprobs] == [1, 1]
    assert [entry.top[0][0] for entry in out.logprobs] == out.token_ids


# --- params validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("logprobs", 21),
        ("n", 0),
        ("min_tokens", -1),
        ("temperature", float("inf")),
        ("repetition_penalty", float("inf")),
        ("min_p", float("nan")),
        ("logit_bias", {1: 100.5}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: float("nan")}),
        ("prompt_logprobs", 21),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
