"""Mixture-of-experts models under tensor parallelism (CPU, gloo, a real rank-1 subprocess):
every rank holds half of each expert's intermediate dimension (gate / up rows, down columns),
the router and the shared expert's gate whole, the shared expert sharded as a dense MLP; TP=2
logits and greedy tokens equal TP=1's through the batched, paged, chunked engine.

- `qwen3_moe` (sparse, dense, sparse), experts stored fused as 3-D tensors, width 64: the
  ranks' 32-wide shards run on the one-call C experts (partial sums, no residual);
- `qwen3_5_moe_text` (the hybrid stack, routed plus shared expert), experts stored one by one,
  width 32: 16-wide shards take the PyTorch grouped path;
- a Q8_0 `qwen3moe` GGUF written by llama.cpp's converter, width 64 (two 32-column blocks of
  each expert's down rows per rank); split over 4 ranks it would cut blocks: the 422.

Its own module: one process holds one tensor-parallel group at a time.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from axon import LLM, SamplingParams
from axon.config import EngineConfig
from axon.engine.engine_proc import engine_info
from axon.layers import fused_moe, linear
from axon.layers.fused_moe import FusedMoE
from axon.runner.tensor_parallel import check_tp_support
from axon.server.config import ServerConfig
from axon.server.errors import Unprocessable
from axon.server.lifecycle.sources import resolve_model
from axon.server.schemas.node_protocol import ModelSpec
from quant.test_gguf_moe import _converted, converter  # noqa: F401 (fixture)
from tests.model.qwen3_5_tiny import _perturb, qwen3_5_engine_kwargs
from tests.model.test_moe import write_moe
from tests.model.tiny_models import TinyModel, engine_kwargs, random_prompts
from tiny_configs import QWEN3_5_VISION, QWEN3_MOE_TP_GGUF, moe_config

pytestmark = pytest.mark.slow
PROMPT_LENGTHS = (9, 21, 30, 5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ATOL = 1e-4
# arch -> (expert width, checkpoint stores the experts fused as 3-D tensors)
CASES = {"qwen3_moe": (64, True), "qwen3_5_moe_text": (32, False)}


@torch.no_grad()
def _checkpoint(arch: str, root) -> TinyModel:
    width, fused = CASES[arch]
    config = moe_config(arch)
    config.moe_intermediate_size = width
    config._attn_implementation = "eager"
    torch.manual_seed(21)
    model_cls = Qwen3MoeForCausalLM if arch == "qwen3_moe" else Qwen3_5MoeForCausalLM
    model = model_cls(config).to(torch.float32).eval()
    _perturb(model, torch.Generator().manual_seed(22))  # norms, dt_bias, A_log
    path = write_moe(model, root / f"tp-{arch}", fused=fused)
    return TinyModel(arch=arch, path=path, hf_model=model)


def _kwargs(tiny: TinyModel) -> dict:
    """Engine arguments that chunk the longer prompts (a 16-token budget) over 4-token blocks."""
    builder = engine_kwargs if tiny.arch == "qwen3_moe" else qwen3_5_engine_kwargs
    return builder(tiny, block_size=4, max_num_batched_tokens=16)


def _run(llm: LLM, prompts) -> tuple[list[torch.Tensor], list[list[int]]]:
    logits = llm.engine.forward_logits(prompts)
    requests = [{"prompt_token_ids": p} for p in prompts]  # scheduled together: one batch
    tokens = [o.outputs[0].token_ids for o in llm.generate(requests, GREEDY)]
    return logits, tokens


def _experts(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]


def _assert_equal_runs(want, got) -> None:
    (want_logits, want_tokens), (got_logits, got_tokens) = want, got
    for expected, have in zip(want_logits, got_logits, strict=True):
        torch.testing.assert_close(have, expected, rtol=0, atol=ATOL)
    assert got_tokens == want_tokens
    assert all(len(tokens) == GREEDY.max_tokens for tokens in got_tokens)


@pytest.mark.parametrize("arch", list(CASES))
def test_tp2_equals_tp1(arch, tiny_model_root, monkeypatch):
    tiny = _checkpoint(arch, tiny_model_root)
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    single = LLM(**_kwargs(tiny))
    want = _run(single, prompts)
    pair = LLM(**_kwargs(tiny), tensor_parallel_size=2)
    try:
        got = _run(pair, prompts)
        _assert_rank0_shards(single, pair)
        _assert_one_reduce_per_block(pair, monkeypatch)
        full_bytes = engine_info(single.engine)["parameter_bytes"]
        half_bytes = engine_info(pair.engine)["parameter_bytes"]  # what /models shows
        if arch == "qwen3_moe":  # the ranks' 32-wide float32 shards ran on the C experts
            assert all(e._c_experts not in (None, False) for e in _experts(pair))
    finally:
        pair.engine.close()
    _assert_equal_runs(want, got)
    # Rank 0's bytes: half of every expert, so half of the bytes a token leaves unread.
    full_inactive = full_bytes["total"] - full_bytes["active"]
    assert half_bytes["total"] - half_bytes["active"] == full_inactive // 2
    assert half_bytes["total"] < full_bytes["total"] - full_inactive // 2


def _assert_one_reduce_per_block(pair: LLM, monkeypatch) -> None:
    """One step of one prompt: each sparse block all-reduces once (routed and shared partials
    together), the linears once per attention (and dense MLP) layer, not for the shared
    expert. Rank 0's reduces are counted; they still run, so rank 1 meets them."""
    counts = {fused_moe: 0, linear: 0}
    for module in counts:
        real = module.tp_all_reduce

        def counted(x, module=module, real=real):
            counts[module] += 1
            return real(x)

        monkeypatch.setattr(module, "tp_all_reduce", counted)
    pair.engine.forward_logits(random_prompts((5,), seed=9))
    monkeypatch.undo()
    layers = _model(pair).model.layers
    sparse = sum(isinstance(layer.mlp, fused_moe.SparseMoeBlock) for layer in layers)
    assert counts[fused_moe] == sparse
    assert counts[linear] == 2 * len(layers) - sparse  # attention output, dense down_proj


