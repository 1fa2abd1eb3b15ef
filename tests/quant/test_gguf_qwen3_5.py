"""llama.cpp's own `qwen35` GGUF files load in axon.

The converter that the llama-cpp-python sdist vendors (`convert_hf_to_gguf.py --no-mtp`) writes
them from a tiny random Qwen3.5 with twice as many GDN value heads as key heads, so it reorders
the value heads (grouped -> tiled), stores `-exp(A_log)`, adds 1 to the norms and squeezes the
conv. It accepts only tokenizers it recognises, so the checkpoint carries the real Qwen3.5
vocabulary (248k tokens; converting takes ~20 s, so the files are cached by what they are made
from). Through the real engine (batched, paged, chunked prefill under a 16-token budget):

- f32: last-position logits within fp32 noise of the safetensors load of the same checkpoint,
  and the same greedy tokens;
- q8_0 and f16: logits of transformers running the file's own dequantized weights (put back in
  HF order here, independently of axon's loader), within each format's activation rounding; q8_0
  also gives transformers' greedy tokens.
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
from transformers import Qwen3_5ForCausalLM

from axon.config import EngineConfig
from axon.engine.engine_core import EngineCore
from axon.kernels import ggml_cpu
from axon.loader.gguf import iterate_gguf
from axon.loader.gguf_config import config_class, gguf_config_kwargs, gguf_to_hf_config
from axon.loader.gguf_reader import BulkGGUFReader
from axon.sampling_params import SamplingParams
from llama_cpp_sdist import CACHE, cache_lock, extract_llama_cpp
from model.qwen3_5_tiny import build_qwen3_5, qwen3_5_engine_kwargs, swap_value_heads
from model.tiny_models import TinyModel, random_prompts
from unit.test_light_config import assert_same

VOCAB_SIZE = 248_320  # Qwen3.5's (padded); the converter checks the tokenizer's pre-tokenizer
OUTTYPES = ("f32", "q8_0", "f16")
PROMPTS = random_prompts((1, 5, 17, 40, 70), seed=3)
GREEDY_PROMPTS = random_prompts((1, 17, 40), seed=11)
GREEDY_STEPS = 8
MIN_REFERENCE_MARGIN = 1e-3
# f32: fp32 end to end; only the tiled value heads' summation order differs (measured 8e-6).
# q8_0: the C kernel multiplies the file's blocks with fp32 activations, the oracle the same
# weights dequantized (measured 2e-5); without a C compiler the int4 fallback rounds activations
# to bf16, and the other GGUF tests' bound applies. f16: the layers cast activations to fp16
# (layers/quantized.py), the oracle keeps fp32 (measured 0.23% of the largest logit). A layout
# bug (head order, norm offset, decay) is O(1).
ATOL = 1e-4
RTOL = {"f16": 1e-2, "q8_0": None if ggml_cpu.available() else 0.15}  # of the largest logit
WEIGHT_RTOL = {"f32": 1e-6, "f16": 1e-3, "q8_0": 1e-2}  # of a tensor's largest value
pytestmark = pytest.mark.slow  # converter runs and a real vocabulary


# ---- the checkpoint and its GGUF files --------------------------------------------------------


def real_vocab_qwen3_5(tokenizer):
    """The tiny random Qwen3.5 with `tokenizer`'s (the real) vocabulary."""
    return build_qwen3_5(
        "qwen3_5_text",
        vocab_size=VOCAB_SIZE,
        tie_word_embeddings=True,  # as the small Qwen3.5 models; halves the 248k-row matrices
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, qwen3_5_tokenizer) -> TinyModel:
    tokenizer = qwen3_5_tokenizer
    model = real_vocab_qwen3_5(tokenizer)
    assert model.config.linear_num_value_heads == 2 * model.config.linear_num_key_heads
    path = tmp_path_factory.mktemp("qwen35")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return TinyModel("qwen3_5_text", path, model)


@pytest.fixture(scope="module")
def converter() -> Path:
    """convert_hf_to_gguf.py with its `conversion` package and its own gguf-py."""

    def wanted(rest: str) -> bool:
        return rest == "convert_hf_to_gguf.py" or rest.startswith(("conversion/", "gguf-py/"))

    return extract_llama_cpp("", wanted, suffix="-converter") / "convert_hf_to_gguf.py"


