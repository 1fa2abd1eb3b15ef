"""GGUF under tensor parallelism (CPU, gloo, a real rank-1 subprocess): a Q8_0 file split over
two ranks computes what one rank computes on the same file; a file whose row-parallel split
would cut quant blocks is refused before any rank starts, naming the tensor and the sizes."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from axon import LLM, SamplingParams
from axon.server.config import ServerConfig
from axon.server.errors import Unprocessable
from axon.server.lifecycle.sources import resolve_model
from axon.server.schemas.node_protocol import ModelSpec
from model.tiny_models import _MODEL_CLASSES, SEED, _perturb, make_config, random_prompts
from quant.gguf_files import build_gguf_model, write_gguf

ENGINE_ARGS = dict(
    dtype="float32",
    activation_precision="float32",
    block_size=4,
    max_model_len=128,
    kv_cache_memory=1 << 20,
    max_num_batched_tokens=16,  # chunks the longer prompts
)
PROMPT_LENGTHS = (9, 21, 30, 5)


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "qwen3-Q8_0.gguf"
    return write_gguf(build_gguf_model("qwen3"), "qwen3", Q.Q8_0, path)[0]


@pytest.fixture(scope="module")
def engines(q8_file):
    single = LLM(str(q8_file), **ENGINE_ARGS)
    pair = LLM(str(q8_file), tensor_parallel_size=2, **ENGINE_ARGS)
    yield single, pair
    pair.engine.close()


def test_each_rank_keeps_its_quantized_shard(engines):
    single, pair = engines
    full, half = single.engine.runner.model.model, pair.engine.runner.model.model
    down_full = full.layers[0].mlp.down_proj.quantized.parts["None"]
    down_half = half.layers[0].mlp.down_proj.quantized.parts["None"]
    # Row-parallel: every row, its first half of the blocks (512 / 2 columns, 8 Q8_0 blocks).
    assert (down_half.out_features, down_half.in_features) == (256, 256)
    assert torch.equal(down_half.raw, down_full.raw[:, : down_full.raw.shape[1] // 2])
    q_full = full.layers[0].self_attn.qkv_proj.quantized.parts["q"]
    q_half = half.layers[0].self_attn.qkv_proj.quantized.parts["q"]
    assert torch.equal(q_half.raw, q_full.raw[: q_full.raw.shape[0] // 2])  # rank 0's heads
    assert half.embed_tokens.quantized.raw.shape[0] == full.embed_tokens.quantized.raw.shape[0] // 2


def test_tp2_logits_and_greedy_equal_tp1_on_the_same_file(engines):
    single, pair = engines
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    expected = single.engine.forward_logits(prompts)
    for want, have in zip(expected, pair.engine.forward_logits(prompts)):
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5)
    requests = [{"prompt_token_ids": p} for p in random_prompts(PROMPT_LENGTHS, seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in single.generate(requests, params)]
    assert [o.outputs[0].token_ids for o in pair.generate(requests, params)] == expected


@pytest.fixture(scope="module")
def misaligned_file(tmp_path_factory):
    """Intermediate 96: down_proj's 96 input columns are 3 Q8_0 blocks, 48 per rank."""
    torch.manual_seed(SEED)
    config = make_config("qwen3")
    config.update(dict(hidden_size=256, intermediate_size=96, head_dim=64, num_attention_heads=4))
    model = _MODEL_CLASSES["qwen3"](config).to(torch.float32).eval()
    _perturb(model, torch.Generator().manual_seed(SEED + 1))
    path = tmp_path_factory.mktemp("gguf") / "qwen3-misaligned-Q8_0.gguf"
    return write_gguf(model, "qwen3", Q.Q8_0, path)[0]


WHY = r"blk\.0\.ffn_down\.weight \(Q8_0, 256x96\).*48 columns per rank.*32-column quant block"


def test_a_split_off_block_boundaries_is_refused_by_name(misaligned_file):
    with pytest.raises(ValueError, match=WHY):
        LLM(str(misaligned_file), tensor_parallel_size=2, **ENGINE_ARGS)


def test_the_server_preflight_answers_422(misaligned_file, q8_file):
    spec = ModelSpec(model_id=str(misaligned_file), tensor_parallel=2)
    with pytest.raises(Unprocessable, match=WHY) as info:
        resolve_model(spec, ServerConfig(), trusted=True)
    assert info.value.status_code == 422 and info.value.code == "tp_gguf_split"
    aligned = ModelSpec(model_id=str(q8_file), tensor_parallel=2)
    assert resolve_model(aligned, ServerConfig(), trusted=True) == q8_file
