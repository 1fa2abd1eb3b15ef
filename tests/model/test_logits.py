"""Last-position logits through the real engine (batched, paged, chunked) equal transformers'."""

from __future__ import annotations

import pytest
import torch

from axon import LLM

from .tiny_models import ARCHS, VOCAB_SIZE, engine_kwargs, get_tiny_model, random_prompts

ATOL = 1e-4  # fp32
# 1 is the degenerate prompt; 17+ are longer than gemma3's sliding window of 8; 40 and 64 span
# several blocks at either block size.
PROMPT_LENGTHS = (1, 5, 17, 33, 40, 64)
PROMPT_SEED = 3


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tiny_model_root):
    return get_tiny_model(request.param, tiny_model_root)


@pytest.mark.parametrize(
    ("block_size", "max_num_batched_tokens"),
    [(16, None), (16, 16), (4, 16)],
    ids=["default-budget", "chunked-block16", "chunked-block4"],
)
def test_last_logits_match_transformers(tiny, block_size, max_num_batched_tokens):
    overrides = {}
    if max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = max_num_batched_tokens
    llm = LLM(**engine_kwargs(tiny, block_size=block_size, **overrides))
    prompts = random_prompts(PROMPT_LENGTHS, PROMPT_SEED)

    got = llm.compute_logits(prompts)

    assert len(got) == len(prompts)
    failures = []
    for prompt, logits in zip(prompts, got):
        assert logits.shape == (VOCAB_SIZE,), f"prompt of {len(prompt)}: shape {logits.shape}"
        assert logits.dtype == torch.float32
        want = tiny.last_logits(prompt)
        diff = float((logits.cpu() - want).abs().max())
        if not diff <= ATOL:  # also catches NaN
            failures.append(f"prompt of {len(prompt)} tokens: max abs diff {diff:.3e}")
    assert not failures, f"{tiny.arch}: logits differ from transformers: " + "; ".join(failures)


def test_logits_do_not_depend_on_batch_company(tiny):
    """A prompt's logits are the same alone and in a batch (no cross-sequence leakage)."""
    llm = LLM(**engine_kwargs(tiny, block_size=4, max_num_batched_tokens=16))
    prompts = random_prompts(PROMPT_LENGTHS, PROMPT_SEED)

    batched = llm.compute_logits(prompts)
    alone = [llm.compute_logits([prompt])[0] for prompt in prompts[::-1]][::-1]

    for prompt, in_batch, by_itself in zip(prompts, batched, alone):
        diff = float((in_batch - by_itself).abs().max())
        assert diff <= ATOL, f"{tiny.arch}: prompt of {len(prompt)}: batch vs alone {diff:.3e}"
