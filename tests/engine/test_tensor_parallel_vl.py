"""Qwen3-VL under tensor parallelism: every rank runs the replicated tower on the same pixels
and slices its DeepStack features like its image rows, so TP=2 equals TP=1 with images (logits
within 1e-5, greedy tokens), also when a chunk cuts through an image. Its own module: one
process holds one tensor-parallel group at a time."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_qwen3_vl import CASES, GREEDY, _last_logits, _llm, _request, tiny

pytestmark = pytest.mark.slow
__all__ = ["tiny"]  # the tiny Qwen3-VL checkpoint fixture


@pytest.mark.parametrize("budget", [2048, 5], ids=["one_chunk", "chunk_cuts_images"])
def test_tp2_with_images_equals_tp1(tiny, budget):
    single = _llm(tiny, max_num_batched_tokens=budget)
    names = ("one_image", "two_images", "text_only")
    requests = [_request(*CASES[name]) for name in names]
    want = [o.outputs[0].token_ids for o in single.generate(requests, GREEDY)]
    want_logits = _last_logits(single, *CASES["two_images"])
    pair = _llm(tiny, max_num_batched_tokens=budget, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in pair.generate(requests, GREEDY)]
        got_logits = _last_logits(pair, *CASES["two_images"])
        assert pair.engine.runner.workers.images_sent == set()
    finally:
        pair.engine.close()
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-5)
