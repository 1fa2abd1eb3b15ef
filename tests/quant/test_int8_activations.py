"""Opt-in 8-bit activations (kernels/ggml_q8.c): activations quantized per
token per block as llama.cpp does (checked value for value), products equal to the reference
twin (quantized activations times the dequantized weights, float64) for every GGML type, a
token's output bit-identical whatever the batch around it, and the engine switch end to end."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import c_builds
from axon import LLM, SamplingParams
from axon.config import EngineConfig
from axon.kernels import abi, ggml_cpu, ggml_q8
from axon.server.schemas.node_protocol import ModelSpec
from model.tiny_models import random_prompts
from quant.gguf_files import build_gguf_model, write_gguf
from quant.test_dequant import COLS, ROWS, _raw

pytestmark = pytest.mark.skipif(not ggml_cpu.available(), reason="no C compiler")
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _raw_tensor(qtype: Q, seed: int = 7) -> torch.Tensor:
    return torch.from_numpy(_raw(qtype, np.random.default_rng(int(qtype) + seed)).copy())


def _x(tokens: int, seed: int) -> torch.Tensor:
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 40.0  # an outlier column: its blocks get a coarse scale
    x[0, 32:64] = 0.0  # an all-zero Q8_0 block (scale 0)
    return x


@pytest.mark.parametrize("block", [32, 256])
def test_activations_quantize_like_the_reference(block):
    x = _x(3, seed=1)
    x[1, :8] = torch.tensor([0.5, -0.5, 1.5, 2.5, 126.5, -126.5, 127.0, -1.0])  # ties to even
    want_q, want_d = ggml_q8.quantize_ref(x, block)
    for t in range(x.shape[0]):
        q, d, sums = ggml_q8.quantize(x[t], block)
        assert torch.equal(q, want_q[t]) and torch.equal(d, want_d[t])
        if block == 256:  # Q8_K: sums over each 16
            assert torch.equal(sums, q.view(-1, 16).sum(-1, dtype=torch.int16))
        else:  # Q8_1's s = d * sum(q)
            torch.testing.assert_close(sums, d * q.view(-1, 32).sum(-1).float())
    assert int(want_q.abs().max()) == 127 and torch.equal(want_q[0, 32:64], torch.zeros(32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [2, 7, 70])
def test_matmul_equals_the_reference_twin(qtype, tokens):
    raw = _raw_tensor(qtype)
    weights = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS, int8=True)
    assert weights.int8
    x = _x(tokens, seed=tokens)
    got, want = weights.matmul(x), ggml_q8.matmul_ref(x, raw, int(qtype), COLS)
    assert got.shape == (tokens, ROWS)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 2e-6 * scale, qtype.name
    # Not the float path: 8-bit activations move the result by far more than rounding.
    exact = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS).matmul(x)
    assert float((got - exact).abs().max()) > 1e-4 * scale


def test_fused_parts_fill_their_columns():
    """q, k, v-like parts of mixed types (K and legacy activations in one call) side by side."""
    parts = [(int(t), _raw_tensor(t, seed=s)) for s, t in enumerate((Q.Q4_K, Q.Q8_0, Q.Q6_K))]
    weights = ggml_cpu.GGMLWeights(parts, COLS, int8=True)
    x = _x(9, seed=2)
    want = torch.cat([ggml_q8.matmul_ref(x, raw, t, COLS) for t, raw in parts], dim=1)
    got = weights.matmul(x)
    assert float((got - want).abs().max()) <= 2e-6 * float(want.abs().max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_tokens_output_does_not_depend_on_the_batch(qtype):
    raw = _raw_tensor(qtype)
    weights = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS, int8=True)
    token = _x(1, seed=99)
    others = _x(69, seed=5)
    alone = ggml_q8.matmul(weights, token, torch.empty(1, ROWS))[0]
    in_five = weights.matmul(torch.cat([others[:2], token, others[2:4]]))[2]
    in_seventy = weights.matmul(torch.cat([others[:41], token, others[41:]]))[41]
    assert torch.equal(alone, in_five) and torch.equal(alone, in_seventy)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)
def test_widths_off_eight_blocks(qtype):
    """352 columns: 11 blocks, the last three past the kernel's eight-block steps."""
    cols = 352
    data = np.random.default_rng(3).standard_normal((ROWS, cols)).astype(np.float32) * 0.05
    raw = torch.from_numpy(gguf.quants.quantize(data, qtype).view(np.uint8).reshape(ROWS, -1))
    weights = ggml_cpu.GGMLWeights([(int(qtype), raw)], cols, int8=True)
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(8))
    got, want = weights.matmul(x), ggml_q8.matmul_ref(x, raw, int(qtype), cols)
    assert float((got - want).abs().max()) <= 2e-6 * float(want.abs().max())
    assert torch.equal(weights.matmul(x[3:5])[0], got[3])


