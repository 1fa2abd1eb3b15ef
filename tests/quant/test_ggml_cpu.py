"""The C kernel (kernels/ggml_cpu.c) against its reference twin: dequantization bit for bit,
matmuls within float32 summation-order error of `F.linear(x, dequantize(W))`, at decode batches
and past MAX_TOKENS (dequantized panels). The int4 fallback keeps its own bf16 bound."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import c_builds
from axon.kernels import abi, ggml_cpu
from axon.kernels.ggml_dequant import dequantize_rows_ref
from axon.kernels.ggml_int4 import INT4_TYPES, int4_matmul, repack_int4
from axon.layers.quantized import QuantizedMatmul, QuantizedTensor, matmul_ref
from quant.test_dequant import COLS, FAST_PATH_RTOL, ROWS, _raw

pytestmark = pytest.mark.skipif(not ggml_cpu.available(), reason="no C compiler")
C_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FP32_RTOL = 1e-5


def _tensor(qtype: Q) -> QuantizedTensor:
    raw = torch.from_numpy(_raw(qtype, np.random.default_rng(int(qtype) + 7)).copy())
    return QuantizedTensor(qtype, raw, (ROWS, COLS))


@pytest.mark.parametrize("qtype", C_TYPES, ids=lambda t: t.name)
def test_dequant_is_bit_identical_to_the_reference(qtype):
    qt = _tensor(qtype)
    got = ggml_cpu.ggml_dequant(qt.data, qtype, COLS)
    assert torch.equal(
        got.view(torch.int32), dequantize_rows_ref(qt.data, qtype, COLS).view(torch.int32)
    )


@pytest.mark.parametrize("qtype", C_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 3, 16, ggml_cpu.MAX_TOKENS + 6])
def test_matmul_matches_the_reference_in_float32(qtype, batch):
    qt = _tensor(qtype)
    x = torch.randn(batch, COLS, generator=torch.Generator().manual_seed(batch))
    matmul = QuantizedMatmul(qt)
    assert matmul.kind == "ggml"
    got, want = matmul(x), matmul_ref(x, qt)
    assert got.shape == (batch, ROWS) and got.dtype == torch.float32
    assert float((got - want).abs().max()) <= FP32_RTOL * float(want.abs().max()), qtype.name


def _long_rows(qtype: Q, rows: int) -> torch.Tensor:
    """`rows` raw rows (more than one panel of the long-batch kernel at COLS wide)."""
    raw = _tensor(qtype).data
    return torch.cat([raw] * (rows // ROWS + 1))[:rows].contiguous()


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).abs().max()) <= FP32_RTOL * float(want.abs().max())


@pytest.mark.parametrize("qtype", C_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [65, 200, 513])
def test_long_batches_match_the_reference(qtype, tokens):
    """Past MAX_TOKENS: an odd row count over several panels (their size follows the L2), every
    token-tile remainder."""
    rows = 2 * ggml_cpu.panel_rows(COLS) + 139
    raw = _long_rows(qtype, rows)
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(tokens))
    got = ggml_cpu.GGMLWeights([(int(qtype), raw)], COLS).matmul(x)
    want = torch.nn.functional.linear(x, dequantize_rows_ref(raw, qtype, COLS))
    assert got.shape == (tokens, rows) and _close(got, want), qtype.name


def test_long_batches_fill_each_part_of_a_strided_output():
    parts = [(Q.Q4_K, 37), (Q.Q6_K, 101), (Q.Q8_0, 6)]  # e.g. q, k, v in different formats
    raws = [(int(qtype), _long_rows(qtype, rows)) for qtype, rows in parts]
    x = torch.randn(130, COLS, generator=torch.Generator().manual_seed(1))
    wide = torch.full((130, 150), 7.0)
    weights = ggml_cpu.GGMLWeights(raws, COLS)
    weights.matmul(x, out=wide[:, 3:147])
    want = torch.cat(
        [torch.nn.functional.linear(x, dequantize_rows_ref(raw, t, COLS)) for t, raw in raws], 1
    )
    assert _close(wide[:, 3:147], want)
    assert (wide[:, :3] == 7.0).all() and (wide[:, 147:] == 7.0).all()  # nothing else written


def test_long_batches_of_a_dense_float32_weight():
    weight = torch.randn(70, 96, generator=torch.Generator().manual_seed(2))
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(3))
    got = ggml_cpu.dense_weights(weight).matmul(x)
    assert _close(got, torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_k_quant_batch_one_keeps_float32_accuracy(qtype):
    """At batch 1 the K-quants multiply integer codes by x held as a 24-bit fixed point per 256
    values: with an activation outlier 300x the rest, the error against float64 stays within
    what rounding x to that fixed point allows (|w| times one step, max|x| / (2^23 - 1), of its
    block) plus the float32 path's own level. (The float32 path's error alone, the bound this
    test had, depends on the BLAS: it was a few percent too tight on an Intel Xeon.)"""
    qt = _tensor(qtype)
    x = torch.randn(5, COLS, generator=torch.Generator().manual_seed(3))  # the 5th runs at batch 1
    x[:, 7] = 300.0
    weight = dequantize_rows_ref(qt.data, qtype, COLS)
    want = x.double() @ weight.double().T
    got = QuantizedMatmul(qt)(x)
    float32_error = float((matmul_ref(x, qt).double() - want).abs().max())
    step = x.double().abs().reshape(5, -1, 256).amax(dim=2) / (127 * 65536 + 127 * 256 + 127)
    rounding = weight.double().abs() @ step.repeat_interleave(256, dim=1).T  # [rows, tokens]
    error = (got.double() - want).abs()
    floor = max(4 * float32_error, 1e-6 * float(want.abs().max()))
    assert (error <= rounding.T + floor).all(), (float(error.max()), float32_error)


def _saturated(qtype: Q) -> QuantizedTensor:
    """Blocks whose every code and sub-scale sits at its largest magnitude (d = 1, dmin = 0.5):
    the integer sums of the batch-1 path reach the bounds its int32 arithmetic relies on."""
    size, nbytes = {Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210)}[qtype]
    block = np.full(nbytes, 0xFF, dtype=np.uint8)  # every code and 6-bit scale at its max
    one, half = (np.array([v], dtype=np.float16).view(np.uint8) for v in (1.0, 0.5))
    if qtype == Q.Q6_K:
        block[192:208] = np.uint8(0x80)  # int8 sub-scales -128
        block[208:210] = one
    else:
        block[0:2], block[2:4] = one, half
    raw = np.tile(block, (ROWS, COLS // size))
    return QuantizedTensor(qtype, torch.from_numpy(raw), (ROWS, COLS))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_k_quant_batch_one_at_the_integer_bounds(qtype, sign):
    qt = _saturated(qtype)
    x = torch.full((1, COLS), sign)  # every digit of x at +-127
    weight = dequantize_rows_ref(qt.data, qtype, COLS)
    want = x.double() @ weight.double().T
    got = QuantizedMatmul(qt)(x).double()
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max()), qtype.name


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_batch_one_propagates_nan(qtype):
    qt = _tensor(qtype)
    x = torch.randn(1, COLS)
    x[0, 40] = float("nan")
    assert torch.isnan(QuantizedMatmul(qt)(x)).all()


def test_the_layer_shares_the_gguf_bytes():
    qt = _tensor(Q.Q8_0)
    assert QuantizedMatmul(qt).raw.data_ptr() == qt.data.data_ptr()  # no second copy


@pytest.mark.parametrize("qtype", sorted(INT4_TYPES), ids=lambda t: Q(t).name)
def test_int4_fallback_stays_within_bf16_tolerance(qtype):
    qt = _tensor(Q(qtype))
    x = torch.randn(5, COLS, generator=torch.Generator().manual_seed(3))
    got = int4_matmul(x, repack_int4(qt.data, qtype, ROWS))
    want = matmul_ref(x, qt)
    assert float((got - want).abs().max()) <= FAST_PATH_RTOL * float(want.abs().max())


@pytest.mark.parametrize("rows", [1, 3, 16, 32, 40])
@pytest.mark.parametrize("cols", [64, 100])
def test_small_batch_linear_matches_f_linear(rows, cols):
    from axon.layers.linear import SmallBatchLinear

    gen = torch.Generator().manual_seed(rows * cols)
    weight, bias = torch.randn(70, cols, generator=gen), torch.randn(70, generator=gen)
    x = torch.randn(rows, cols, generator=gen)
    linear = SmallBatchLinear()
    for b in (None, bias):
        got, want = linear(x, weight, b), torch.nn.functional.linear(x, weight, b)
        assert float((got - want).abs().max()) <= FP32_RTOL * float(want.abs().max())
    # The kernel runs only where it applies: float32 CPU, K a multiple of 32, <= MAX_ROWS rows.
    assert (linear._weights is not None) == (cols % 32 == 0 and rows <= linear.MAX_ROWS)
    weight.data = torch.randn(70, cols, generator=gen)  # a reload: re-prepared, not stale
    assert torch.allclose(linear(x, weight), torch.nn.functional.linear(x, weight), atol=1e-4)


def _has_avx512_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512bw" in flags and "avx512_vnni" in flags


@pytest.fixture(scope="module")
def avx2_library():
    """ggml_cpu.c (which stands alone) built for this CPU without AVX-512."""
    return abi.declare(c_builds.variant("ggml_cpu-avx2"), "axon_ggml_matmul")


@pytest.fixture(scope="module")
def portable_library():
    """ggml_cpu.c built for the baseline ISA: its plain C loops (no AVX2)."""
    return c_builds.variant("ggml_cpu-portable")


@pytest.mark.parametrize("variant", ["avx2_library", "portable_library"])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_long_batches_of_the_other_builds_match_the_reference(qtype, variant, request):
    """The long-batch kernel's other builds (AVX2: 8-row groups and their gather; portable: the
    plain transpose and tile): rows off the groups, a remainder of tokens, and the output's
    columns past the rows left as they were."""
    lib = request.getfixturevalue(variant)
    abi.declare(lib, "axon_ggml_matmul_panels")
    rows, tokens = 139, 67
    raw = _long_rows(qtype, rows)
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(4))
    got = torch.full((tokens, rows + 3), 7.0)
    types, ptrs = (ctypes.c_int * 1)(int(qtype)), (ctypes.c_void_p * 1)(raw.data_ptr())
    counts = (ctypes.c_int64 * 1)(rows)
    status = lib.axon_ggml_matmul_panels(
        1, types, ptrs, counts, COLS, x.data_ptr(), tokens, got.data_ptr(), rows + 3, 2
    )
    want = torch.nn.functional.linear(x, dequantize_rows_ref(raw, qtype, COLS))
    assert status == 0 and _close(got[:, :rows], want), qtype.name
    assert (got[:, rows:] == 7.0).all()


@pytest.mark.skipif(not _has_avx512_vnni(), reason="no AVX-512 BW + VNNI on this CPU")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_k_quant_batch_one_avx512_equals_avx2_bit_for_bit(qtype, avx2_library):
    """The AVX-512 batch-1 loop (Q6_K) computes the AVX2 loop's integer sums (two sub-blocks per
    instruction, folded to its eight lanes), so a build with AVX-512 and one without agree to
    the last bit."""
    x = torch.randn(1, COLS, generator=torch.Generator().manual_seed(5))
    x[0, 3] = 300.0
    for qt in (_tensor(qtype), _saturated(qtype)):
        want = torch.zeros(1, ROWS)
        args = (qt.data.data_ptr(), ROWS, COLS, x.data_ptr(), 1, want.data_ptr(), ROWS, 1)
        assert avx2_library.axon_ggml_matmul(int(qtype), *args) == 0
        assert torch.equal(QuantizedMatmul(qt)(x), want), qtype.name
