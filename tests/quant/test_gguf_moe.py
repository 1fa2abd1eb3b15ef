"""llama.cpp's own mixture-of-experts GGUF files (`qwen3moe`, `qwen35moe`) load in axon, experts
kept quantized.

The converter that the llama-cpp-python sdist vendors (`convert_hf_to_gguf.py`) writes them from
tiny random checkpoints (8 experts, top-2) carrying the real Qwen3 / Qwen3.5 vocabulary, which the
converter insists on; the files are cached by what they are made from. It stacks each layer's
experts in 3-D `ffn_{gate,up,down}_exps` tensors.

- `qwen3moe`: every layer sparse (llama.cpp's qwen3moe has no dense layers, so its converter
  refuses them); f32 and q8_0.
- `qwen35moe`: the hybrid Gated DeltaNet stack with routed experts plus the sigmoid-gated shared
  expert (`ffn_{gate,up,down}_shexp`, `ffn_gate_inp_shexp`); q8_0, and a Q4_K file made from it
  by requantizing the expert tensors with tests/quant/kquants.py (the converter writes no
  K-quants). Widths are 256 because a Q4_K row is made of 256-wide super-blocks.

Through the real engine (batched, paged, chunked prefill under a 16-token budget), the logits
equal those of transformers running the file's own dequantized weights (put back in HF order
here, independently of axon's loader), and so do q8_0's greedy tokens.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from transformers import (
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from axon.config import EngineConfig
from axon.engine.engine_core import EngineCore
from axon.kernels import ggml_cpu
from axon.layers.fused_moe import QuantizedExperts
from axon.loader.gguf_config import config_class, gguf_config_kwargs, gguf_to_hf_config
from axon.loader.gguf_reader import BulkGGUFReader
from axon.sampling_params import SamplingParams
from llama_cpp_sdist import CACHE, cache_lock, extract_llama_cpp
from model.qwen3_5_tiny import _perturb, qwen3_5_engine_kwargs
from model.tiny_models import TinyModel, engine_kwargs, random_prompts
from quant.kquants import quantize_k
from quant.test_gguf_qwen3_5 import _GLOBAL_NAMES as _QWEN35_GLOBAL_NAMES
from quant.test_gguf_qwen3_5 import _LAYER_NAMES as _QWEN35_LAYER_NAMES
from quant.test_gguf_qwen3_5 import _undo_converter as _undo_qwen35_converter
from tiny_configs import QWEN3_5_MOE_GGUF, QWEN3_MOE_GGUF
from unit.test_light_config import assert_same

OUTTYPES = ("f32", "q8_0")
PROMPTS = random_prompts((1, 5, 17, 40), seed=3)
GREEDY_PROMPTS = random_prompts((1, 17, 33, 5), seed=11)
GREEDY_STEPS = 8
MIN_REFERENCE_MARGIN = 1e-3
ATOL = 1e-4  # fp32 activations on both sides; without a C compiler, bf16 activations
RTOL = None if ggml_cpu.available() else 0.15  # of the largest logit (the int4 fallback)
Q4_K = GGMLQuantizationType.Q4_K
pytestmark = pytest.mark.slow  # converter runs and a real vocabulary


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, qwen3_tokenizer) -> TinyModel:
    tokenizer = qwen3_tokenizer
    config = Qwen3MoeConfig(
        **QWEN3_MOE_GGUF, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    config._attn_implementation = "eager"
    torch.manual_seed(99)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape) * 0.2)
    path = tmp_path_factory.mktemp("qwen3moe")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return TinyModel("qwen3_moe", path, model)


@pytest.fixture(scope="module")
def qwen35moe_checkpoint(tmp_path_factory, qwen3_5_tokenizer) -> TinyModel:
    tokenizer = qwen3_5_tokenizer
    config = Qwen3_5MoeTextConfig(
        **QWEN3_5_MOE_GGUF,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(5)
    model = Qwen3_5MoeForCausalLM(config).eval()
    _perturb(model, torch.Generator().manual_seed(6))  # norms, dt_bias, A_log
    path = tmp_path_factory.mktemp("qwen35moe")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return TinyModel("qwen3_5_moe_text", path, model)


@pytest.fixture(scope="module")
def converter() -> Path:
    def wanted(rest: str) -> bool:
        return rest == "convert_hf_to_gguf.py" or rest.startswith(("conversion/", "gguf-py/"))

    return extract_llama_cpp("", wanted, suffix="-converter") / "convert_hf_to_gguf.py"


@pytest.fixture(scope="module")
def gguf_files(converter: Path, checkpoint: TinyModel) -> dict[str, Path]:
    return _converted(converter, checkpoint.path, "qwen3moe-gguf", OUTTYPES)


@pytest.fixture(scope="module")
def qwen35moe_files(converter: Path, qwen35moe_checkpoint: TinyModel) -> dict[str, Path]:
    files = _converted(converter, qwen35moe_checkpoint.path, "qwen35moe-gguf", ("q8_0",))
    with cache_lock("qwen35moe-gguf"):
        files["q4_k"] = _requantize_experts(files["q8_0"], files["q8_0"].with_name("q4_k.gguf"))
    return files


def _converted(converter: Path, checkpoint: Path, kind: str, outtypes) -> dict[str, Path]:
    """The converter's files of `checkpoint`, cached by the converter and what they are made
    from."""
    key = hashlib.sha256(str(converter.parent).encode())
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        key.update((checkpoint / name).read_bytes())
    folder = CACHE / kind / key.hexdigest()[:16]
    files = {outtype: folder / f"{outtype}.gguf" for outtype in outtypes}
    # Qwen3.5-MoE checkpoints carry MTP blocks the converter keeps unless told; the converter
    # refuses the flag for architectures without them (qwen3moe).
    flags = ["--no-mtp"] if kind.startswith("qwen35") else []
    with cache_lock(kind):
        for outtype, file in files.items():
            if not file.is_file():
                _convert(converter, checkpoint, outtype, file, flags)
    return files


def _convert(converter: Path, checkpoint: Path, outtype: str, file: Path, flags=()) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_suffix(".part")
    command = [sys.executable, str(converter), str(checkpoint), "--outtype", outtype]
    command += ["--outfile", str(partial), *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{result.stderr[-2000:]}")
    os.replace(partial, file)


def _requantize_experts(source: Path, target: Path) -> Path:
    """A copy of `source` (metadata and tensors) whose `ffn_*_exps` tensors are Q4_K, once."""
    if target.is_file():
        return target
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    partial = target.with_suffix(".part")
    writer = gguf.GGUFWriter(str(partial), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer's own
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        data, qtype = tensor.data, tensor.tensor_type
        if tensor.name.endswith("_exps.weight"):  # [E, N, K]
            values = gguf.quants.dequantize(data, qtype)
            blocks = quantize_k(values.reshape(-1, values.shape[-1]), Q4_K)
            data, qtype = blocks.reshape(*values.shape[:-1], -1), Q4_K
        writer.add_tensor(tensor.name, np.array(data), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)
    return target


def _engine(checkpoint: TinyModel, model: Path) -> EngineCore:
    if checkpoint.arch == "qwen3_moe":
        kwargs = engine_kwargs(checkpoint, block_size=4, max_num_batched_tokens=16)
    else:
        kwargs = qwen3_5_engine_kwargs(checkpoint, block_size=4, max_num_batched_tokens=16)
    kwargs.pop("model")
    kwargs["activation_precision"] = "float32"  # the exact path, token for token
    return EngineCore(EngineConfig.from_kwargs(str(model), **kwargs))


# ---- the oracle: a GGUF file's dequantized weights in HF order --------------------------------

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
_QWEN35MOE_LAYER_NAMES = {
    **_QWEN35_LAYER_NAMES,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}


def _dequantized_state(path: Path, config) -> dict[str, torch.Tensor]:
    """The file's tensors dequantized by gguf-py, under HF names, with the converter's changes
    undone; a layer's stacked experts [E, N, K] become `experts.gate_up_proj` / `down_proj`."""
    qwen35 = config.model_type != "qwen3_moe"
    layer_names = _QWEN35MOE_LAYER_NAMES if qwen35 else _LAYER_NAMES
    state, stacked = {}, {}
    for tensor in BulkGGUFReader(str(path)).tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = torch.from_numpy(np.array(values, dtype=np.float32))
        if tensor.name in _QWEN35_GLOBAL_NAMES:
            name = _QWEN35_GLOBAL_NAMES[tensor.name]
        else:
            _, layer, rest = tensor.name.split(".", 2)
            if rest.endswith("_exps.weight"):
                stacked[layer, rest.removesuffix("_exps.weight").removeprefix("ffn_")] = values
                continue
            name = f"model.layers.{layer}.{layer_names[rest]}"
        state[name] = _undo_qwen35_converter(name, values, config) if qwen35 else values
    for (layer, proj), values in stacked.items():
        prefix = f"model.layers.{layer}.mlp.experts"
        if proj == "down":
            state[f"{prefix}.down_proj"] = values
        elif proj == "gate":
            state[f"{prefix}.gate_up_proj"] = torch.cat([values, stacked[layer, "up"]], dim=1)
    return state


