"""Speculative decoding is exact: with drafts, greedy and seeded output is token for token the
output without them, on tiny random models of every family, with chunked prefill, prefix hits,
preemption, n > 1, max_tokens and stop tokens inside a draft; unseeded sampling keeps the
target's distribution (a chi-square test that an always-accept rule fails).

Random tiny models rarely repeat their prompt, so besides the n-gram drafter the tests use an
oracle drafter: it proposes what the engine without drafts answered, with one token wrong in
every other draft, so that every step sees accepted and rejected drafts alike."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen3MoeForCausalLM

from axon import LLM, SamplingParams
from axon.config import EngineConfig
from axon.engine.client import EngineClient
from tests.model.qwen3_5_tiny import cache_bytes, get_qwen3_5, qwen3_5_engine_kwargs
from tests.model.test_moe import write_moe
from tests.model.tiny_models import (
    TinyModel,
    _perturb,
    engine_kwargs,
    get_tiny_model,
    random_prompts,
    write_checkpoint,
)
from tiny_configs import make_config, moe_config

ARCHS = ("qwen3", "llama", "gemma3_text", "qwen3_moe")
K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@torch.no_grad()
def _moe_checkpoint(root) -> TinyModel:
    config = moe_config("qwen3_moe")
    config.moe_intermediate_size = 64
    config._attn_implementation = "eager"
    torch.manual_seed(21)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    _perturb(model, torch.Generator().manual_seed(22))
    return TinyModel("qwen3_moe", write_moe(model, root / "spec-qwen3_moe", fused=True), model)


def _tiny(arch: str, root) -> TinyModel:
    return _moe_checkpoint(root) if arch == "qwen3_moe" else get_tiny_model(arch, root)


class OracleDrafter:
    """Proposes the reference answer's next tokens (by prompt and sample index), every other
    proposal with its middle token off by one: drafts accepted, partly and fully, and rejected."""

    def __init__(self, answers: dict[tuple, list[int]], vocab_size: int, longer: bool = False):
        self.answers = answers
        self.vocab_size = vocab_size
        self.longer = longer  # propose more than asked (the engine must cap it)
        self.calls = 0

    def propose(self, seqs, max_tokens):
        drafts = []
        for seq, limit in zip(seqs, max_tokens):
            answer = self.answers[(tuple(seq.prompt_token_ids), seq.index)]
            done = seq.num_output_tokens
            draft = list(answer[done : done + limit + (3 if self.longer else 0)])
            self.calls += 1
            if self.calls % 2 and draft:
                middle = len(draft) // 2
                draft[middle] = (draft[middle] + 1) % self.vocab_size
            drafts.append(draft)
        return drafts

    def release(self, seq_ids):
        pass


def _requests(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _answers(outputs) -> dict[tuple, list[int]]:
    return {(tuple(o.prompt_token_ids), c.index): c.token_ids for o in outputs for c in o.outputs}


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _use_oracle(llm: LLM, reference, **kwargs) -> OracleDrafter:
    oracle = OracleDrafter(_answers(reference), llm.engine.runner.vocab_size, **kwargs)
    llm.engine.speculator.drafter = oracle
    return oracle


def _spec_stats(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]


@pytest.fixture(scope="module", params=ARCHS)
def engines(request, tiny_model_root):
    """(without drafts, with n-gram drafts) on one arch: chunked prefill (a 16-token budget)
    over 4-token blocks, prefix caching on."""
    tiny = _tiny(request.param, tiny_model_root)
    kwargs = engine_kwargs(tiny, block_size=4, max_num_batched_tokens=16)
    base = LLM(**kwargs)
    spec = LLM(**kwargs, speculative_config=NGRAM)
    return base, spec


def _repeating_prompts(seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, of different lengths, two sharing a prefix."""
    short, medium, long = random_prompts((3, 7, 11), seed=seed)
    return [short * 4, medium * 3, long * 2 + short, long * 2 + medium]


def test_greedy_ngram_is_exact(engines):
    base, spec = engines
    prompts = _repeating_prompts(seed=1)
    expected = _tokens(base.generate(_requests(prompts), GREEDY))
    before = spec.engine.stats()["prefix_cache_hits"]
    assert _tokens(spec.generate(_requests(prompts), GREEDY)) == expected
    assert _tokens(spec.generate(_requests(prompts), GREEDY)) == expected  # prefix hits
    assert spec.engine.stats()["prefix_cache_hits"] > before
    assert _spec_stats(spec)[0] > 0


def test_greedy_with_accepted_and_rejected_drafts_is_exact(engines):
    base, spec = engines
    prompts = random_prompts((5, 18, 9, 30), seed=2)
    reference = base.generate(_requests(prompts), GREEDY)
    _use_oracle(spec, reference)
    drafted, accepted = _spec_stats(spec)
    assert _tokens(spec.generate(_requests(prompts), GREEDY)) == _tokens(reference)
    new_drafted, new_accepted = _spec_stats(spec)
    assert new_accepted > accepted  # some drafts accepted ...
    assert new_drafted - drafted > new_accepted - accepted  # ... and some rejected


