"""Offline LLM API semantics: n, seeds, logprobs, stop strings, streaming, validation."""

from __future__ import annotations

import math

import pytest
import torch

from axon import LLM, SamplingParams
from tests.model.tiny_models import get_tiny_model, random_prompts

ENGINE_ARGS = dict(dtype="float32", block_size=4, max_model_len=128, kv_cache_memory=2 << 20)


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return get_tiny_model("llama", tiny_model_root)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny.path), **ENGINE_ARGS)


def ids(prompt):
    return {"prompt_token_ids": prompt}


def test_outputs_in_prompt_order_with_prompt_ids(llm):
    prompts = random_prompts((9, 3, 20), seed=5)
    outs = llm.generate([ids(p) for p in prompts], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    prompt, *others = random_prompts((12, 7, 30, 18), seed=9)
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([ids(prompt)], params)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.3, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(
        [ids(others[0]), ids(prompt), ids(others[1]), ids(others[2])], [noise, params, noise, noise]
    )
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([ids(prompt)], other_seed)[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_and_differ(llm):
    prompt = random_prompts((21,), seed=2)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    first = llm.generate([ids(prompt)], params)[0]
    again = llm.generate([ids(prompt)], params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    samples = [tuple(o.token_ids) for o in first.outputs]
    assert len(set(samples)) == 3
    assert samples == [tuple(o.token_ids) for o in again.outputs]


def test_logprobs_match_the_raw_distribution(llm):
    prompt = random_prompts((10,), seed=4)[0]
    out = llm.generate([ids(prompt)], SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0]
    reference = torch.log_softmax(llm.compute_logits([prompt])[0], dim=-1)
    (entry,) = out.outputs[0].logprobs
    token = out.outputs[0].token_ids[0]
    assert entry[token].rank == 1
    assert math.isclose(entry[token].logprob, reference[token].item(), abs_tol=1e-5)
    top = reference.topk(3)
    assert sorted(entry) == sorted(top.indices.tolist())
    assert out.outputs[0].cumulative_logprob == pytest.approx(entry[token].logprob)


def test_stop_string_trims_the_text_and_frees_the_sequence(llm):
    prompt = random_prompts((8,), seed=6)[0]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate([ids(prompt)], free)[0].outputs[0]
    words = full.text.split()
    stop = words[4]  # the 5th generated word, e.g. "w123"
    cut = full.text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    stopped = llm.generate([ids(prompt)], params)[0].outputs[0]
    assert stopped.text == full.text[:cut]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert len(stopped.token_ids) < len(full.token_ids)
    kept = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    assert llm.generate([ids(prompt)], kept)[0].outputs[0].text == full.text[: cut + len(stop)]
    assert llm.get_stats()["num_free_blocks"] == llm.get_stats()["num_blocks"]


def test_stream_yields_the_same_text(llm):
    prompt = random_prompts((8,), seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    text = llm.generate([ids(prompt)], params)[0].outputs[0].text
    assert "".join(llm.stream(ids(prompt), params)) == text


def test_string_prompts_use_the_tokenizer(llm):
    out = llm.generate("w10 w11 w12", SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert out.prompt_token_ids[-3:] == [10, 11, 12]


@pytest.mark.parametrize(
    "bad",
    [{"prompt_token_ids": []}, {"prompt_token_ids": [10**6]}, {"prompt_token_ids": [1] * 200}],
)
def test_bad_prompts_raise_value_error(llm, bad):
    with pytest.raises(ValueError):
        llm.generate([bad], SamplingParams(max_tokens=2))


def test_unknown_engine_argument_is_a_value_error(tiny):
    with pytest.raises(ValueError, match="gpu_memory_utilisation"):
        LLM(str(tiny.path), gpu_memory_utilisation=0.5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_run_close_to_float32(tiny, llm, dtype):
    prompts = random_prompts((6, 19), seed=8)
    half = LLM(str(tiny.path), **{**ENGINE_ARGS, "dtype": dtype})
    assert half.engine.runner.kv_cache.dtype == getattr(torch, dtype)
    for ref, got in zip(llm.compute_logits(prompts), half.compute_logits(prompts)):
        assert got.dtype == torch.float32
        assert (ref - got).abs().max().item() < 0.1 * ref.abs().max().item()
