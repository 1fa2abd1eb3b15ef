"""GGUF files of tiny random models, in every type gguf-py (or tests/quant/kquants.py) can write,
loaded by axon: logits match transformers running the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from axon import LLM
from model.tiny_models import ARCHS, random_prompts
from quant.gguf_files import CHAT_TEMPLATE, build_gguf_model, write_gguf

PROMPT_LENGTHS = (1, 5, 17, 33)
TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# F32 runs fp32 end to end: transformers' own tolerance. Every other type multiplies with bf16
# (fp16 for F16) activations, rounded again at each kernel's output, through 2-4 layers of a
# random model with large weights: measured up to 1e-1 of the largest logit (a bf16 copy of the
# exact weights does 2e-2). A layout bug (permutation, norm offset, nibble order) is O(1).
ATOL_FP32 = 1e-4
RTOL_LOW_PRECISION = 0.15


@pytest.fixture(scope="module", params=ARCHS)
def gguf_arch(request):
    return request.param, build_gguf_model(request.param)


def _engine(path) -> LLM:
    return LLM(
        model=str(path), dtype="float32", activation_precision="float32", max_model_len=256,
        kv_cache_memory=1 << 24,
    )  # fmt: skip


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_logits_match_transformers_on_dequantized_weights(gguf_arch, qtype, tmp_path):
    arch, model = gguf_arch
    path, oracle = write_gguf(model, arch, qtype, tmp_path / f"{arch}-{qtype.name}.gguf")
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)

    got = _engine(path).compute_logits(prompts)

    failures = []
    for prompt, logits in zip(prompts, got):
        with torch.no_grad():
            want = oracle(torch.tensor([prompt])).logits[0, -1]
        diff = float((logits - want).abs().max())
        bound = ATOL_FP32 if qtype == Q.F32 else RTOL_LOW_PRECISION * float(want.abs().max())
        if not diff <= bound:
            failures.append(f"prompt of {len(prompt)}: {diff:.3e} > {bound:.3e}")
    assert not failures, f"{arch} {qtype.name}: " + "; ".join(failures)


def test_gguf_config_and_tokenizer_come_from_metadata(tmp_path):
    model = build_gguf_model("qwen3")
    path, _ = write_gguf(model, "qwen3", Q.Q8_0, tmp_path / "qwen3.gguf")

    llm = _engine(path)

    hf_config = llm.engine.runner.hf_config
    for key in ("num_hidden_layers", "hidden_size", "head_dim", "num_key_value_heads"):
        assert getattr(hf_config, key) == getattr(model.config, key), key
    assert hf_config.tie_word_embeddings
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    assert tokenizer.convert_tokens_to_ids("<eos>") == 1
    assert tokenizer.chat_template == CHAT_TEMPLATE