def test_seeded_sampling_and_n_samples_are_exact(engines):
    base, spec = engines
    prompts = random_prompts((6, 13), seed=3)
    params = SamplingParams(n=3, temperature=1.0, top_k=40, seed=7, max_tokens=16, ignore_eos=True)
    reference = base.generate(_requests(prompts), params)
    _use_oracle(spec, reference)
    _, accepted = _spec_stats(spec)
    assert _tokens(spec.generate(_requests(prompts), params)) == _tokens(reference)
    assert _spec_stats(spec)[1] > accepted


def test_max_tokens_and_stop_tokens_inside_a_draft(engines):
    base, spec = engines
    prompts = random_prompts((8, 12), seed=4)
    reference = base.generate(_requests(prompts), GREEDY)
    _use_oracle(spec, reference, longer=True)  # drafts run past max_tokens unless capped
    short = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    out = spec.generate(_requests(prompts), short)
    assert _tokens(out) == [[r.outputs[0].token_ids[:7]] for r in reference]
    assert all(o.outputs[0].finish_reason == "length" for o in out)
    answer = reference[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(answer) if i >= 5 and t not in answer[:i])
    at = answer.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
    (first,) = spec.generate(_requests(prompts[:1]), params)
    assert first.outputs[0].token_ids == answer[: at + 1]
    assert (first.outputs[0].finish_reason, first.outputs[0].stop_reason) == ("stop", stop)
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks


def test_logprobs_of_accepted_tokens_come_from_the_target(engines):
    base, spec = engines
    prompts = random_prompts((9,), seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    (reference,) = base.generate(_requests(prompts), params)
    _use_oracle(spec, [reference])
    (out,) = spec.generate(_requests(prompts), params)
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    for got, want in zip(out.outputs[0].logprobs, reference.outputs[0].logprobs):
        assert sorted(got) == sorted(want)
        for token, entry in want.items():
            assert got[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
            assert got[token].rank == entry.rank


def test_preemption_with_drafts_is_exact(tiny_model_root):
    tiny = get_tiny_model("qwen3", tiny_model_root)
    kwargs = engine_kwargs(
        tiny, block_size=4, kv_cache_blocks=24, max_num_batched_tokens=16, max_model_len=64
    )
    prompts = random_prompts((20, 17, 22, 15), seed=6)
    reference = LLM(**kwargs).generate(_requests(prompts), GREEDY)
    spec = LLM(**kwargs, speculative_config=NGRAM)
    spec.engine.speculator.max_seqs = 8  # draft for every running sequence, at every step
    spec.engine.speculator.row_cost = 0.0
    _use_oracle(spec, reference)
    assert _tokens(spec.generate(_requests(prompts), GREEDY)) == _tokens(reference)
    stats = spec.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_load_log_and_update_totals(tiny_model_root, caplog):
    tiny = get_tiny_model("llama", tiny_model_root)
    with caplog.at_level("INFO", logger="axon.engine.engine_core"):
        spec = LLM(**engine_kwargs(tiny, block_size=4), speculative_config=NGRAM)
    assert any("speculative decoding: ngram, k=4" in r.getMessage() for r in caplog.records)
    prompts = random_prompts((10,), seed=8)
    reference = LLM(**engine_kwargs(tiny, block_size=4)).generate(_requests(prompts), GREEDY)
    _use_oracle(spec, reference)
    engine = spec.engine
    engine.add_request("r", prompts[0], GREEDY)
    updates = []
    while engine.has_unfinished():
        updates.extend(engine.step())
    tokens = [u.token_id for u in updates if u.token_id is not None]
    assert tokens == reference[0].outputs[0].token_ids
    assert [u.finish_reason for u in updates].count("length") == 1
    assert updates[-1].finish_reason == "length"
    last = updates[-1]
    assert last.num_draft_tokens > last.num_accepted_tokens > 0
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] == last.num_draft_tokens
    assert sum(stats["spec_accepted_per_position"]) == last.num_accepted_tokens
    assert len(stats["spec_accepted_per_position"]) == K


# ---- the target's distribution: a chi-square test on a tiny vocabulary -------------------------

SMALL_VOCAB = 12
NUM_SAMPLES = 192  # sequences per engine
SAMPLED_TOKENS = 8
# 11 degrees of freedom: p < 1e-4 under the null hypothesis. These seeds give 14.1; a rule that
# accepts every draft gives 176.
CHI2_BOUND = 40.0


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    torch.manual_seed(5)
    config = make_config("llama")
    config.vocab_size = SMALL_VOCAB
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    path = write_checkpoint(model, tmp_path_factory.mktemp("spec-vocab") / "llama")
    return TinyModel("llama", path, model)


def _histogram(llm: LLM, first_seed: int) -> torch.Tensor:
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]  # a draft to propose at every step
    params = [
        SamplingParams(temperature=1.0, seed=first_seed + i, max_tokens=SAMPLED_TOKENS,
                       ignore_eos=True)
        for i in range(NUM_SAMPLES)
    ]  # fmt: skip
    outputs = llm.generate(_requests([prompt] * NUM_SAMPLES), params)
    tokens = torch.tensor([t for o in outputs for t in o.outputs[0].token_ids[1:]])
    return torch.bincount(tokens, minlength=SMALL_VOCAB).float()


