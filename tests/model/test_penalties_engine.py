"""Penalties through the real engine: the persistent PenaltyCounts give the tokens that the
from-scratch rebuild gives, with rows joining and finishing at different steps and preempted."""

from __future__ import annotations

from axon import LLM, SamplingParams

from .tiny_models import engine_kwargs, get_tiny_model, random_prompts

PENALTIES = [
    {"presence_penalty": 0.8, "frequency_penalty": 0.4},
    {"repetition_penalty": 1.6},
    {},  # no penalty: a row the state never sees
    {"repetition_penalty": 0.7, "frequency_penalty": -0.3, "presence_penalty": 0.5},
    {"frequency_penalty": 1.2},
]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0, max_tokens=16 + 6 * i, ignore_eos=True, **penalties)
        for i, penalties in enumerate(PENALTIES)
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [output.outputs[0].token_ids for output in outputs]


def test_incremental_penalties_equal_the_rebuild_under_preemption(tiny_model_root) -> None:
    tiny = get_tiny_model("qwen3", tiny_model_root)
    prompts = random_prompts((5, 17, 33, 9, 40), 7)
    # 8 blocks of 16: each sequence fits alone, the batch does not, so decode preempts.
    kwargs = engine_kwargs(tiny, block_size=16, kv_cache_blocks=8, max_model_len=96)
    llm = LLM(**kwargs)
    incremental = _generate(llm, prompts)
    assert llm.get_stats()["num_preemptions"] > 0
    assert llm.engine.penalty_counts.ids.shape[0] > 0  # the state was used
    reference = LLM(**kwargs)  # a fresh engine: the same schedule, no prefix-cache hits
    reference.engine.penalty_counts = None  # SamplingMetadata rebuilds from the token lists
    assert _generate(reference, prompts) == incremental
    assert reference.get_stats()["num_preemptions"] == llm.get_stats()["num_preemptions"]
