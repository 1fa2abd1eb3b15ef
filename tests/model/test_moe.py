"""Mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE) through the real engine equal transformers,
from per-expert and fused 3-D checkpoints alike; the grouped expert layer equals its per-token
reference twin and reads only the experts that were chosen."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import save_file
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3MoeForCausalLM,
)

from axon import LLM, SamplingParams
from axon.engine.engine_proc import engine_info
from axon.kernels import cpu_moe
from axon.layers.activation import SiluAndMul
from axon.layers.fused_moe import FusedMoE, fused_moe, fused_moe_ref, select_experts
from axon.layers.quantized import QuantizedTensor
from quant.kquants import quantize_k
from tiny_configs import NUM_EXPERTS, QWEN3_5_VISION, TOP_K, moe_config

from .qwen3_5_tiny import qwen3_5_engine_kwargs
from .tiny_models import (
    VOCAB_SIZE,
    TinyModel,
    build_tokenizer,
    engine_kwargs,
    random_prompts,
)

ATOL = 1e-4
MAX_TOKENS = 32
MIN_REFERENCE_MARGIN = 1e-3
LOGIT_LENGTHS = (1, 5, 17, 40)
GREEDY_LENGTHS = (1, 5, 17, 33)
PROMPT_SEED, GREEDY_SEED = 3, 14  # greedy: every reference margin clears 2e-3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARCHS = ("qwen3_moe", "qwen3_5_moe_text")
needs_c_kernels = pytest.mark.skipif(
    not cpu_moe.ExpertWeights.usable({}, "silu"), reason="no C compiler: the PyTorch path runs"
)


@torch.no_grad()
def build_moe(arch: str, seed: int = 77):
    """An fp32 eval model with norms, `dt_bias` and `A_log` perturbed (init leaves them flat)."""
    torch.manual_seed(seed)
    config = moe_config(arch)
    config._attn_implementation = "eager"
    model_cls = Qwen3MoeForCausalLM if arch == "qwen3_moe" else Qwen3_5MoeForCausalLM
    model = model_cls(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith(("norm.weight", "dt_bias")):
            param.add_(torch.randn(param.shape, generator=generator) * 0.2)
        elif name.endswith("A_log"):
            param.copy_(torch.rand(param.shape, generator=generator) * 2 - 1.5)
    return model


def write_moe(model, path: Path, fused: bool) -> Path:
    """transformers writes experts one by one (`experts.N.gate_proj.weight`); `fused` writes the
    model's own 3-D `experts.gate_up_proj` / `experts.down_proj` instead."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    if fused:
        (path / "model.safetensors").unlink()
        tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


_CACHE: dict[tuple[str, Path], TinyModel] = {}


def get_moe(arch: str, root: Path) -> TinyModel:
    if (arch, root) not in _CACHE:
        model = build_moe(arch)
        path = write_moe(model, root / arch, fused=False)
        _CACHE[arch, root] = TinyModel(arch=arch, path=path, hf_model=model)
    return _CACHE[arch, root]


def _llm(tiny: TinyModel, **overrides) -> LLM:
    if tiny.arch == "qwen3_moe":
        return LLM(**engine_kwargs(tiny, **overrides))
    return LLM(**qwen3_5_engine_kwargs(tiny, **overrides))


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tiny_model_root):
    return get_moe(request.param, tiny_model_root)


def _assert_logits(tiny: TinyModel, prompts, got) -> None:
    failures = []
    for prompt, logits in zip(prompts, got):
        assert logits.shape == (VOCAB_SIZE,)
        diff = float((logits - tiny.last_logits(prompt)).abs().max())
        if not diff <= ATOL:  # also catches NaN
            failures.append(f"prompt of {len(prompt)}: max abs diff {diff:.3e}")
    assert not failures, f"{tiny.arch}: " + "; ".join(failures)


def test_logits_match_transformers_chunked(tiny):
    """Paged (4-token blocks), chunked (16-token budget), prompts batched together."""
    llm = _llm(tiny, block_size=4, max_num_batched_tokens=16)
    prompts = random_prompts(LOGIT_LENGTHS, PROMPT_SEED)
    _assert_logits(tiny, prompts, llm.compute_logits(prompts))


def test_greedy_concurrent_prompts_match_transformers(tiny):
    prompts = random_prompts(GREEDY_LENGTHS, GREEDY_SEED)
    for prompt in prompts:
        margin = tiny.greedy(prompt, MAX_TOKENS).min_margin
        assert margin > MIN_REFERENCE_MARGIN, f"setup: near-tie for prompt of {len(prompt)}"
    llm = _llm(tiny, max_num_batched_tokens=32)

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)

    for prompt, output in zip(prompts, outputs):
        got = list(output.outputs[0].token_ids)
        assert got == tiny.greedy(prompt, MAX_TOKENS).token_ids, f"prompt of {len(prompt)}"