def test_sampling_keeps_the_target_distribution(small_vocab_model):
    kwargs = engine_kwargs(small_vocab_model, block_size=4, max_num_seqs=64)
    base = _histogram(LLM(**kwargs), first_seed=0)
    spec = LLM(**kwargs, speculative_config=NGRAM)
    spec.engine.speculator.max_seqs = 64  # draft at every step, however many run
    spec.engine.speculator.row_cost = 0.0
    drafted = _histogram(spec, first_seed=100_000)  # other seeds: independent samples
    stats = spec.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0.1 * stats["spec_num_draft_tokens"] > 0
    # Two-sample chi-square over the tokens both runs saw.
    seen = (base + drafted) > 0
    a, b = base[seen], drafted[seen]
    scale_a, scale_b = (b.sum() / a.sum()).sqrt(), (a.sum() / b.sum()).sqrt()
    chi2 = ((scale_a * a - scale_b * b) ** 2 / (a + b)).sum().item()
    assert chi2 < CHI2_BOUND, (chi2, base.tolist(), drafted.tolist())


# ---- hybrid (Gated DeltaNet) models: the recurrent state rolled back to the last accepted draft


def test_hybrid_qwen3_5_is_exact(tiny_model_root):
    tiny = get_qwen3_5("qwen3_5_text", tiny_model_root)
    kwargs = qwen3_5_engine_kwargs(tiny, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    base = LLM(**kwargs)
    rows = 4 + 4 + K * 4  # slots, snapshots, the drafts' scratch rows
    kwargs["kv_cache_memory"] = cache_bytes(tiny, 256, 4, rows)
    spec = LLM(**kwargs, speculative_config=NGRAM)
    prompts = _repeating_prompts(seed=9)
    expected = _tokens(base.generate(_requests(prompts), GREEDY))
    assert _tokens(spec.generate(_requests(prompts), GREEDY)) == expected
    reference = base.generate(_requests(prompts), GREEDY)
    _use_oracle(spec, reference)
    drafted, accepted = _spec_stats(spec)
    assert _tokens(spec.generate(_requests(prompts), GREEDY)) == expected  # prefix hits too
    new_drafted, new_accepted = _spec_stats(spec)
    assert new_accepted > accepted and new_drafted - drafted > new_accepted - accepted
    assert spec.engine.stats()["state_snapshot_restores"] > 0


def test_tensor_parallel_drafts_are_exact(tiny_model_root):
    """TP=2 (a real rank-1 process): the verify rows are one more flat batch to the ranks."""
    tiny = get_tiny_model("qwen3", tiny_model_root)
    kwargs = engine_kwargs(tiny, block_size=4, max_num_batched_tokens=16)
    prompts = _repeating_prompts(seed=10)
    reference = LLM(**kwargs).generate(_requests(prompts), GREEDY)
    pair = LLM(**kwargs, tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        _use_oracle(pair, reference)
        assert _tokens(pair.generate(_requests(prompts), GREEDY)) == _tokens(reference)
        assert _spec_stats(pair)[1] > 0
    finally:
        pair.engine.close()


def test_mtp_without_mtp_weights_is_a_load_error_that_says_why(tiny_model_root):
    tiny = get_tiny_model("qwen3", tiny_model_root)
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="mtp.* weights"):
        LLM(**engine_kwargs(tiny), speculative_config=mtp)


def test_engine_process_streams_every_accepted_token(tiny_model_root):
    """Through the engine process and its pipe: one update per kept token, the running
    totals on each, the statistics in the `stats` reply."""
    tiny = get_tiny_model("qwen3", tiny_model_root)  # its greedy answers repeat themselves
    kwargs = engine_kwargs(tiny, block_size=4)
    prompt = _repeating_prompts(seed=11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    (expected,) = LLM(**kwargs).generate(_requests([prompt]), params)
    model = kwargs.pop("model")
    config = EngineConfig.from_kwargs(model, speculative_config=NGRAM, **kwargs)

    async def main():
        client = await EngineClient.start(config)
        try:
            updates = [u async for u in client.generate("r", prompt, params)]
            return updates, await client.call("stats")
        finally:
            await client.shutdown()

    updates, stats = asyncio.run(main())
    assert [u.token_id for u in updates] == expected.outputs[0].token_ids
    assert updates[-1].num_accepted_tokens == stats["spec_num_accepted_tokens"] > 0
    assert updates[-1].num_draft_tokens == stats["spec_num_draft_tokens"]
