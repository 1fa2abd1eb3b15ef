"""The q8_0 KV cache (kv_cache_dtype="q8_0"): the C cache write against its PyTorch twin
(layers/kv_quant.py) to the byte, the C decode and prefill attention reading it in place against
the reference attention of the twin's q8_0 queries over its dequantized cache (float32 rounding
only: the kernels' integer products of q8_0 queries and keys are exact), and both
against float attention over the unquantized K / V within a stated bound (the quantization's
own error), with GQA, sliding windows and softcaps, in this CPU's build and the AVX2 / baseline
ones."""

from __future__ import annotations

import pytest
import torch

import c_builds
from axon.kernels import abi, cpu_ops
from axon.layers import kv_quant
from axon.runner.memory import kv_bytes_per_token
from tests.unit.test_cpu_ops import (
    PREFILL_SHAPES,
    SHAPES,
    _close,
    _paged_case,
    _prefill_case,
    _prefill_reference,
    _reference,
)

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")
Q8 = kv_quant.Q8_0
# Attention over a q8_0 cache (queries rounded to q8_0 too, as the keys' dot products take them)
# vs float attention over the float K / V, for unit-normal queries, keys and values: each value
# is off by at most half its group's scale (max |x| / 254, about 0.015 here), which moves a score
# by ~0.01 and an output by ~0.01; measured up to 0.016 (decode) and 0.027 (prefill) over these
# cases. The bound leaves about 2x.
QUANT_ATOL = 5e-2


def _quantized(cache: torch.Tensor) -> torch.Tensor:
    return kv_quant.quantize_q8(cache)


