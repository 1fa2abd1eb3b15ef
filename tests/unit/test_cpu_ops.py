"""The fused CPU kernels (kernels/cpu_ops.c) against their pure-PyTorch reference twins:
RMSNorm in both conventions, rotary in place on strided views (full and partial), and paged
decode attention read in place from the cache (GQA, sliding window, softcap, padded slots,
the shapes and thread splits of its units)."""

from __future__ import annotations

import pytest
import torch

from axon.kernels import cpu_ops
from axon.layers.attention import attend_ref
from axon.layers.norm import rms_norm_ref
from axon.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")
RTOL = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= RTOL * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (5, 100), (3, 4, 256)])
def test_rms_norm_matches_reference(shape, unit_offset):
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    got = cpu_ops.rms_norm(x, weight, 1e-6, unit_offset)
    _close(got, rms_norm_ref(x, weight, 1e-6, unit_offset))


def test_rms_norm_reads_strided_rows():
    x = torch.randn(6, 3 * 64)[:, 64:128]  # every row a slice of a wider one
    weight = torch.randn(64)
    _close(cpu_ops.rms_norm(x, weight, 1e-5, False), rms_norm_ref(x, weight, 1e-5, False))


@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_rotary_in_place_matches_reference_on_a_fused_projection(rotary_dim):
    tokens, heads, kv_heads, head_dim = 7, 4, 2, 64
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096, {"rope_theta": 10000.0})
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided token rows
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.tensor([0, 1, 5, 17, 300, 2047, 4000])
    want_q, want_k = rope.forward_ref(positions, q.clone(), k.clone())
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    _close(got_q, want_q)
    _close(got_k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


def _paged_case(window, softcap, seed=0, heads=8, kv_heads=2, head_dim=32, lens=(1, 9, 23)):
    gen = torch.Generator().manual_seed(seed)
    slots = sum(lens) + 5
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen)
    lens = torch.tensor(lens)
    width = int(lens.max())
    # Each sequence's positions live at scattered slots; padding points at slot 0.
    perm = torch.randperm(slots, generator=gen)
    key_slots = torch.zeros(len(lens), width, dtype=torch.long)
    start = 0
    for row, length in enumerate(lens.tolist()):
        key_slots[row, :length] = perm[start : start + length]
        start += length
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    return q, k_cache, v_cache, key_slots, lens, window, softcap


def _reference(q, k_cache, v_cache, key_slots, lens, window, softcap, scale):
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    k = k_cache[key_slots].transpose(1, 2)  # [B, Hkv, C, D]
    v = v_cache[key_slots].transpose(1, 2)
    positions = torch.arange(key_slots.shape[1])
    mask = positions[None, :] < lens[:, None]
    if window is not None:
        mask &= (lens[:, None] - 1) - positions[None, :] < window
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    out = attend_ref(qg, k, v, mask[:, None, None, :], scale, softcap)
    return out.reshape(batch, heads, head_dim)


@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (None, 30.0), (6, 50.0)])
def test_paged_decode_attention_matches_reference(window, softcap):
    case = _paged_case(window, softcap)
    got = cpu_ops.paged_decode_attention(*case[:5], 0.125, softcap, window)
    _close(got, _reference(*case, 0.125))


# (heads, kv_heads, head_dim, lens): Qwen3's 16 / 8 x 128 and gemma-3's 4 / 1 x 256, long enough
# to run on several threads (batch 1 splits the KV heads, or one KV head's query heads), a
# head_dim off the kernel's 32 / 64 float tiles and off its 8 lanes, and plain multi-head.
SHAPES = [
    (16, 8, 128, (300, 17, 130, 64)),
    (16, 8, 128, (300,)),
    (4, 1, 256, (300,)),
    (4, 1, 256, (300, 5, 77)),
    (6, 2, 40, (33, 8, 300)),
    (6, 3, 36, (1, 300)),
    (4, 4, 64, (299, 3)),
]


@pytest.mark.parametrize("window,softcap", [(None, None), (50, None), (20, 30.0)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,lens", SHAPES)
def test_paged_decode_attention_shapes_and_threads(
    heads, kv_heads, head_dim, lens, window, softcap
):
    case = _paged_case(window, softcap, 1, heads, kv_heads, head_dim, lens)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))  # the parallel path, even on one core
    try:
        got = cpu_ops.paged_decode_attention(*case[:5], head_dim**-0.5, softcap, window)
    finally:
        torch.set_num_threads(threads)
    _close(got, _reference(*case, head_dim**-0.5))


@pytest.mark.parametrize("inter", [8, 100, 2048])
def test_act_and_mul_matches_reference(inter):
    from axon.layers.activation import GeluAndMul, SiluAndMul

    x = torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # saturated and zero lanes
    for layer in (SiluAndMul(), GeluAndMul("tanh")):
        _close(layer(x), layer.forward_ref(x))


def test_cache_write_scatters_strided_rows():
    kv = torch.randn(3, 4 * 16)
    k, v = kv[:, :32].view(3, 2, 16), kv[:, 32:].view(3, 2, 16)  # rows of a fused projection
    k_cache, v_cache = torch.zeros(10, 2, 16), torch.zeros(10, 2, 16)
    slots = torch.tensor([7, 0, 4])
    cpu_ops.cache_write(k, v, slots, k_cache, v_cache)
    want_k, want_v = torch.zeros(10, 2, 16), torch.zeros(10, 2, 16)
    want_k.index_copy_(0, slots, k)
    want_v.index_copy_(0, slots, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
