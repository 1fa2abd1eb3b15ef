"""GGML dequantization equals gguf-py's bit for bit; the fast matmul paths stay within bf16
tolerance of the reference `F.linear(x, dequantize(W))`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from axon.kernels.ggml_dequant import DEQUANTIZERS, dequantize_rows_ref
from axon.kernels.ggml_int4 import INT4_TYPES
from axon.layers.quantized import QuantizedMatmul, QuantizedTensor, matmul_ref
from quant.kquants import K_TYPES, quantize_k

ROWS, COLS = 48, 512
# Offsets of the fp16 super-block scales in types gguf-py cannot quantize (random codes).
_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,)}
# The int4 kernel rounds scales, zeros, activations and its output to bf16 (8-bit mantissa):
# measured 3e-3 .. 5e-3 of the output's max, like a plain bf16 matmul (2e-3 .. 3e-3).
FAST_PATH_RTOL = 1e-2


def _raw(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Raw rows [ROWS, row_bytes] of `qtype` encoding random normal weights (or random codes)."""
    data = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    if qtype in K_TYPES:
        return quantize_k(data, qtype)
    if qtype in _SCALE_OFFSETS:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (ROWS * COLS // block, size), dtype=np.uint8)
        for offset in _SCALE_OFFSETS[qtype]:
            scale = np.float16(rng.uniform(1e-3, 1e-2, (raw.shape[0], 1)))
            raw[:, offset : offset + 2] = scale.view(np.uint8)
        return raw.reshape(ROWS, -1)
    stored = quants.quantize(data, qtype)
    return stored.view(np.uint8).reshape(ROWS, -1)


def _reference(raw: np.ndarray, qtype: Q) -> np.ndarray:
    view = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype)
    stored = raw.view(view) if view is not None else raw
    return np.asarray(quants.dequantize(stored, qtype), dtype=np.float32).reshape(ROWS, COLS)


@pytest.mark.parametrize("qtype", [Q(t) for t in DEQUANTIZERS], ids=lambda t: t.name)
def test_dequantize_is_bit_identical_to_gguf(qtype):
    raw = _raw(qtype, np.random.default_rng(int(qtype)))

    got = dequantize_rows_ref(torch.from_numpy(raw.copy()), qtype, COLS).numpy()

    want = _reference(raw, qtype)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{qtype.name} differs"


def test_dequantize_rows_reads_only_those_rows():
    raw = torch.from_numpy(_raw(Q.Q4_K, np.random.default_rng(0)))
    qt = QuantizedTensor(Q.Q4_K, raw, (ROWS, COLS))
    index = torch.tensor([5, 0, 47, 5])

    assert torch.equal(qt.dequantize_rows(index), qt.dequantize()[index])


FAST_TYPES = sorted(INT4_TYPES | {Q.F16, Q.BF16, Q.Q2_K, Q.Q3_K})


@pytest.mark.parametrize("qtype", [Q(t) for t in FAST_TYPES], ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 7])
def test_quantized_matmul_matches_reference(qtype, batch):
    raw = torch.from_numpy(_raw(qtype, np.random.default_rng(int(qtype) + 100)).copy())
    qt = QuantizedTensor(qtype, raw, (ROWS, COLS))
    x = torch.randn(batch, COLS, generator=torch.Generator().manual_seed(1))

    got = QuantizedMatmul(qt)(x)

    want = matmul_ref(x, qt)
    assert got.shape == (batch, ROWS) and got.dtype == torch.float32
    scale = float(want.abs().max())
    rtol = 1e-6 if qtype in (Q.Q2_K, Q.Q3_K) else FAST_PATH_RTOL  # those dequantize in fp32
    assert float((got - want).abs().max()) <= rtol * scale, qtype.name