def _widened(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    return kv_quant.dequantize_q8(cache, head_dim, torch.float32)


def _rounded(q: torch.Tensor) -> torch.Tensor:
    return kv_quant.round_query(q, torch.empty(0, dtype=Q8))


@pytest.mark.parametrize("head_dim", [128, 256, 64, 40, 16])
def test_cache_write_quantizes_as_the_twin_to_the_byte(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads = 9, 3
    qkv = torch.randn(tokens, 3 * heads * head_dim, generator=gen) * 4  # strided token rows
    k = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    v = qkv[:, heads * head_dim : 2 * heads * head_dim].view(tokens, heads, head_dim)
    k[0, 0] = 0.0  # an all-zero group: scale 0, values 0 (no NaN)
    k[1, 1, :8] = torch.tensor([1e-9, 65504.0, -3.0, 0.5, 0.25, -0.25, 127.5, -127.5])
    slots = torch.tensor([7, 0, 4, 12, 2, 9, 11, 1, 5])
    shape = kv_quant.cache_shape(Q8, 13, heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=Q8), torch.zeros(shape, dtype=Q8)
    cpu_ops.cache_write(k, v, slots, k_cache, v_cache)
    want_k, want_v = torch.zeros(shape, dtype=Q8), torch.zeros(shape, dtype=Q8)
    kv_quant.store(want_k, slots, k)
    kv_quant.store(want_v, slots, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    back = _widened(k_cache[slots], head_dim)
    assert not back.isnan().any()
    # each value within half a step of its group's scale
    group = kv_quant.q8_group(head_dim)
    scale = k.abs().view(tokens, heads, -1, group).amax(-1, keepdim=True) / 127
    error = (back - k).abs().view(tokens, heads, -1, group)
    assert bool((error <= scale * 0.5 * (1 + 2**-9) + 1e-30).all())


def test_a_q8_cache_counts_its_scales():
    # Qwen3-0.6B: 28 layers, 8 KV heads of 128: 136 bytes a head (128 values, 4 scales)
    assert kv_bytes_per_token(28, 8, 128, Q8) == 2 * 28 * 8 * 136
    assert kv_bytes_per_token(28, 8, 128, torch.float16) == 2 * 28 * 8 * 256
    assert kv_quant.cache_shape(Q8, 10, 2, 16) == (10, 2, 18)  # one scale: head_dim < 32


@pytest.mark.parametrize("window,softcap", [(None, None), (50, None), (20, 30.0)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,lens", [SHAPES[i] for i in (0, 2, 3, 4, 5)])
def test_paged_decode_attention_reads_q8_caches(heads, kv_heads, head_dim, lens, window, softcap):
    q, k_cache, v_cache, key_slots, lens, *_ = _paged_case(
        window, softcap, 3, heads, kv_heads, head_dim, lens
    )
    k8, v8 = _quantized(k_cache), _quantized(v_cache)
    scale = head_dim**-0.5
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        got = cpu_ops.paged_decode_attention(q, k8, v8, key_slots, lens, scale, softcap, window)
    finally:
        torch.set_num_threads(threads)
    k_back, v_back, q_back = _widened(k8, head_dim), _widened(v8, head_dim), _rounded(q)
    _close(got, _reference(q_back, k_back, v_back, key_slots, lens, window, softcap, scale))
    exact = _reference(q, k_cache, v_cache, key_slots, lens, window, softcap, scale)
    assert float((got - exact).abs().max()) <= QUANT_ATOL


@pytest.mark.parametrize("window,softcap", [(None, None), (20, 30.0), (1, None)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,chunks", PREFILL_SHAPES)
def test_paged_prefill_attention_reads_q8_caches(
    heads, kv_heads, head_dim, chunks, window, softcap
):
    q, k_cache, v_cache, rows, key_slots = _prefill_case(heads, kv_heads, head_dim, chunks, 2)
    k8, v8 = _quantized(k_cache), _quantized(v_cache)
    scale, slots = head_dim**-0.5, torch.cat(key_slots)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        got = cpu_ops.paged_prefill_attention(
            q, k8, v8, rows, slots, scale, softcap, window, torch.full(q.shape, 7.0)
        )
    finally:
        torch.set_num_threads(threads)
    k_back, v_back = _widened(k8, head_dim), _widened(v8, head_dim)
    args = (rows, key_slots, scale, softcap, window)
    q_back = _rounded(q)
    _close(got, _prefill_reference(q_back, k_back, v_back, *args, torch.full(q.shape, 7.0)))
    exact = _prefill_reference(q, k_cache, v_cache, *args, torch.full(q.shape, 7.0))
    assert float((got - exact).abs().max()) <= QUANT_ATOL


@pytest.fixture(scope="module", params=["avx2", "portable"])
def other_build(request):
    """cpu_ops.c built without AVX-512 and for the baseline ISA."""
    names = ("axon_cache_write", "axon_paged_decode_attention", "axon_paged_prefill_attention")
    return abi.declare(c_builds.variant(f"cpu_ops-{request.param}"), *names)


def test_q8_caches_in_the_other_builds(other_build):
    heads, kv_heads, head_dim, lens = SHAPES[0]
    q, k_cache, v_cache, key_slots, lens, *_ = _paged_case(20, 30.0, 5, *SHAPES[0])
    k8, v8 = torch.zeros_like(_quantized(k_cache)), torch.zeros_like(_quantized(v_cache))
    slots = torch.arange(k_cache.shape[0])
    other_build.axon_cache_write(
        k_cache.data_ptr(), kv_heads * head_dim, v_cache.data_ptr(), kv_heads * head_dim,
        slots.data_ptr(), slots.numel(), kv_heads, head_dim, k8.data_ptr(), v8.data_ptr(), 2,
    )  # fmt: skip
    assert torch.equal(k8, _quantized(k_cache)) and torch.equal(v8, _quantized(v_cache))
    k_back, v_back, scale = _widened(k8, head_dim), _widened(v8, head_dim), head_dim**-0.5
    got, width = torch.empty_like(q), key_slots.shape[1]
    scratch = torch.empty(2 * heads * width)
    other_build.axon_paged_decode_attention(
        q.data_ptr(), heads * head_dim, k8.data_ptr(), v8.data_ptr(), key_slots.data_ptr(), width,
        lens.data_ptr(), q.shape[0], heads, kv_heads, head_dim, scale, 30.0, 20, got.data_ptr(),
        scratch.data_ptr(), 2, 2,
    )  # fmt: skip
    _close(got, _reference(_rounded(q), k_back, v_back, key_slots, lens, 20, 30.0, scale))
    q, k_cache, v_cache, rows, key_slots = _prefill_case(*PREFILL_SHAPES[2], 1)
    heads, kv_heads, head_dim, _ = PREFILL_SHAPES[2]
    k8, v8, scale = _quantized(k_cache), _quantized(v_cache), head_dim**-0.5
    slots, got = torch.cat(key_slots), torch.full(q.shape, 7.0)
    other_build.axon_paged_prefill_attention(
        q.data_ptr(), q.stride(0), k8.data_ptr(), v8.data_ptr(), slots.data_ptr(),
        rows.data_ptr(), rows.shape[0], heads, kv_heads, head_dim, scale, 0.0, 40,
        got.data_ptr(), 2, 2,
    )  # fmt: skip
    k_back, v_back = _widened(k8, head_dim), _widened(v8, head_dim)
    want = _prefill_reference(
        _rounded(q), k_back, v_back, rows, key_slots, scale, None, 40, torch.full(q.shape, 7.0)
    )
    _close(got, want)