def test_fused_expert_checkpoint_loads_the_same(tiny, tmp_path):
    fused_path = write_moe(tiny.hf_model, tmp_path / tiny.arch, fused=True)
    tiny_fused = TinyModel(arch=tiny.arch, path=fused_path, hf_model=tiny.hf_model)
    prompts = random_prompts((5, 17), PROMPT_SEED)

    per_expert = _llm(tiny).compute_logits(prompts)
    fused = _llm(tiny_fused).compute_logits(prompts)

    for a, b in zip(per_expert, fused):
        assert torch.equal(a, b)
    _assert_logits(tiny, prompts, fused)


@torch.no_grad()
def test_multimodal_checkpoint_runs_its_text_model(tiny_model_root, tmp_path):
    """A `qwen3_5_moe` (Qwen3_5MoeForConditionalGeneration) checkpoint: `model.language_model.*`
    experts, vision tower alongside."""
    tiny = get_moe("qwen3_5_moe_text", tiny_model_root)
    text_config = tiny.hf_model.config.to_dict()
    config = Qwen3_5MoeConfig(
        text_config=text_config, vision_config=QWEN3_5_VISION, tie_word_embeddings=False
    )
    model = Qwen3_5MoeForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(tiny.hf_model.model.state_dict())
    model.lm_head.load_state_dict(tiny.hf_model.lm_head.state_dict())
    path = write_moe(model, tmp_path / "qwen3_5_moe", fused=False)
    multimodal = TinyModel(arch="qwen3_5_moe", path=path, hf_model=tiny.hf_model)
    prompts = random_prompts((5, 17), PROMPT_SEED)

    llm = _llm(multimodal)

    assert llm.engine.runner.model.visual is not None
    _assert_logits(tiny, prompts, llm.compute_logits(prompts))


def test_engine_info_reports_total_and_active_bytes(tiny_model_root):
    tiny = get_moe("qwen3_moe", tiny_model_root)
    llm = _llm(tiny)

    sizes = engine_info(llm.engine)["parameter_bytes"]

    hf_bytes = sum(p.numel() * 4 for p in tiny.hf_model.parameters())
    expert_bytes = sum(
        p.numel() * 4 for name, p in tiny.hf_model.named_parameters() if ".experts." in name
    )
    assert hf_bytes <= sizes["total"] <= hf_bytes + 4096  # plus the rotary tables
    unread = expert_bytes * (NUM_EXPERTS - TOP_K) // NUM_EXPERTS
    assert sizes["total"] - sizes["active"] == unread


def _random_experts(seed: int, hidden: int = 32, inter: int = 16, tokens: int = 12):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    w_gate_up = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=generator) * 0.2
    w_down = torch.randn(NUM_EXPERTS, hidden, inter, generator=generator) * 0.2
    logits = torch.randn(tokens, NUM_EXPERTS, generator=generator)
    return x, w_gate_up, w_down, logits


def _run_fused(x, w_gate_up, w_down, weights, ids, calls: list):
    def gate_up(expert, rows):
        calls.append(("gate_up", expert, rows.shape[0]))
        return torch.nn.functional.linear(rows, w_gate_up[expert])

    def down(expert, rows):
        calls.append(("down", expert, rows.shape[0]))
        return torch.nn.functional.linear(rows, w_down[expert])

    return fused_moe(x, weights, ids, gate_up, down, SiluAndMul(), NUM_EXPERTS)


@pytest.mark.parametrize("seed", range(4))
def test_fused_moe_equals_reference_on_random_routings(seed):
    x, w_gate_up, w_down, logits = _random_experts(seed)
    weights, ids = select_experts(logits, TOP_K, renormalize=seed % 2 == 0)
    calls = []

    got = _run_fused(x, w_gate_up, w_down, weights, ids, calls)

    torch.testing.assert_close(got, fused_moe_ref(x, w_gate_up, w_down, weights, ids))
    chosen = sorted(set(ids.flatten().tolist()))
    assert [e for kind, e, _ in calls if kind == "gate_up"] == chosen  # once each, in order
    assert [e for kind, e, _ in calls if kind == "down"] == chosen


def test_fused_moe_with_idle_experts_and_one_expert_taking_every_token():
    """Expert 5 is every token's first choice; experts 0, 1 and 7 get no token, and their
    weights are NaN, so reading them at all would poison the output."""
    x, w_gate_up, w_down, _ = _random_experts(seed=9)
    tokens = x.shape[0]
    ids = torch.stack([torch.full((tokens,), 5), torch.tensor([2, 3, 4, 6] * 3)], dim=1)
    weights = torch.rand(tokens, TOP_K, generator=torch.Generator().manual_seed(1))
    for idle in (0, 1, 7):
        w_gate_up[idle], w_down[idle] = float("nan"), float("nan")
    calls = []

    got = _run_fused(x, w_gate_up, w_down, weights, ids, calls)

    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, fused_moe_ref(x, w_gate_up, w_down, weights, ids))
    assert ("gate_up", 5, tokens) in calls  # one call for all the tokens routed to it
    assert {e for _, e, _ in calls} == {2, 3, 4, 5, 6}


