"""The fused CPU kernels (kernels/cpu_ops.c) against their pure-PyTorch reference twins:
RMSNorm in both conventions, rotary in place on strided views (full and partial), paged decode
attention read in place from the cache (GQA, sliding window, softcap, padded slots, the shapes
and thread splits of its units) and paged prefill attention (several chunks, prefix hits, the
causal triangle and the window, GQA groups on and off the kernel's rows)."""

from __future__ import annotations

import pytest
import torch

import c_builds
from axon.kernels import abi, cpu_ops
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


@pytest.mark.parametrize("tokens", [3, 300])  # 300: split across threads
def test_rms_norm_reads_the_heads_of_a_fused_projection_in_place(tokens):
    qkv = torch.randn(tokens, (4 + 2 * 2) * 32)
    k = qkv[:, 4 * 32 : 6 * 32].view(tokens, 2, 32)  # Qwen3's k_norm input: token rows strided
    weight = torch.randn(32)
    for unit_offset in (False, True):
        got = cpu_ops.rms_norm(k, weight, 1e-6, unit_offset)
        assert got.is_contiguous() and got.shape == k.shape
        _close(got, rms_norm_ref(k, weight, 1e-6, unit_offset))


# 7 tokens: the kernel's own cos / sin (decode sizes); 300: a prefill's table of them.
@pytest.mark.parametrize("tokens", [7, 300])
@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_rotary_in_place_matches_reference_on_a_fused_projection(rotary_dim, tokens):
    heads, kv_heads, head_dim = 4, 2, 64
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096, {"rope_theta": 10000.0})
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided token rows
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.tensor([0, 1, 5, 17, 300, 2047, 4000] * (tokens // 7) + [9] * (tokens % 7))
    want_q, want_k = rope.forward_ref(positions, q.clone(), k.clone())
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    _close(got_q, want_q)
    _close(got_k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


def test_a_tokens_rotation_does_not_depend_on_the_token_count():
    """A prefill's table path rotates a token to the bit as a decode step's per-token path
    does (a speculative verify row, or a decode beside a prompt chunk, equals a decode's)."""
    rope = RotaryEmbedding(64, 64, 4096, {"rope_theta": 10000.0})
    positions = torch.arange(0, 4000, 13)  # 308 tokens: the table path
    q, k = torch.randn(len(positions), 4, 64), torch.randn(len(positions), 2, 64)
    whole_q, whole_k = rope(positions, q.clone(), k.clone())
    for t in (0, 150, 307):
        one_q, one_k = rope(positions[t : t + 1], q[t : t + 1].clone(), k[t : t + 1].clone())
        assert torch.equal(one_q[0], whole_q[t]) and torch.equal(one_k[0], whole_k[t])


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


def _prefill_case(heads, kv_heads, head_dim, chunks, seed=0):
    """chunks: (query_len, context_len) each; a flat batch with two decode rows between the
    chunks (their output rows must stay untouched), keys at scattered cache slots."""
    gen = torch.Generator().manual_seed(seed)
    slots = sum(c for _, c in chunks) + 7
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(slots, generator=gen)
    rows, key_slots, start, used = [], [], 0, 0
    for query_len, context_len in chunks:
        rows.append((start, query_len, context_len, used))
        key_slots.append(perm[used : used + context_len])
        start, used = start + query_len + 2, used + context_len
    # q rows of a fused projection: token rows strided, heads contiguous
    qkv = torch.randn(start, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(start, heads, head_dim)
    return q, k_cache, v_cache, torch.tensor(rows), key_slots


def _prefill_reference(q, k_cache, v_cache, rows, key_slots, scale, softcap, window, out):
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    for (start, query_len, context_len, _), slots in zip(rows.tolist(), key_slots):
        q_pos = torch.arange(query_len) + context_len - query_len
        k_pos = torch.arange(context_len)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= q_pos[:, None] - k_pos[None, :] < window
        qg = q[start : start + query_len].view(query_len, kv_heads, group, head_dim)
        qg = qg.permute(1, 2, 0, 3)  # [Hkv, G, Q, D]
        k = k_cache[slots].transpose(0, 1)[:, None]  # [Hkv, 1, C, D]
        v = v_cache[slots].transpose(0, 1)[:, None]
        o = attend_ref(qg, k, v, mask[None, None], scale, softcap)  # [Hkv, G, Q, D]
        out[start : start + query_len] = o.permute(2, 0, 1, 3).reshape(query_len, -1, head_dim)
    return out


# (heads, kv_heads, head_dim, chunks of (query_len, context_len)): Qwen3's 16 / 8 x 64 on a
# 300-token prompt; gemma-3's 4 / 1 x 256 with a prefix hit (context beyond the queries); groups
# of 6 (rows not a multiple of the lanes) and 40 (more heads than a unit's rows), plain
# multi-head, head_dims off the vector width; one-token and tiny chunks.
PREFILL_SHAPES = [
    (16, 8, 64, [(300, 300)]),
    (4, 1, 256, [(77, 200), (5, 5)]),
    (12, 2, 40, [(33, 33), (1, 90), (130, 131)]),
    (40, 1, 16, [(9, 20)]),
    (4, 4, 36, [(70, 70), (3, 3)]),
]


@pytest.mark.parametrize("window,softcap", [(None, None), (50, None), (20, 30.0), (1, None)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,chunks", PREFILL_SHAPES)
def test_paged_prefill_attention_matches_reference(
    heads, kv_heads, head_dim, chunks, window, softcap
):
    q, k_cache, v_cache, rows, key_slots = _prefill_case(heads, kv_heads, head_dim, chunks)
    sentinel = torch.full(q.shape, 7.0)
    want = _prefill_reference(
        q, k_cache, v_cache, rows, key_slots, head_dim**-0.5, softcap, window, sentinel.clone()
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))  # the parallel path, even on one core
    try:
        got = cpu_ops.paged_prefill_attention(
            q, k_cache, v_cache, rows, torch.cat(key_slots), head_dim**-0.5, softcap, window,
            sentinel.clone(),
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    _close(got, want)  # the decode rows between the chunks still hold the sentinel


# float16 caches (kv_cache_dtype): the kernels read the rounded values widened back, so they
# match the reference run on the float16 cache widened to float32.
@pytest.mark.parametrize("window,softcap", [(None, None), (20, 30.0)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,chunks", [PREFILL_SHAPES[i] for i in (0, 1, 2)])
def test_paged_prefill_attention_reads_float16_caches(
    heads, kv_heads, head_dim, chunks, window, softcap
):
    q, k_cache, v_cache, rows, key_slots = _prefill_case(heads, kv_heads, head_dim, chunks, 2)
    k16, v16 = k_cache.half(), v_cache.half()
    scale = head_dim**-0.5
    want = _prefill_reference(
        q, k16.float(), v16.float(), rows, key_slots, scale, softcap, window,
        torch.full(q.shape, 7.0),
    )  # fmt: skip
    got = cpu_ops.paged_prefill_attention(
        q, k16, v16, rows, torch.cat(key_slots), scale, softcap, window, torch.full(q.shape, 7.0)
    )
    _close(got, want)


@pytest.mark.parametrize("window,softcap", [(None, None), (50, None), (20, 30.0)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,lens", [SHAPES[i] for i in (0, 2, 4, 5)])
def test_paged_decode_attention_reads_float16_caches(
    heads, kv_heads, head_dim, lens, window, softcap
):
    q, k_cache, v_cache, key_slots, lens, *_ = _paged_case(
        window, softcap, 3, heads, kv_heads, head_dim, lens
    )
    k16, v16 = k_cache.half(), v_cache.half()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        got = cpu_ops.paged_decode_attention(
            q, k16, v16, key_slots, lens, head_dim**-0.5, softcap, window
        )
    finally:
        torch.set_num_threads(threads)
    want = _reference(q, k16.float(), v16.float(), key_slots, lens, window, softcap, head_dim**-0.5)
    _close(got, want)


def test_cache_write_rounds_into_a_float16_cache_as_torch_does():
    kv = torch.randn(5, 4 * 16) * 1000
    kv[0, :3] = torch.tensor([1e-8, 70000.0, 1.0 + 2**-11])  # subnormal, overflow, a tie
    k, v = kv[:, :32].view(5, 2, 16), kv[:, 32:].view(5, 2, 16)
    k_cache, v_cache = torch.zeros(9, 2, 16, dtype=torch.half), torch.zeros(9, 2, 16).half()
    slots = torch.tensor([7, 0, 4, 8, 2])
    cpu_ops.cache_write(k, v, slots, k_cache, v_cache)
    want_k, want_v = torch.zeros(9, 2, 16).half(), torch.zeros(9, 2, 16).half()
    want_k.index_copy_(0, slots, k.half())
    want_v.index_copy_(0, slots, v.half())
    assert torch.equal(k_cache.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), want_v.view(torch.int16))


@pytest.fixture(scope="module", params=["avx2", "portable"])
def other_build(request):
    """cpu_ops.c (which stands alone) built without AVX-512 (eight-lane vectors, the smaller
    tiles) and for the baseline ISA."""
    return abi.declare(c_builds.variant(f"cpu_ops-{request.param}"), "axon_paged_prefill_attention")


@pytest.mark.parametrize("heads,kv_heads,head_dim,chunks", PREFILL_SHAPES[:3])
def test_paged_prefill_attention_of_the_other_builds(
    other_build, heads, kv_heads, head_dim, chunks
):
    q, k_cache, v_cache, rows, key_slots = _prefill_case(heads, kv_heads, head_dim, chunks, 1)
    scale, window, slots = head_dim**-0.5, 40, torch.cat(key_slots)
    # float32 caches, then float16 ones read widened through the thread's staging rows
    for k, v, kv_f16 in ((k_cache, v_cache, 0), (k_cache.half(), v_cache.half(), 1)):
        want = _prefill_reference(
            q, k.float(), v.float(), rows, key_slots, scale, None, window, torch.full(q.shape, 7.0)
        )
        got = torch.full(q.shape, 7.0)
        other_build.axon_paged_prefill_attention(
            q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), slots.data_ptr(),
            rows.data_ptr(), rows.shape[0], heads, kv_heads, head_dim, scale, 0.0, window,
            got.data_ptr(), 2, kv_f16,
        )  # fmt: skip
        _close(got, want)


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