def _oracle(checkpoint: TinyModel, path: Path) -> TinyModel:
    """transformers holding the file's weights, dequantized, in HF order."""
    config = checkpoint.config
    model_cls = Qwen3MoeForCausalLM if config.model_type == "qwen3_moe" else Qwen3_5MoeForCausalLM
    model = model_cls(config).eval()
    missing, unexpected = model.load_state_dict(_dequantized_state(path, config), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # the head is tied
    return TinyModel(checkpoint.arch, path, model)


# ---- tests ------------------------------------------------------------------------------------


def test_config_comes_from_metadata(gguf_files, checkpoint):
    got = gguf_to_hf_config(BulkGGUFReader(str(gguf_files["q8_0"])))
    want = checkpoint.config
    assert got.model_type == "qwen3_moe"
    model_type, kwargs = gguf_config_kwargs(BulkGGUFReader(str(gguf_files["q8_0"])))
    assert_same(got, config_class(model_type)(**kwargs))
    for key in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
        "mlp_only_layers", "norm_topk_prob", "num_hidden_layers", "head_dim", "vocab_size",
    ):  # fmt: skip
        assert getattr(got, key) == getattr(want, key), key


def test_qwen35moe_config_comes_from_metadata(qwen35moe_files, qwen35moe_checkpoint):
    got = gguf_to_hf_config(BulkGGUFReader(str(qwen35moe_files["q8_0"])))
    want = qwen35moe_checkpoint.config
    assert got.model_type == "qwen3_5_moe_text"
    model_type, kwargs = gguf_config_kwargs(BulkGGUFReader(str(qwen35moe_files["q8_0"])))
    assert_same(got, config_class(model_type)(**kwargs))
    assert got.linear_value_head_order == "tiled"
    for key in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_hidden_layers", "layer_types", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim", "vocab_size",
    ):  # fmt: skip
        assert getattr(got, key) == getattr(want, key), key


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_gguf_matches_transformers_on_its_weights(outtype, gguf_files, checkpoint):
    path = gguf_files[outtype]
    oracle = _oracle(checkpoint, path)
    engine = _engine(checkpoint, path)

    _assert_logits(engine.forward_logits(PROMPTS), oracle)

    experts = _quantized_experts(engine)
    assert len(experts) == (2 if outtype == "q8_0" else 0)  # f32 files load dense
    if outtype == "q8_0":
        _assert_greedy(engine, oracle)


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k"])
def test_qwen35moe_gguf_matches_transformers_on_its_weights(
    outtype, qwen35moe_files, qwen35moe_checkpoint
):
    path = qwen35moe_files[outtype]
    oracle = _oracle(qwen35moe_checkpoint, path)
    engine = _engine(qwen35moe_checkpoint, path)

    _assert_logits(engine.forward_logits(PROMPTS), oracle)

    experts = _quantized_experts(engine)
    want_type = Q4_K if outtype == "q4_k" else GGMLQuantizationType.Q8_0
    assert len(experts) == 2
    assert {qt.ggml_type for e in experts for qt in e._parts.values()} == {want_type}
    _assert_greedy(engine, oracle)


