"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) through the real engine equals transformers:
last-position logits and 32-token greedy continuations, under chunked prefill, mixed
prefill/decode batches, prefix-cache hits resumed from state snapshots, preemption and n > 1."""

from __future__ import annotations

import pytest
import torch

from axon import LLM, SamplingParams

from .qwen3_5_tiny import QWEN3_5_ARCHS, get_qwen3_5, qwen3_5_engine_kwargs
from .tiny_models import VOCAB_SIZE, TinyModel, random_prompt, random_prompts

ATOL = 1e-4
MAX_TOKENS = 32
MIN_REFERENCE_MARGIN = 1e-3
LOGIT_LENGTHS = (1, 5, 17, 33, 40, 64, 70)
GREEDY_LENGTHS = (1, 5, 17, 33, 40)
PROMPT_SEED = 3
GREEDY_SEED = 11
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=QWEN3_5_ARCHS)
def tiny(request, tiny_model_root):
    return get_qwen3_5(request.param, tiny_model_root)


def _llm(tiny: TinyModel, **overrides) -> LLM:
    return LLM(**qwen3_5_engine_kwargs(tiny, **overrides))


def _generate(llm: LLM, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _assert_greedy(tiny: TinyModel, prompts, outputs) -> None:
    failures = []
    for prompt, output in zip(prompts, outputs):
        ref = tiny.greedy(prompt, MAX_TOKENS)
        assert ref.min_margin > MIN_REFERENCE_MARGIN, f"near-tie for prompt of {len(prompt)}"
        for completion in output.outputs:
            got = list(completion.token_ids)
            if got != ref.token_ids:
                step = next((i for i, (a, b) in enumerate(zip(got, ref.token_ids)) if a != b), 0)
                failures.append(f"prompt of {len(prompt)}: first differs at step {step}")
    assert not failures, f"{tiny.arch}: " + "; ".join(failures)


@pytest.mark.parametrize(
    ("block_size", "max_num_batched_tokens", "stride"),
    [(16, None, 1), (4, 16, 1), (4, 13, 3)],
    ids=["default-budget", "chunked-block4", "chunked-odd-budget-stride3"],
)
def test_last_logits_match_transformers(tiny, block_size, max_num_batched_tokens, stride):
    overrides = {"state_snapshot_stride": stride}
    if max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = max_num_batched_tokens
    llm = _llm(tiny, block_size=block_size, **overrides)
    prompts = random_prompts(LOGIT_LENGTHS, PROMPT_SEED)

    got = llm.compute_logits(prompts)

    failures = []
    for prompt, logits in zip(prompts, got):
        assert logits.shape == (VOCAB_SIZE,)
        diff = float((logits - tiny.last_logits(prompt)).abs().max())
        if not diff <= ATOL:
            failures.append(f"prompt of {len(prompt)}: max abs diff {diff:.3e}")
    assert not failures, f"{tiny.arch}: " + "; ".join(failures)


def test_logits_without_prefix_caching(tiny):
    """No snapshots, no chunk cutting: the plain chunked path alone."""
    llm = _llm(tiny, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    prompts = random_prompts(LOGIT_LENGTHS, PROMPT_SEED)
    for prompt, logits in zip(prompts, llm.compute_logits(prompts)):
        assert float((logits - tiny.last_logits(prompt)).abs().max()) <= ATOL


@pytest.mark.parametrize(
    ("block_size", "max_num_batched_tokens"),
    [(16, None), (4, 16)],
    ids=["default-budget", "chunked-mixed-batches"],
)
def test_greedy_matches_transformers(tiny, block_size, max_num_batched_tokens):
    """Five concurrent prompts of different lengths; under a 16-token budget the short ones
    decode while the long ones are still prefilling, in the same batches."""
    overrides = {}
    if max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = max_num_batched_tokens
    llm = _llm(tiny, block_size=block_size, **overrides)
    prompts = random_prompts(GREEDY_LENGTHS, GREEDY_SEED)
    _assert_greedy(tiny, prompts, _generate(llm, prompts))


def test_greedy_same_with_and_without_prefix_cache_hits(tiny):
    block_size = 4
    prefix = random_prompt(22, 101)
    first, *batch = [prefix + s for s in random_prompts((6, 3, 9, 17, 1), 101)]
    # Stride 1 over 4-token blocks: room for every boundary's snapshot, so LRU evicts none.
    llm = _llm(tiny, block_size=block_size, max_num_batched_tokens=32, num_state_snapshots=64)
    _assert_greedy(tiny, [first], _generate(llm, [first]))
    before = llm.get_stats()

    outputs = _generate(llm, batch)

    after = llm.get_stats()
    _assert_greedy(tiny, batch, outputs)
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    restores = after["state_snapshot_restores"] - before["state_snapshot_restores"]
    assert restores >= len(batch), f"{tiny.arch}: {restores} state restores"
    assert hits >= 20 * len(batch), f"{tiny.arch}: {hits} prefix-cache hit tokens"
    cold = _llm(tiny, block_size=block_size, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in _generate(cold, batch)] == [
        o.outputs[0].token_ids for o in outputs
    ]


def test_resume_from_snapshot_of_generated_tokens(tiny):
    """A follow-up turn whose prompt is a previous prompt + its output resumes from a snapshot
    taken while decoding."""
    llm = _llm(tiny, block_size=4, num_state_snapshots=16)
    prompt = random_prompt(9, 202)
    turn = _generate(llm, [prompt])[0].outputs[0].token_ids
    follow_up = prompt + list(turn) + random_prompt(3, 203)
    before = llm.get_stats()["prefix_cache_hits"]
    out = _generate(llm, [follow_up])
    assert llm.get_stats()["prefix_cache_hits"] - before >= 36
    _assert_greedy(tiny, [follow_up], out)


def test_greedy_under_preemption(tiny):
    prompts = random_prompts(GREEDY_LENGTHS, GREEDY_SEED)
    llm = _llm(tiny, block_size=16, kv_cache_blocks=8, max_model_len=96)
    _assert_greedy(tiny, prompts, _generate(llm, prompts))
    assert llm.get_stats()["num_preemptions"] > 0


def test_more_prompts_than_state_slots(tiny):
    """Admission waits for a free slot; finished sequences give theirs back."""
    prompts = random_prompts(GREEDY_LENGTHS, GREEDY_SEED)
    llm = _llm(tiny, block_size=4, max_num_seqs=2)
    _assert_greedy(tiny, prompts, _generate(llm, prompts))
    assert llm.engine.state_slots.num_free_slots == 2


def test_n_samples_share_the_prompt(tiny):
    prompt = random_prompts(GREEDY_LENGTHS, GREEDY_SEED)[3]
    llm = _llm(tiny, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    (output,) = _generate(llm, [prompt], params)
    assert len(output.outputs) == 3
    _assert_greedy(tiny, [prompt], [output])


def test_abort_frees_the_slot(tiny):
    llm = _llm(tiny, block_size=4, max_num_seqs=2)
    engine = llm.engine
    engine.add_request("a", random_prompt(30, 5), SamplingParams(max_tokens=8))
    engine.step()
    assert engine.state_slots.num_free_slots == 1
    engine.abort(["a"])
    assert engine.state_slots.num_free_slots == 2


def test_text_load_skips_vision_and_mtp(tiny_model_root):
    tiny = get_qwen3_5("qwen3_5", tiny_model_root)  # the multimodal checkpoint
    llm = _llm(tiny)
    names = {name for name, _ in llm.engine.runner.model.named_parameters()}
    assert not any("visual" in n or n.startswith("mtp") for n in names)
    assert torch.equal(
        llm.engine.runner.model.model.embed_tokens.weight,
        tiny.hf_model.model.language_model.embed_tokens.weight,
    )
