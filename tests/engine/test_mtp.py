"""Qwen3.5's MTP block as the speculative drafter (speculative_config method mtp), on tiny
random dense and MoE checkpoints with an `mtp.*` block: the block equals a reference composed
from transformers' modules; the drafter's proposals, with its cache fed from the target's hidden
states and rolled back with the target, equal the reference recomputed from scratch on the
accepted tokens; output with MTP drafts is the output without them, token for token."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from axon import LLM, SamplingParams
from axon.layers.forward_context import PrefillChunk
from axon.models import qwen3_5_mtp
from tests.model.qwen3_5_mtp_tiny import MTP_ARCHS, get_mtp_model
from tests.model.qwen3_5_tiny import cache_bytes, qwen3_5_engine_kwargs
from tests.model.tiny_models import random_prompts

K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=16, ignore_eos=True)


def _kwargs(tiny, kv_cache_blocks: int = 256, **overrides) -> dict:
    """Chunked prefill (a 16-token budget) over 4-token blocks, prefix caching on; room for
    the drafts' recurrent-state rows."""
    kwargs = qwen3_5_engine_kwargs(
        tiny, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, **overrides
    )
    rows = 4 + 4 + K * 4  # slots, snapshots, the drafts' scratch rows
    kwargs["kv_cache_memory"] = cache_bytes(tiny, kv_cache_blocks, 4, rows)
    return kwargs