def _model(llm: LLM):
    return llm.engine.runner.model


def _assert_rank0_shards(single: LLM, pair: LLM) -> None:
    """Rank 0 holds the first half of every expert's gate rows, up rows and down columns; the
    router (and the shared expert's gate) whole; the shared expert as a dense MLP's shard."""
    for full, half in zip(_experts(single), _experts(pair), strict=True):
        inter = full.intermediate_size
        assert half.intermediate_size == inter // 2
        gate, up = full.gate_up_proj[:, : inter // 2], full.gate_up_proj[:, inter : inter * 3 // 2]
        assert torch.equal(half.gate_up_proj, torch.cat([gate, up], dim=1))
        assert torch.equal(half.down_proj, full.down_proj[..., : inter // 2])
    blocks = [
        (a.mlp, b.mlp)
        for a, b in zip(_model(single).model.layers, _model(pair).model.layers)
        if hasattr(a.mlp, "gate")
    ]
    for full, half in blocks:
        assert torch.equal(half.gate.weight, full.gate.weight)
        shared = getattr(full, "shared_expert", None)
        if shared is not None:
            assert torch.equal(half.shared_expert_gate.weight, full.shared_expert_gate.weight)
            width = shared.down_proj.weight.shape[1]
            want_down = shared.down_proj.weight[:, : width // 2]
            assert torch.equal(half.shared_expert.down_proj.weight, want_down)


@torch.no_grad()
def test_multimodal_checkpoint_tp2_equals_tp1(tiny_model_root):
    """`qwen3_5_moe` (vision tower alongside, whole on every rank): its text model shards."""
    text = _checkpoint("qwen3_5_moe_text", tiny_model_root).hf_model
    config = Qwen3_5MoeConfig(
        text_config=text.config.to_dict(), vision_config=QWEN3_5_VISION, tie_word_embeddings=False
    )
    model = Qwen3_5MoeForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    path = write_moe(model, tiny_model_root / "tp-qwen3_5_moe", fused=False)
    kwargs = qwen3_5_engine_kwargs(
        TinyModel(arch="qwen3_5_moe", path=path, hf_model=text),
        block_size=4,
        max_num_batched_tokens=16,
    )
    prompts = random_prompts((5, 21), seed=7)
    want = LLM(**kwargs).engine.forward_logits(prompts)
    pair = LLM(**kwargs, tensor_parallel_size=2)
    try:
        got = pair.engine.forward_logits(prompts)
    finally:
        pair.engine.close()
    for expected, have in zip(want, got, strict=True):
        torch.testing.assert_close(have, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("width", ["moe_intermediate_size", "shared_expert_intermediate_size"])
def test_indivisible_expert_width_is_named(width):
    config = moe_config("qwen3_5_moe_text")
    setattr(config, width, 42)  # the heads (4, 2 key, 4 value) divide by 4
    engine = EngineConfig(model="unused", tensor_parallel_size=4, device="cpu")
    with pytest.raises(ValueError, match=f"{width} 42 is not divisible by tensor_parallel_size 4"):
        check_tp_support(engine, config)


# ---- GGUF -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory, qwen3_tokenizer, converter):  # noqa: F811 (the fixture)
    """A qwen3moe Q8_0 file (every layer sparse, llama.cpp's qwen3moe has no dense ones) whose
    64-wide experts split into whole 32-column blocks over 2 ranks, 128-wide attention output
    into whole blocks over 4; cached by what it is made from."""
    tokenizer = qwen3_tokenizer
    config = Qwen3MoeConfig(
        **QWEN3_MOE_TP_GGUF,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(31)
    model = Qwen3MoeForCausalLM(config).eval()
    _perturb(model, torch.Generator().manual_seed(32))
    path = tmp_path_factory.mktemp("qwen3moe-tp")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return _converted(converter, path, "qwen3moe-tp-gguf", ("q8_0",))["q8_0"]


GGUF_ARGS = dict(
    dtype="float32", activation_precision="float32", block_size=4, max_model_len=128,
    kv_cache_memory=1 << 20, max_num_batched_tokens=16,
)  # fmt: skip


def test_gguf_q8_0_experts_shard_and_equal_tp1(q8_file):
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    single = LLM(str(q8_file), **GGUF_ARGS)
    want = _run(single, prompts)
    pair = LLM(str(q8_file), tensor_parallel_size=2, **GGUF_ARGS)
    try:
        got = _run(pair, prompts)
        for full, half in zip(_experts(single), _experts(pair), strict=True):
            assert full.quantized is not None and half.quantized is not None
            for expert in (0, 7):
                _assert_quantized_halves(full.quantized._parts, half.quantized._parts, expert)
    finally:
        pair.engine.close()
    _assert_equal_runs(want, got)


def _assert_quantized_halves(full: dict, half: dict, expert: int) -> None:
    """Rank 0's Q8_0 parts: the first 32 gate and up rows, the first block of every down row."""
    for part in ("gate", "up"):
        whole, shard = full[expert, part], half[expert, part]
        assert shard.shape == (32, 64)
        assert torch.equal(shard.data, whole.data[:32])
    whole, shard = full[expert, "down"], half[expert, "down"]
    assert shard.shape == (64, 32)
    assert torch.equal(shard.data, whole.data[:, : whole.data.shape[1] // 2])


def test_gguf_split_through_expert_blocks_is_a_422(q8_file):
    """Over 4 ranks each expert's down rows would keep 16 of a 32-column Q8_0 block."""
    why = r"blk\.0\.ffn_down_exps\.weight \(Q8_0, 8x64x64\).*16 columns per rank.*32-column"
    spec = ModelSpec(model_id=str(q8_file), tensor_parallel=4)
    with pytest.raises(Unprocessable, match=why) as info:
        resolve_model(spec, ServerConfig(), trusted=True)
    assert info.value.status_code == 422 and info.value.code == "tp_gguf_split"
    with pytest.raises(ValueError, match=why):
        LLM(str(q8_file), tensor_parallel_size=4, **GGUF_ARGS)