EDGE_ROWS = 43  # units of 16 rows: 16, 16, then panels of 8 and 3 (rows past a panel's end)


def _q8_call(lib, weights: ggml_cpu.GGMLWeights, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    out = torch.full((x.shape[0], weights.rows), float("nan"))
    status = lib.axon_q8_matmul_parts(
        len(weights.parts), weights._types, weights._ptrs, weights._rows, weights.cols,
        x.data_ptr(), x.shape[0], out.data_ptr(), out.stride(0), threads,
    )  # fmt: skip
    assert status == 0
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tile_edges_match_one_token_calls(qtype):
    """Token counts around the 6-token tiles and rows off the 16-row units: every token's row
    is bit for bit its one-token call (a different kernel), and close to the reference twin."""
    raw = _raw_tensor(qtype)[:EDGE_ROWS].contiguous()
    weights = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS, int8=True)
    lib = abi.library()
    x = _x(33, seed=11)
    alone = torch.cat([_q8_call(lib, weights, x[t : t + 1]) for t in range(33)])
    for tokens in (2, 3, 5, 6, 7, 8, 9, 13, 33):
        for threads in (1, 2):
            got = _q8_call(lib, weights, x[:tokens], threads)
            assert torch.equal(got, alone[:tokens]), (tokens, threads)
    want = ggml_q8.matmul_ref(x, raw, int(qtype), COLS)
    assert float((alone - want).abs().max()) <= 2e-6 * float(want.abs().max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_one_token_row_walks_match_the_batch(qtype):
    """One token walks short K-quant rows (up to 12 blocks) one after the other and longer ones
    8 side by side (legacy rows always side by side; 32 and 33 blocks still cover two widths):
    with 21 rows (a last octet of 5), a token alone is bit for bit its row of a batch, and close
    to the reference twin."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    wide = torch.cat([_raw_tensor(qtype, seed=s) for s in range(7)], dim=1)  # [48, 7 rows' bytes]
    lib = abi.library()
    for blocks in (12, 13) if block == 256 else (32, 33):
        cols = blocks * block  # a row's blocks lie back to back: the first bytes of a wider row
        raw = wide[:21, : blocks * block_bytes].contiguous()
        weights = ggml_cpu.GGMLWeights([(int(qtype), raw)], cols, int8=True)
        x = torch.randn(7, cols, generator=torch.Generator().manual_seed(cols))
        batch = _q8_call(lib, weights, x)
        for t in (0, 6):
            for threads in (1, 2):
                assert torch.equal(_q8_call(lib, weights, x[t : t + 1], threads)[0], batch[t])
        want = ggml_q8.matmul_ref(x, raw, int(qtype), cols)
        assert float((batch - want).abs().max()) <= 2e-6 * float(want.abs().max())


def test_fused_parts_one_token_matches_the_batch():
    """Mixed K and legacy parts, rows off the units: the one-token kernel fills each part's
    columns with the bits the tiles give."""
    parts = [(int(t), _raw_tensor(t, seed=s)[:rows].contiguous())
             for s, (t, rows) in enumerate(((Q.Q6_K, 21), (Q.Q4_0, 43), (Q.Q5_K, 9)))]  # fmt: skip
    weights = ggml_cpu.GGMLWeights(parts, COLS, int8=True)
    lib = abi.library()
    x = _x(7, seed=13)
    batch = _q8_call(lib, weights, x, threads=2)
    for t in range(7):
        assert torch.equal(_q8_call(lib, weights, x[t : t + 1], threads=2)[0], batch[t])
    want = torch.cat([ggml_q8.matmul_ref(x, raw, t, COLS) for t, raw in parts], dim=1)
    assert float((batch - want).abs().max()) <= 2e-6 * float(want.abs().max())


def test_panels_prefetching_the_next_unit_match_one_token_calls():
    """A panel's decode prefetches the rows 16 x threads on (up to a part's end): parts of 91
    rows (five units and a short one) in one call, 16 tokens as a c16 decode step, every thread
    count gives each token's row bit for bit as its one-token call."""
    parts = [(int(t), torch.cat([_raw_tensor(t, seed=s), _raw_tensor(t, seed=s + 1)])[:91])
             for s, t in enumerate((Q.Q6_K, Q.Q8_0, Q.Q4_K))]  # fmt: skip
    weights = ggml_cpu.GGMLWeights([(t, raw.contiguous()) for t, raw in parts], COLS, int8=True)
    lib = abi.library()
    x = _x(16, seed=17)
    alone = torch.cat([_q8_call(lib, weights, x[t : t + 1]) for t in range(16)])
    for threads in (1, 2, 3):
        assert torch.equal(_q8_call(lib, weights, x, threads), alone), threads
    want = torch.cat([ggml_q8.matmul_ref(x, raw, t, COLS) for t, raw in parts], dim=1)
    assert float((alone - want).abs().max()) <= 2e-6 * float(want.abs().max())