def _requests(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _prompts(seed: int) -> list[list[int]]:
    """Lengths across the 16-token chunk budget; the last two share a 12-token prefix."""
    short, medium, long = random_prompts((5, 12, 23), seed=seed)
    return [short, long, medium + short, medium + long]


class _Recorder:
    """Wraps the drafter's propose: (the sequence's tokens, its drafts) of every proposal."""

    def __init__(self, drafter):
        self.drafter, self.calls = drafter, []
        self._propose = drafter.propose
        drafter.propose = self

    def __call__(self, seqs, max_tokens):
        drafts = self._propose(seqs, max_tokens)
        self.calls.extend((list(s.token_ids), d) for s, d in zip(seqs, drafts) if d)
        return drafts


@pytest.fixture(scope="module", params=MTP_ARCHS)
def mtp_model(request, tiny_model_root):
    return get_mtp_model(request.param, tiny_model_root)


@pytest.fixture(scope="module")
def engines(mtp_model):
    tiny, _ = mtp_model
    return LLM(**_kwargs(tiny)), LLM(**_kwargs(tiny), speculative_config=MTP)


def test_mtp_block_matches_the_transformers_reference(mtp_model, engines):
    _, reference = mtp_model
    drafter = engines[1].engine.speculator.drafter
    length = 9
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(length, reference.fc.in_features // 2, generator=generator)
    tokens = torch.randint(0, drafter.vocab_size, (length,), generator=generator).tolist()
    slots = torch.arange(length)  # the engine is idle: any of its slots
    with torch.inference_mode():
        got = drafter._run(tokens, list(range(length)), slots, [PrefillChunk(0, length, length,
                           slots)], hidden)  # fmt: skip
        logits = drafter.runner.model.compute_logits(got)
    expected = reference(tokens, hidden)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    target = reference.target[0]
    torch.testing.assert_close(logits, target.lm_head(expected), atol=2e-4, rtol=1e-4)


def test_mtp_drafts_equal_the_reference_from_scratch(mtp_model, engines):
    """Over several steps, with its cache, its pending rows and the rollback to the target's
    accepted tokens; chunked prompts and (the second time) prefix hits."""
    _, reference = mtp_model
    spec = engines[1]
    recorder = _Recorder(spec.engine.speculator.drafter)
    try:
        prompts = _prompts(seed=3)
        spec.generate(_requests(prompts), GREEDY)
        spec.generate(_requests(prompts), SEEDED)  # prefix hits
    finally:
        spec.engine.speculator.drafter.propose = recorder._propose
    assert len(recorder.calls) >= 8
    for tokens, drafts in recorder.calls:
        assert drafts == reference.drafts(tokens, len(drafts)), f"after {len(tokens)} tokens"


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_mtp_output_equals_output_without_drafts(engines, params):
    base, spec = engines
    prompts = _prompts(seed=4)
    expected = _tokens(base.generate(_requests(prompts), params))
    drafted = spec.engine.stats()["spec_num_draft_tokens"]
    hits = spec.engine.stats()["prefix_cache_hits"]
    assert _tokens(spec.generate(_requests(prompts), params)) == expected
    assert _tokens(spec.generate(_requests(prompts), params)) == expected  # prefix hits
    assert spec.engine.stats()["prefix_cache_hits"] > hits
    assert spec.engine.stats()["spec_num_draft_tokens"] > drafted


def test_accepted_mtp_drafts_are_counted_and_exact(mtp_model, tmp_path):
    """A target whose LM head is zero always answers token 0, and so does its MTP block (the
    head is shared): every draft is accepted, a verify step keeps all 1 + k rows."""
    tiny, reference = mtp_model
    path = tmp_path / "zero-head"
    shutil.copytree(tiny.path, path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = torch.zeros_like(tensors["lm_head.weight"])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    kwargs = {**_kwargs(tiny), "model": str(path)}
    prompts = _prompts(seed=5)
    expected = _tokens(LLM(**kwargs).generate(_requests(prompts), GREEDY))
    spec = LLM(**kwargs, speculative_config=MTP)
    assert _tokens(spec.generate(_requests(prompts), GREEDY)) == expected
    stats = spec.engine.stats()
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0
    assert stats["spec_accepted_per_position"][K - 1] > 0


def test_mtp_on_a_checkpoint_without_an_mtp_block_is_a_load_error(tiny_model_root, tmp_path):
    tiny, _ = get_mtp_model("qwen3_5_text", tiny_model_root, with_weights=False)
    with pytest.raises(ValueError, match=r"missing.*mtp\.fc\.weight.*method mtp needs"):
        LLM(**_kwargs(tiny), speculative_config=MTP)
    path = tmp_path / "no-mtp-config"
    shutil.copytree(tiny.path, path)
    config = (path / "config.json").read_text().replace('"mtp_num_hidden_layers": 1', '"x": 0')
    (path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers is 0 or absent"):
        LLM(**{**_kwargs(tiny), "model": str(path)}, speculative_config=MTP)


def test_mtp_under_tensor_parallelism_is_refused(mtp_model, monkeypatch):
    """The block runs unsharded on one rank: a sharded model refuses to build it."""
    config = copy.deepcopy(mtp_model[0].config)
    config.mtp_num_hidden_layers = 1
    monkeypatch.setattr(qwen3_5_mtp, "get_tp_size", lambda: 2)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        qwen3_5_mtp.Qwen3_5MultiTokenPredictor(config, torch.nn.Identity)


def test_mtp_drafts_through_preemption_and_samples(mtp_model):
    """Drafting at every step (no back-off), in a cache too small for every sequence: the
    preempted ones recompute and draft on; n = 2 seeded samples fork the prompt's blocks. The
    output is the output without drafts, and every proposal is the reference's."""
    tiny, reference = mtp_model
    kwargs = _kwargs(tiny, kv_cache_blocks=24, max_model_len=64)
    prompts = random_prompts((20, 17, 22, 15), seed=6)
    params = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=14, ignore_eos=True)
    expected = _tokens(LLM(**kwargs).generate(_requests(prompts), params))
    spec = LLM(**kwargs, speculative_config=MTP)
    spec.engine.speculator.max_seqs = 8  # draft for every running sequence, at every step
    spec.engine.speculator.row_cost = 0.0
    recorder = _Recorder(spec.engine.speculator.drafter)
    assert _tokens(spec.generate(_requests(prompts), params)) == expected
    stats = spec.engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert len(recorder.calls) > 20
    for tokens, drafts in recorder.calls:
        assert drafts == reference.drafts(tokens, len(drafts)), f"after {len(tokens)} tokens"
