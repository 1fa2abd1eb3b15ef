"""Speculative decoding stays exact under 8-bit activations and the float16 KV cache they bring:
a token's logits do not depend on the shape of the step that computes it. A row of a verify
chunk (a decode token and its drafts) equals, to the bit, the same token computed by a decode
step; a prompt of more than 64 tokens (rotary's table path) gives the same logits prefilled
whole or after a prefix hit, a decode row beside a long prompt chunk the same as alone; and
greedy output with n-gram drafts is the output without them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from axon import LLM, SamplingParams
from axon.kernels import cpu_ops, ggml_cpu
from model.tiny_models import random_prompts
from quant.gguf_files import build_gguf_model, write_gguf

pytestmark = pytest.mark.skipif(not ggml_cpu.available(), reason="no C compiler")
# int8 activations: the KV cache is float16 (auto); 4-token blocks put prefix hits mid-prompt
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory=1 << 24, block_size=4,
                   activation_precision="int8")  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_q4_k(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("int8-spec")
    path, _ = write_gguf(build_gguf_model("qwen3"), "qwen3", Q.Q4_K, root / "qwen3.gguf")
    return str(path)


class ExactDrafter:
    """Drafts the reference answer's next tokens: every draft accepted, so each verify step's
    last row computes the token after its last draft."""

    def __init__(self, answer: list[int]):
        self.answer = answer

    def propose(self, seqs, max_tokens):
        return [self.answer[s.num_output_tokens : s.num_output_tokens + n]
                for s, n in zip(seqs, max_tokens)]  # fmt: skip

    def release(self, seq_ids):
        pass


def _step_logits(llm: LLM, prompt: list[int]) -> list[tuple[int, torch.Tensor]]:
    """Each step's (output tokens after it, logits of its sequence's last row)."""
    engine = llm.engine
    engine.reset_prefix_cache()
    engine._captured_logits = {}  # the hook forward_logits uses: each step's last row
    try:
        (seq,) = engine.add_request(f"steps-{len(prompt)}", prompt, GREEDY)
        steps = []
        while not seq.is_finished:
            engine.step()
            steps.append((seq.num_output_tokens, engine._captured_logits[seq.seq_id].clone()))
        return steps
    finally:
        engine._captured_logits = None


def test_a_verify_row_equals_the_decode_row_to_the_bit(qwen3_q4_k):
    _check_verify_rows_equal_decode_rows(qwen3_q4_k)


def test_a_verify_row_equals_the_decode_row_with_the_context_split(qwen3_q4_k):
    """Decode attention split in parts of 8 positions (cpu_ops.c's decode_split): contexts of
    6-35 positions cross parts, and the parts depend on a row's context alone."""
    previous = cpu_ops.set_decode_split(8)
    try:
        _check_verify_rows_equal_decode_rows(qwen3_q4_k)
    finally:
        cpu_ops.set_decode_split(previous)


def _check_verify_rows_equal_decode_rows(qwen3_q4_k: str) -> None:
    base = LLM(model=qwen3_q4_k, **ENGINE_ARGS)
    spec = LLM(model=qwen3_q4_k, **ENGINE_ARGS, speculative_config=NGRAM)
    assert base.engine.runner.kv_cache.dtype == torch.float16
    for prompt in random_prompts((5, 23), seed=3):
        decoded = _step_logits(base, prompt)  # one step a token: step i computes token i
        (output,) = base.generate([{"prompt_token_ids": prompt}], GREEDY)
        spec.engine.speculator.drafter = ExactDrafter(output.outputs[0].token_ids)
        verified = _step_logits(spec, prompt)
        assert len(verified) < len(decoded)  # drafts were verified
        for done, logits in verified:
            assert torch.equal(logits, decoded[done - 1][1]), done


def test_a_long_prompt_after_a_prefix_hit_equals_it_prefilled_whole(qwen3_q4_k):
    """83 tokens take rotary's table path, the 3 past the hit (80) the per-token one."""
    llm = LLM(model=qwen3_q4_k, **ENGINE_ARGS)
    (prompt,) = random_prompts((83,), seed=5)
    (whole,) = llm.engine.forward_logits([prompt])
    hits = llm.engine.stats()["prefix_cache_hits"]
    (after_hit,) = llm.engine.forward_logits([prompt])
    assert llm.engine.stats()["prefix_cache_hits"] > hits
    assert torch.equal(whole, after_hit)


def test_greedy_ngram_output_is_the_output_without_drafts(qwen3_q4_k):
    short, medium, long = random_prompts((3, 7, 11), seed=8)
    prompts = [{"prompt_token_ids": p} for p in (short * 4, medium * 3, long * 2 + short)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = LLM(model=qwen3_q4_k, **ENGINE_ARGS)
    spec = LLM(model=qwen3_q4_k, **ENGINE_ARGS, speculative_config=NGRAM)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, greedy)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == want
    assert spec.engine.stats()["spec_num_draft_tokens"] > 0


def test_a_decode_row_beside_a_long_prefill_chunk_equals_it_alone(qwen3_q4_k):
    """A step of more than 64 rows (a prompt chunk beside the decodes): rotary's table path
    rotates the decode rows as a decode step does, so their log-probabilities match."""
    llm = LLM(model=qwen3_q4_k, **ENGINE_ARGS, max_num_batched_tokens=96)
    short, long = random_prompts((120, 240), seed=13)  # late positions: cos / sin differ more
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    (alone,) = llm.generate([{"prompt_token_ids": short}], params)
    llm.engine.reset_prefix_cache()
    beside, _ = llm.generate([{"prompt_token_ids": p} for p in (short, long)], params)
    assert alone.outputs[0].token_ids == beside.outputs[0].token_ids
    for a, b in zip(alone.outputs[0].logprobs, beside.outputs[0].logprobs, strict=True):
        assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}
