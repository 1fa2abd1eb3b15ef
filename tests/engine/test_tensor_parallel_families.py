"""TP=2 logits equal TP=1 for the other sharded families: Llama (untied LM head) and Qwen2
(q/k/v biases). Its own module: one process holds one tensor-parallel group at a time, and
test_tensor_parallel.py keeps its TP=2 engine for the whole of its module."""

from __future__ import annotations

import pytest
import torch

from axon import LLM
from tests.engine.test_tensor_parallel import ENGINE_ARGS, PROMPT_LENGTHS
from tests.model.tiny_models import get_tiny_model, random_prompts

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_equal_single_rank(arch, tiny_model_root):
    path = str(get_tiny_model(arch, tiny_model_root).path)
    prompts = random_prompts(PROMPT_LENGTHS, seed=7)
    expected = LLM(path, **ENGINE_ARGS).engine.forward_logits(prompts)
    pair = LLM(path, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        got = pair.engine.forward_logits(prompts)
    finally:
        pair.engine.close()
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5)