def test_long_steps_in_token_passes_match_short_calls():
    """Past 512 KiB of int8 activations (1024 tokens at 512 columns) the rows are swept in passes
    of tokens: a 1030-token call gives each token the bits of shorter calls and one-token calls."""
    weights = ggml_cpu.GGMLWeights([(int(Q.Q4_K), _raw_tensor(Q.Q4_K)[:EDGE_ROWS].contiguous())],
                                   COLS, int8=True)  # fmt: skip
    lib = abi.library()
    x = torch.randn(1030, COLS, generator=torch.Generator().manual_seed(19))
    whole = _q8_call(lib, weights, x, threads=2)
    assert torch.equal(
        whole, torch.cat([_q8_call(lib, weights, x[:500]), _q8_call(lib, weights, x[500:])])
    )
    for t in (1023, 1024, 1029):
        assert torch.equal(_q8_call(lib, weights, x[t : t + 1])[0], whole[t]), t


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [EDGE_ROWS, 64, 5])
def test_packed_panels_are_the_same_bits_as_the_blocks(qtype, rows):
    """Q4_K / Q6_K repacked into panels at load (ggml_q8.pack): every tile shape, the one-token
    path, fused beside other formats and on 2 threads give the bits of the GGUF blocks."""
    raw = torch.cat([_raw_tensor(qtype, seed=s) for s in range(2)])[:rows].contiguous()
    blocks = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS, int8=True)
    packed = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS, int8=True, pack=True)
    packed_type, block_bytes = ggml_q8.PACKED[int(qtype)]
    assert list(packed._types) == [packed_type] and list(packed._rows) == [rows]
    assert packed._kernel_parts[0][1].numel() == (rows + 15) // 16 * COLS // 256 * block_bytes
    lib = abi.library()
    x = _x(33, seed=21)
    for tokens in (1, 2, 5, 6, 7, 16, 33):
        for threads in (1, 2):
            want = _q8_call(lib, blocks, x[:tokens], threads)
            assert torch.equal(_q8_call(lib, packed, x[:tokens], threads), want), (tokens, threads)
    parts = [(int(Q.Q5_K), _raw_tensor(Q.Q5_K)[:19].contiguous()), (int(qtype), raw)]
    fused = ggml_cpu.GGMLWeights(parts, COLS, int8=True, pack=True)
    got = fused.matmul(x[:9])
    assert torch.equal(got[:, 19:], _q8_call(lib, blocks, x[:9]))
    assert torch.equal(got[:, :19], ggml_cpu.GGMLWeights(parts[:1], COLS, int8=True).matmul(x[:9]))
    assert torch.equal(fused.matmul(x[:1]), got[:1])


@pytest.fixture(scope="module")
def variant_libs():
    """ggml_q8.c alone, built for AVX2 tiles and for the baseline ISA's loops."""
    return {
        name: abi.declare(c_builds.variant(f"ggml_q8-{name}"), "axon_q8_matmul_parts")
        for name in ("avx2", "portable")
    }


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_vnni_avx2_and_portable_builds_agree_bit_for_bit(qtype, variant_libs):
    raw = _raw_tensor(qtype)[:EDGE_ROWS].contiguous()
    weights = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS, int8=True)
    x = _x(9, seed=12)
    packed = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS, int8=True, pack=True)
    for x_part in (x[:1], x):  # the one-token kernel and the tiles
        want = _q8_call(abi.library(), weights, x_part)
        for name, lib in variant_libs.items():
            assert torch.equal(_q8_call(lib, weights, x_part), want), name
            if int(qtype) in ggml_q8.PACKED:  # and its panels, which the portable build unpacks
                assert torch.equal(_q8_call(lib, packed, x_part), want), name


def test_float32_weights_stay_on_the_float_path():
    weight = torch.randn(16, 64)
    weights = ggml_cpu.GGMLWeights([(ggml_cpu.F32, weight.view(torch.uint8))], 64, int8=True)
    assert not weights.int8
    x = torch.randn(3, 64)
    torch.testing.assert_close(weights.matmul(x), x @ weight.T, rtol=1e-5, atol=1e-5)