def test_missing_expert_is_named(tiny_model_root, tmp_path):
    from safetensors.torch import load_file

    tiny = get_moe("qwen3_moe", tiny_model_root)
    path = write_moe(tiny.hf_model, tmp_path / "broken", fused=False)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.6.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    broken = TinyModel(arch="qwen3_moe", path=path, hf_model=tiny.hf_model)

    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.6\.up_proj\.weight"):
        _llm(broken)


# ---- the one-call C experts (kernels/cpu_moe.c) against the reference twin --------------------


def _layer(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> FusedMoE:
    experts, inter2, hidden = w_gate_up.shape
    layer = FusedMoE(experts, TOP_K, hidden, inter2 // 2, "silu")
    layer.weight_loader(layer.gate_up_proj, w_gate_up)
    layer.weight_loader(layer.down_proj, w_down)
    return layer


def _quantized_layer(w_gate_up, w_down, qtype: GGMLQuantizationType) -> FusedMoE:
    """The experts quantized to `qtype` as QuantizedTensors, loaded one expert part at a time as
    from a GGUF file; returns the layer (its weights: dequantize them for the reference)."""
    experts, inter2, hidden = w_gate_up.shape
    layer = FusedMoE(experts, TOP_K, hidden, inter2 // 2, "silu")
    inter = inter2 // 2
    for expert in range(experts):
        parts = {
            "gate": w_gate_up[expert, :inter],
            "up": w_gate_up[expert, inter:],
            "down": w_down[expert],
        }
        for part, weight in parts.items():
            if qtype == GGMLQuantizationType.Q8_0:
                raw = gguf.quants.quantize(weight.numpy(), qtype)
            else:
                raw = quantize_k(weight.numpy(), qtype)
            qt = QuantizedTensor(int(qtype), torch.from_numpy(raw), tuple(weight.shape))
            param = layer.down_proj if part == "down" else layer.gate_up_proj
            layer.weight_loader(param, qt, (expert, part))
    return layer


def _dequantized(layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    experts = layer.quantized
    gate_up = [
        torch.cat([experts._part(e, "gate").dequantize(), experts._part(e, "up").dequantize()])
        for e in range(layer.num_experts)
    ]
    down = [experts._part(e, "down").dequantize() for e in range(layer.num_experts)]
    return torch.stack(gate_up), torch.stack(down)


@needs_c_kernels
@pytest.mark.parametrize("seed", range(3))
def test_c_experts_equal_reference_on_random_routings(seed):
    x, w_gate_up, w_down, logits = _random_experts(seed, hidden=64, inter=32)
    weights, ids = select_experts(logits, TOP_K, renormalize=seed % 2 == 0)
    layer = _layer(w_gate_up, w_down)

    got = layer(x, weights, ids)

    assert layer._c_path(x) is not None
    torch.testing.assert_close(got, fused_moe_ref(x, w_gate_up, w_down, weights, ids))


@needs_c_kernels
def test_c_experts_skip_idle_experts_and_serve_one_chosen_by_every_token():
    x, w_gate_up, w_down, _ = _random_experts(seed=9, hidden=64, inter=32)
    tokens = x.shape[0]
    ids = torch.stack([torch.full((tokens,), 5), torch.tensor([2, 3, 4, 6] * 3)], dim=1)
    weights = torch.rand(tokens, TOP_K, generator=torch.Generator().manual_seed(1))
    reference = fused_moe_ref(x, w_gate_up, w_down, weights, ids)
    for idle in (0, 1, 7):
        w_gate_up[idle], w_down[idle] = float("nan"), float("nan")
    layer = _layer(w_gate_up, w_down)

    got = layer(x, weights, ids)

    assert layer._c_path(x) is not None
    torch.testing.assert_close(got, reference)


@needs_c_kernels
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K])
@pytest.mark.parametrize("tokens", [1, 12])
def test_quantized_c_experts_equal_reference_on_dequantized_weights(qtype, tokens):
    """In place on the blocks (no dequantized copy), decode (1 token) and a small batch."""
    x, w_gate_up, w_down, logits = _random_experts(3, hidden=256, inter=256, tokens=tokens)
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    layer = _quantized_layer(w_gate_up, w_down, qtype)

    got = layer(x, weights, ids)

    assert layer._c_path(x) is not None
    assert layer.gate_up_proj.numel() == 0  # no dense copy of the experts
    want = fused_moe_ref(x, *_dequantized(layer), weights, ids)
    # One token of a K-quant: x as 24-bit fixed point, up to max|x| * 2^-24 per product.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
