"""TP=2 equals TP=1 for the Qwen3.5 hybrid (Gated DeltaNet sharded by key/value head groups,
gated attention by head) and Gemma 3 (sliding-window layers, (1 + w) norms, scaled
embeddings), through the batched, paged, chunked engine on CPU (gloo, a real rank-1
subprocess). Its own module: one process holds one tensor-parallel group at a time."""

from __future__ import annotations

import pytest
import torch

from axon import LLM, SamplingParams
from axon.layers.linear_attention import GatedDeltaNet
from tests.model.qwen3_5_tiny import get_qwen3_5, qwen3_5_engine_kwargs
from tests.model.tiny_models import get_tiny_model, random_prompts

pytestmark = pytest.mark.slow
PROMPT_LENGTHS = (9, 21, 30, 5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _kwargs(family: str, root) -> dict:
    """Engine arguments that chunk the longer prompts (a 16-token budget) over 4-token blocks."""
    common = dict(dtype="float32", block_size=4, max_num_batched_tokens=16)
    if family == "qwen3_5_text":
        kwargs = qwen3_5_engine_kwargs(get_qwen3_5(family, root), block_size=4)
        return {**kwargs, **common}
    path = str(get_tiny_model(family, root).path)
    return dict(model=path, max_model_len=128, kv_cache_memory=1 << 20, **common)


def _run(llm: LLM, prompts) -> tuple[list[torch.Tensor], list[list[int]]]:
    logits = llm.engine.forward_logits(prompts)
    requests = [{"prompt_token_ids": p} for p in prompts]  # scheduled together: one batch
    tokens = [o.outputs[0].token_ids for o in llm.generate(requests, GREEDY)]
    return logits, tokens


@pytest.mark.parametrize("family", ["qwen3_5_text", "gemma3_text"])
def test_tp2_equals_tp1(family, tiny_model_root):
    kwargs = _kwargs(family, tiny_model_root)
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    single = LLM(**kwargs)
    want_logits, want_tokens = _run(single, prompts)
    pair = LLM(**kwargs, tensor_parallel_size=2)
    try:
        got_logits, got_tokens = _run(pair, prompts)
        if family == "qwen3_5_text":
            _assert_gdn_halved(single, pair)
    finally:
        pair.engine.close()
    for want, have in zip(want_logits, got_logits):
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5)
    assert got_tokens == want_tokens
    assert all(len(tokens) == GREEDY.max_tokens for tokens in got_tokens)


def _assert_gdn_halved(single: LLM, pair: LLM) -> None:
    """Each rank holds half the GDN heads: its weights are rank 0's regions of the fused q | k
    | v projection and conv channels, and its state slots hold its heads only."""
    full, half = (
        next(m for m in llm.engine.runner.model.modules() if isinstance(m, GatedDeltaNet))
        for llm in (single, pair)
    )
    assert (half.num_k_heads, half.num_v_heads) == (full.num_k_heads // 2, full.num_v_heads // 2)
    key, value = full.key_dim, full.value_dim
    rows = [(0, key // 2), (key, key // 2), (2 * key, value // 2)]  # q, k, v regions: first half
    want = torch.cat([full.in_proj_qkv.weight[start : start + n] for start, n in rows])
    assert torch.equal(half.in_proj_qkv.weight, want)
    want_conv = torch.cat([full.conv1d.weight[start : start + n] for start, n in rows])
    assert torch.equal(half.conv1d.weight, want_conv)
    assert torch.equal(half.A, full.A[: full.num_v_heads // 2])
    assert torch.equal(half.dt_bias, full.dt_bias[: full.num_v_heads // 2])
    assert torch.equal(half.out_proj.weight, full.out_proj.weight[:, : value // 2])
    assert half.conv_state.shape[1] == full.conv_state.shape[1] // 2
    assert half.recurrent_state.shape[1:] == (
        full.num_v_heads // 2,
        *full.recurrent_state.shape[2:],
    )