def test_qwen35moe_oracle_weights_are_the_checkpoints(qwen35moe_files, qwen35moe_checkpoint):
    """The oracle's weights (q8_0, put back in HF order) are the checkpoint's up to q8_0's
    rounding: its inverse mapping of names, stacks and head orders is right."""
    config = qwen35moe_checkpoint.config
    state = _dequantized_state(qwen35moe_files["q8_0"], config)
    for name, want in qwen35moe_checkpoint.hf_model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        err = float((state[name] - want).abs().max())
        assert err <= 1e-2 * float(want.abs().max()) + 1e-6, f"{name}: {err:.3e}"


def _quantized_experts(engine: EngineCore) -> list[QuantizedExperts]:
    return [m for m in engine.runner.model.modules() if isinstance(m, QuantizedExperts)]


def _assert_logits(got, oracle: TinyModel) -> None:
    want = [oracle.last_logits(p) for p in PROMPTS]
    diffs = [float((a - b).abs().max()) for a, b in zip(got, want, strict=True)]
    bound = ATOL if RTOL is None else RTOL * max(float(w.abs().max()) for w in want)
    assert max(diffs) <= bound, f"max abs logit diffs {diffs}"


def _assert_greedy(engine: EngineCore, oracle: TinyModel) -> None:
    if RTOL is not None:
        return  # low-precision activations: logits only
    params = SamplingParams(temperature=0, max_tokens=GREEDY_STEPS, ignore_eos=True)
    seqs = [engine.add_request(f"g-{i}", p, params)[0] for i, p in enumerate(GREEDY_PROMPTS)]
    while not all(seq.is_finished for seq in seqs):
        engine.step()
    for prompt, seq in zip(GREEDY_PROMPTS, seqs):
        reference = oracle.greedy(prompt, GREEDY_STEPS)
        assert reference.min_margin > MIN_REFERENCE_MARGIN, f"near-tie, prompt of {len(prompt)}"
        assert seq.output_token_ids == reference.token_ids, f"prompt of {len(prompt)}"
