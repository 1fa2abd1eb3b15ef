"""Decode attention over a context split in parts (kernels/cpu_ops.c's decode_split, flash
decoding: each part's output, maximum and total combined after), crossed here at a few dozen
positions: against the reference attention for float32, float16 and q8_0 caches with GQA,
sliding windows and softcaps; a sequence's result the same to the bit whatever the batch beside
it and the threads (a speculative verify row must equal its decode row)."""

from __future__ import annotations

import pytest
import torch

from axon.kernels import cpu_ops
from axon.layers import kv_quant
from tests.unit.test_cpu_ops import SHAPES, _close, _paged_case, _reference

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")
SPLIT = 64  # 300 positions: 5 parts, the last one short


@pytest.fixture
def split():
    previous = cpu_ops.set_decode_split(SPLIT)
    yield SPLIT
    cpu_ops.set_decode_split(previous)


def _decode(case, caches, threads: int) -> torch.Tensor:
    q, _, _, key_slots, lens, window, softcap = case
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        scale = q.shape[-1] ** -0.5
        return cpu_ops.paged_decode_attention(q, *caches, key_slots, lens, scale, softcap, window)
    finally:
        torch.set_num_threads(saved)


def _caches(case, kind: str):
    k, v = case[1], case[2]
    if kind == "q8_0":
        return kv_quant.quantize_q8(k), kv_quant.quantize_q8(v)
    return k.to(getattr(torch, kind)), v.to(getattr(torch, kind))


def _widened_case(case, caches, kind: str):
    """The case with the caches as the kernel reads them (and q8_0's queries rounded)."""
    q, _, _, *rest = case
    head_dim = q.shape[-1]
    k, v = (kv_quant.widen(c, head_dim, torch.float32) for c in caches)
    if kind == "q8_0":
        q = kv_quant.round_query(q, caches[0])
    return (q, k, v, *rest)


@pytest.mark.parametrize("kind", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("window,softcap", [(None, None), (150, None), (100, 30.0), (40, None)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,lens", [SHAPES[i] for i in (0, 1, 2, 4, 6)])
def test_split_decode_matches_reference(
    split, heads, kv_heads, head_dim, lens, window, softcap, kind
):
    case = _paged_case(window, softcap, 5, heads, kv_heads, head_dim, lens)
    caches = _caches(case, kind)
    got = _decode(case, caches, threads=2)
    _close(got, _reference(*_widened_case(case, caches, kind), head_dim**-0.5))


@pytest.mark.parametrize("kind", ["float32", "float16", "q8_0"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 1, 256), (6, 3, 36)])
def test_a_sequences_row_does_not_depend_on_its_batch_or_threads(
    split, heads, kv_heads, head_dim, kind
):
    lens = (300, 129, 64, 65, 7, 200)
    case = _paged_case(None, None, 6, heads, kv_heads, head_dim, lens)
    caches = _caches(case, kind)
    together = _decode(case, caches, threads=2)
    q, k, v, key_slots, lens_t, window, softcap = case
    for row in range(len(lens)):
        alone = (
            q[row : row + 1],
            k,
            v,
            key_slots[row : row + 1],
            lens_t[row : row + 1],
            None,
            None,
        )
        for threads in (1, 2):
            got = _decode(alone, caches, threads)
            assert torch.equal(got[0], together[row]), (row, threads)