ENGINE_ARGS = dict(dtype="float32", block_size=4, max_model_len=128, kv_cache_memory=1 << 20)


@pytest.fixture(scope="module")
def q4_k_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "qwen3-Q4_K.gguf"
    return write_gguf(build_gguf_model("qwen3"), "qwen3", Q.Q4_K, path)[0]


def test_engine_int8_generates_close_to_the_float_path(q4_k_file):
    exact = LLM(str(q4_k_file), activation_precision="float32", **ENGINE_ARGS)
    int8 = LLM(str(q4_k_file), activation_precision="int8", **ENGINE_ARGS)
    matmul = int8.engine.runner.model.model.layers[0].mlp.down_proj.quantized.parts["None"]
    assert (
        matmul.int8
        and not exact.engine.runner.model.model.layers[0].mlp.down_proj.quantized.parts["None"].int8
    )
    prompts = random_prompts((9, 21, 30, 5, 17, 12), seed=4)
    want, got = exact.engine.forward_logits(prompts), int8.engine.forward_logits(prompts)
    fused = int8.engine.runner.model.model.layers[0].mlp.down_proj.quantized
    assert list(fused._ggml._types) == [ggml_q8.Q4_K_PANELS]  # repacked for the 8-bit tiles
    agree = sum(int(w.argmax()) == int(g.argmax()) for w, g in zip(want, got))
    assert agree >= len(prompts) - 1
    for w, g in zip(want, got):
        assert not torch.equal(w, g)  # the prompts' prefill ran with 8-bit activations
        # A tiny random model moves ~4 % (max |logit| difference); KL ~0.005 nats.
        assert float((w - g).abs().max()) <= 0.15 * float(w.abs().max())
        kl = torch.sum(w.softmax(-1) * (w.log_softmax(-1) - g.log_softmax(-1)))
        assert float(kl) <= 0.05
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts[:4]]  # batched decode steps too
    outputs = int8.generate(requests, params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)


def test_bad_activation_precision_is_refused(q4_k_file):
    with pytest.raises(ValueError, match="activation_precision must be float32 or int8"):
        EngineConfig(model=str(q4_k_file), activation_precision="int4")
    with pytest.raises(ValueError, match="int8 applies to GGUF weights"):
        EngineConfig(model="/some/safetensors/dir", activation_precision="int8")
    with pytest.raises(ValueError, match="activation_precision"):  # pydantic: a 400 over HTTP
        ModelSpec(model_id="m", activation_precision="fp8")
    assert ModelSpec(model_id="m", activation_precision="int8").engine_args() == {
        "activation_precision": "int8"
    }


def test_kv_cache_dtype_follows_the_activation_precision_unless_set(q4_k_file):
    import torch

    model = str(q4_k_file)
    assert EngineConfig(model=model).kv_torch_dtype(torch.float32) == torch.float32
    int8 = EngineConfig(model=model, activation_precision="int8")
    assert int8.kv_torch_dtype(torch.float32) == torch.float16  # llama.cpp's default cache
    chosen = EngineConfig(model=model, activation_precision="int8", kv_cache_dtype="fp32")
    assert chosen.kv_torch_dtype(torch.float32) == torch.float32
    assert EngineConfig(model=model, kv_cache_dtype="bf16").kv_torch_dtype(torch.float32) == (
        torch.bfloat16
    )
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of"):
        EngineConfig(model=model, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):  # pydantic: a 400 over HTTP
        ModelSpec(model_id="m", kv_cache_dtype="int8")
    assert ModelSpec(model_id="m", kv_cache_dtype="float16").engine_args() == {
        "kv_cache_dtype": "float16"
    }


def test_cli_flag_reaches_the_engine_arguments(capsys):
    from axon.cli import build_parser, engine_args_from_namespace
    from axon.server.serve_args import config_from_namespace

    parser = build_parser()
    ns = parser.parse_args(["serve", "m.gguf", "--activation-precision", "int8"])
    config = config_from_namespace(ns, environ={})
    assert config.engine_args(config.default_models[0])["activation_precision"] == "int8"
    ns = parser.parse_args(["generate", "--model", "m.gguf", "--prompt", "hi"])
    assert "activation_precision" not in engine_args_from_namespace(ns)  # the default: auto
    ns = parser.parse_args(
        ["generate", "--model", "m.gguf", "--prompt", "hi", "--kv-cache-dtype", "float16"]
    )
    assert engine_args_from_namespace(ns)["kv_cache_dtype"] == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--activation-precision", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
