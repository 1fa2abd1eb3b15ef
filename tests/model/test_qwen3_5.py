"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) through the real engine equals transformers:
last-position logits and 32-token greedy continuations, under chunked prefill, mixed
prefill/decode batches, prefix-cache hits resumed from state snapshots, preemption and n > 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from axon import LLM, SamplingParams
from axon.layers.forward_context import PrefillChunk
from axon.layers.linear_attention import GatedDeltaNet

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
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    # Recomputation after a preemption counts in neither counter: each prompt token is computed
    # once (unless a real prefix hit), each sampled token generated once.
    assert stats["num_prompt_tokens"] == sum(map(len, prompts)) - stats["prefix_cache_hits"]
    assert stats["num_generation_tokens"] == MAX_TOKENS * len(prompts)


# ---- snapshots taken inside a prefill chunk --------------------------------------------------

SNAPSHOT_PROMPT_LENGTH = 70  # crosses 8 boundaries of 8 tokens (4-token blocks, stride 2)


def _snapshot_llm(tiny: TinyModel, budget: int) -> LLM:
    return _llm(
        tiny,
        block_size=4,
        state_snapshot_stride=2,
        max_num_batched_tokens=budget,
        num_state_snapshots=16,
    )


def _snapshots(llm: LLM) -> dict[int, list[torch.Tensor]]:
    """Block hash -> every GDN layer's (conv state, recurrent state) held for it."""
    runner = llm.engine.runner
    base = runner.plan.num_state_slots
    return {
        block_hash: [
            t for layer in runner._gdn_layers() for t in (layer.conv_state[base + index],
                                                          layer.recurrent_state[base + index])
        ]
        for block_hash, index in llm.engine.state_slots.snapshots.items()
    }  # fmt: skip


def test_snapshots_taken_inside_a_chunk_equal_those_of_chunks_cut_there(tiny):
    prompt = random_prompt(SNAPSHOT_PROMPT_LENGTH, 301)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    whole = _snapshot_llm(tiny, budget=128)
    whole.engine.add_request("p", prompt, params)
    (update,) = whole.engine.step()  # the whole prompt in one step, not cut at 8, 16, ...
    assert update.token_id is not None
    cut = _snapshot_llm(tiny, budget=8)  # every chunk ends on a boundary
    _generate(cut, [prompt], params)

    got, want = _snapshots(whole), _snapshots(cut)
    assert len(got) == SNAPSHOT_PROMPT_LENGTH // 8
    assert got.keys() == want.keys()
    for block_hash, states in got.items():
        for a, b in zip(states, want[block_hash]):
            # Not bit-exact only because the projections run over batches of other sizes: an ulp
            # or two in the first GDN layer (~2e-7), compounded over the next two; a snapshot of
            # the wrong position would differ by O(1). The GDN split itself is exact (below).
            diff, scale = float((a - b).abs().max()), float(b.abs().max())
            assert diff <= 1e-5 * scale, f"max abs diff {diff:.3e} of {scale:.3e}"


@torch.no_grad()
def test_a_gdn_chunk_split_at_its_snapshots_equals_chunks_cut_there():
    """Bit-exact: the states a layer leaves in snapshot rows inside a chunk are those it leaves
    in the slot when the chunk is cut there (from a non-zero state, with a segment longer than
    the delta rule's 64-token chunk)."""
    config = SimpleNamespace(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=4,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )
    layer = GatedDeltaNet(config)
    generator = torch.Generator().manual_seed(7)
    for param in layer.parameters():
        param.copy_(torch.randn(param.shape, generator=generator))
    conv, recurrent = layer.state_shapes()
    # Rows: 0 the split path's slot, 1-2 its snapshots, 3 the cut path's slot.
    layer.conv_state = torch.randn(4, *conv, generator=generator)
    layer.recurrent_state = torch.randn(4, *recurrent, generator=generator)
    layer.conv_state[3], layer.recurrent_state[3] = layer.conv_state[0], layer.recurrent_state[0]
    length, cuts = 150, (10, 90)
    mixed = torch.randn(length, layer.conv_dim, generator=generator)
    g = -torch.rand(length, layer.num_v_heads, generator=generator)
    beta = torch.rand(length, layer.num_v_heads, generator=generator)

    def chunk(start: int, end: int, slot: int, saves=()) -> PrefillChunk:
        keys = torch.arange(end)
        return PrefillChunk(0, end - start, end, keys, slot, True, list(saves))

    split = layer._prefill(chunk(0, length, 0, [(cuts[0], 1), (cuts[1], 2)]), mixed, g, beta)
    outs, states = [], []
    for start, end in zip((0, *cuts), (*cuts, length)):
        rows = slice(start, end)
        outs.append(layer._prefill(chunk(start, end, 3), mixed[rows], g[rows], beta[rows]))
        states.append((layer.conv_state[3].clone(), layer.recurrent_state[3].clone()))
    assert torch.equal(split, torch.cat(outs))
    for row, (conv_state, recurrent_state) in zip((1, 2, 0), states):
        assert torch.equal(layer.conv_state[row], conv_state)
        assert torch.equal(layer.recurrent_state[row], recurrent_state)


def test_prefix_hits_resume_from_snapshots_taken_inside_a_chunk(tiny):
    prompt = random_prompt(SNAPSHOT_PROMPT_LENGTH, 302)
    llm = _snapshot_llm(tiny, budget=128)
    _assert_greedy(tiny, [prompt], _generate(llm, [prompt]))
    follow_ups = [
        prompt[:k] + suffix for k, suffix in zip((20, 43, 70), random_prompts((5,) * 3, 303))
    ]
    before = llm.get_stats()

    outputs = _generate(llm, follow_ups)

    after = llm.get_stats()
    _assert_greedy(tiny, follow_ups, outputs)
    # Each resumes from the last snapshot inside its cached prefix: after 16, 40 and 64 tokens.
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 16 + 40 + 64
    assert after["state_snapshot_restores"] - before["state_snapshot_restores"] == 3


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
    engine.add_request("a", random_prompt(30, 5), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    assert engine.state_slots.num_free_slots == 1
    engine.abort(["a"])
    assert engine.state_slots.num_free_slots == 2


def test_text_load_skips_vision_and_mtp(tiny_model_root):
    tiny = get_qwen3_5("qwen3_5", tiny_model_root)  # the multimodal checkpoint
    llm = _llm(tiny, enable_vision=False)
    names = {name for name, _ in llm.engine.runner.model.named_parameters()}
    assert not any("visual" in n or n.startswith("mtp") for n in names)
    assert torch.equal(
        llm.engine.runner.model.model.embed_tokens.weight,
        tiny.hf_model.model.language_model.embed_tokens.weight,
    )