@pytest.fixture(scope="module")
def gguf_files(converter: Path, checkpoint: TinyModel) -> dict[str, Path]:
    key = hashlib.sha256(str(converter.parent).encode())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        key.update((checkpoint.path / name).read_bytes())
    folder = CACHE / "qwen35-gguf" / key.hexdigest()[:16]
    files = {outtype: folder / f"{outtype}.gguf" for outtype in OUTTYPES}
    with cache_lock("qwen35-gguf"):
        _convert(converter, checkpoint.path, {t: f for t, f in files.items() if not f.is_file()})
    return files


def _convert(converter: Path, checkpoint: Path, files: dict[str, Path]) -> None:
    """Run the converter once per outtype, concurrently; each file appears only when complete."""
    runs = {}
    for outtype, file in files.items():
        file.parent.mkdir(parents=True, exist_ok=True)
        partial = file.with_suffix(".part")
        command = [sys.executable, str(converter), str(checkpoint), "--outtype", outtype]
        command += ["--outfile", str(partial), "--no-mtp"]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        runs[outtype] = (process, partial, file)
    failures = []
    for outtype, (process, partial, file) in runs.items():
        output, _ = process.communicate(timeout=600)
        if process.returncode == 0:
            os.replace(partial, file)
        else:
            tail = output.decode(errors="replace")[-2000:]
            failures.append(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{tail}")
    if failures:
        pytest.fail("\n".join(failures))


# ---- the engine -------------------------------------------------------------------------------


def _engine(checkpoint: TinyModel, model: Path) -> EngineCore:
    kwargs = qwen3_5_engine_kwargs(checkpoint, block_size=4, max_num_batched_tokens=16)
    kwargs.pop("model")
    kwargs["activation_precision"] = "float32"  # the exact path, token for token
    return EngineCore(EngineConfig.from_kwargs(str(model), **kwargs))


def _greedy(engine: EngineCore, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=GREEDY_STEPS, ignore_eos=True)
    seqs = [engine.add_request(f"greedy-{i}", p, params)[0] for i, p in enumerate(prompts)]
    while not all(seq.is_finished for seq in seqs):
        engine.step()
    return [seq.output_token_ids for seq in seqs]


@pytest.fixture(scope="module")
def safetensors_answers(checkpoint: TinyModel):
    engine = _engine(checkpoint, checkpoint.path)
    return engine.forward_logits(PROMPTS), _greedy(engine, GREEDY_PROMPTS)


def _max_diffs(got, want) -> list[float]:
    return [float((a - b).abs().max()) for a, b in zip(got, want, strict=True)]


def _assert_margins(reference: TinyModel) -> None:
    """The references' greedy steps are no near-ties, so equal tokens mean equal logits."""
    for prompt in GREEDY_PROMPTS:
        margin = reference.greedy(prompt, GREEDY_STEPS).min_margin
        assert margin > MIN_REFERENCE_MARGIN, f"near-tie for prompt of {len(prompt)}"


# ---- the oracle: a GGUF file's dequantized weights in HF order --------------------------------

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # what follows `blk.N.` -> what follows `model.layers.N.`
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _dequantized_model(path: Path, config) -> Qwen3_5ForCausalLM:
    model = Qwen3_5ForCausalLM(config).eval()
    state = _dequantized_state(BulkGGUFReader(str(path)), config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # the head is tied to the embedding
    return model


def _dequantized_state(reader, config) -> dict[str, torch.Tensor]:
    state = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = torch.from_numpy(np.array(values, dtype=np.float32))
        if tensor.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[tensor.name]
        else:
            _, layer, rest = tensor.name.split(".", 2)
            name = f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
        state[name] = _undo_converter(name, values, config)
    return state


def _undo_converter(name: str, values: torch.Tensor, config) -> torch.Tensor:
    """The converter's changes undone: norms +1, -exp(A_log), the conv squeezed, and the value
    heads tiled (conversion/qwen.py, Qwen3NextModel and _LinearAttentionVReorderBase)."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    head_dim, qk_rows = config.linear_value_head_dim, 2 * key_heads * config.linear_key_head_dim

    def grouped(tensor, dim, size):
        return swap_value_heads(tensor, dim, value_heads // key_heads, key_heads, size)

    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return values - 1
    if name.endswith("A_log"):
        return grouped(torch.log(-values), 0, 1)
    if name.endswith(("conv1d.weight", "in_proj_qkv.weight")):
        rows = torch.cat([values[:qk_rows], grouped(values[qk_rows:], 0, head_dim)])
        return rows[:, None] if name.endswith("conv1d.weight") else rows
    if name.endswith("in_proj_z.weight"):
        return grouped(values, 0, head_dim)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "dt_bias")):
        return grouped(values, 0, 1)
    if name.endswith("out_proj.weight"):
        return grouped(values, 1, head_dim)
    return values


# ---- tests ------------------------------------------------------------------------------------


def test_config_comes_from_metadata(gguf_files, checkpoint):
    want = checkpoint.config
    got = gguf_to_hf_config(BulkGGUFReader(str(gguf_files["q8_0"])))
    assert got.model_type == "qwen3_5_text"
    model_type, kwargs = gguf_config_kwargs(BulkGGUFReader(str(gguf_files["q8_0"])))
    assert_same(got, config_class(model_type)(**kwargs))
    assert got.linear_value_head_order == "tiled"
    for key in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "layer_types", "linear_conv_kernel_dim",
        "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "vocab_size", "tie_word_embeddings", "eos_token_id",
    ):  # fmt: skip
        assert getattr(got, key) == getattr(want, key), key
    for key in ("rope_theta", "partial_rotary_factor", "mrope_interleaved"):
        assert got.rope_parameters[key] == want.rope_parameters[key], key
    assert got.rope_parameters["mrope_section"] == want.rope_parameters["mrope_section"][:3]
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)


def test_f32_gguf_matches_the_safetensors_load(gguf_files, checkpoint, safetensors_answers):
    want_logits, want_tokens = safetensors_answers
    engine = _engine(checkpoint, gguf_files["f32"])

    diffs = _max_diffs(engine.forward_logits(PROMPTS), want_logits)
    tokens = _greedy(engine, GREEDY_PROMPTS)

    assert max(diffs) <= ATOL, f"max abs logit diffs {diffs}"
    _assert_margins(checkpoint)
    assert tokens == want_tokens
    assert tokens == [checkpoint.greedy(p, GREEDY_STEPS).token_ids for p in GREEDY_PROMPTS]


@pytest.mark.parametrize("outtype", ["q8_0", "f16"])
def test_quantized_gguf_matches_transformers_on_its_weights(outtype, gguf_files, checkpoint):
    path = gguf_files[outtype]
    oracle = TinyModel("qwen3_5_text", path, _dequantized_model(path, checkpoint.config))
    engine = _engine(checkpoint, path)

    got = engine.forward_logits(PROMPTS)

    want = [oracle.last_logits(p) for p in PROMPTS]
    diffs = _max_diffs(got, want)
    if RTOL[outtype] is not None:  # low-precision activations: logits only
        bound = RTOL[outtype] * max(float(w.abs().max()) for w in want)
        assert max(diffs) <= bound, f"max abs logit diffs {diffs} > {bound:.3e}"
        return
    assert max(diffs) <= ATOL, f"max abs logit diffs {diffs}"
    _assert_margins(oracle)
    tokens = _greedy(engine, GREEDY_PROMPTS)
    assert tokens == [oracle.greedy(p, GREEDY_STEPS).token_ids for p in GREEDY_PROMPTS]


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_oracle_weights_are_the_checkpoints(outtype, gguf_files, checkpoint):
    """The oracle's weights (the file's, put back in HF order) are the checkpoint's up to the
    format's rounding: the inverse mapping is right, and q8_0 / f16 files hold those formats."""
    reader = BulkGGUFReader(str(gguf_files[outtype]))
    matrix_type = {t.name: t.tensor_type.name for t in reader.tensors}["blk.0.ssm_out.weight"]
    assert matrix_type == outtype.upper()
    state = _dequantized_state(reader, checkpoint.config)
    for name, want in checkpoint.hf_model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        err = float((state[name] - want).abs().max())
        assert err <= WEIGHT_RTOL[outtype] * float(want.abs().max()) + 1e-6, f"{name}: {err:.3e}"


def test_mtp_blocks_are_skipped(tmp_path):
    """A GGUF converted without --no-mtp appends `nextn_predict_layers` blocks; the text model
    neither counts nor loads them."""
    path = tmp_path / "mtp.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_block_count(2)
    writer.add_uint32("qwen35.nextn_predict_layers", 1)
    writer.add_tensor("blk.0.attn_norm.weight", np.full(4, 1.5, dtype=np.float32))
    writer.add_tensor("blk.1.nextn.eh_proj.weight", np.zeros((4, 8), dtype=np.float32))
    writer.add_tensor("blk.1.attn_norm.weight", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    loaded = dict(iterate_gguf(BulkGGUFReader(str(path))))

    assert list(loaded) == ["model.layers.0.input_layernorm.weight"]
    assert torch.equal(loaded["model.layers.0.input_layernorm.weight"], torch.full((4,), 0.5))
