"""BlockManager bookkeeping, to the exact block: ids, ref counts, free counts, eviction order.

Pure Python, no torch. `compute` plays the scheduler's part: allocate room for a chunk, count it
as computed, then register the full blocks in the prefix cache.
"""

from __future__ import annotations

import hashlib
from array import array

import pytest

from axon.cache import block_manager as block_manager_module
from axon.cache.block_manager import BlockManager, chain_hash
from axon.sampling_params import SamplingParams
from axon.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(token_ids: list[int]) -> Sequence:
    return Sequence("req", token_ids, SamplingParams())


def compute(bm: BlockManager, seq: Sequence, num_new_tokens: int | None = None) -> None:
    """Allocate for and compute `num_new_tokens` more tokens (default: all the rest)."""
    if num_new_tokens is None:
        num_new_tokens = seq.num_tokens - seq.num_computed_tokens
    assert bm.can_allocate(seq, num_new_tokens)
    bm.allocate(seq, num_new_tokens)
    seq.num_computed_tokens += num_new_tokens
    bm.cache_full_blocks(seq)


def hashes_of(token_ids: list[int], num_blocks: int) -> list[bytes]:
    """The chained hashes of the first `num_blocks` full blocks of `token_ids`."""
    hashes: list[bytes] = []
    for index in range(num_blocks):
        block = tuple(token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
        hashes.append(chain_hash(hashes[-1] if hashes else None, block))
    return hashes


def ref_counts(bm: BlockManager) -> list[int]:
    return [block.ref_count for block in bm.blocks]


# ---- construction and capacity ------------------------------------------------------------------


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4), (4, -2)])
def test_rejects_non_positive_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="num_blocks and block_size"):
        BlockManager(num_blocks, block_size)


def test_fresh_manager_is_all_free() -> None:
    bm = BlockManager(10, BLOCK_SIZE)
    assert bm.num_free_blocks == 10
    assert bm.usage == 0.0
    assert ref_counts(bm) == [0] * 10
    assert not bm.cached_free
    assert not bm.hash_to_block


def test_allocation_takes_lowest_ids_first() -> None:
    bm = BlockManager(10, BLOCK_SIZE, enable_prefix_caching=False)
    a = make_seq(list(range(10)))
    b = make_seq(list(range(4)))
    bm.allocate(a, 10)
    bm.allocate(b, 4)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3]
    assert ref_counts(bm) == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 6
    assert bm.usage == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("num_tokens", "expected_blocks"),
    [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (12, 3), (13, 4)],
)
def test_num_new_blocks_at_block_boundaries(num_tokens: int, expected_blocks: int) -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(list(range(16)))
    assert bm.num_new_blocks(seq, num_tokens) == expected_blocks


def test_num_new_blocks_counts_only_blocks_beyond_the_table() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(list(range(16)))
    bm.allocate(seq, 3)
    seq.num_computed_tokens = 3
    assert bm.num_new_blocks(seq, 1) == 0  # token 3 still fits in block 0
    assert bm.num_new_blocks(seq, 2) == 1  # token 4 starts block 1
    bm.allocate(seq, 1)
    seq.num_computed_tokens = 4
    assert seq.block_table == [0]
    assert bm.num_new_blocks(seq, 1) == 1
    assert bm.num_new_blocks(seq, 4) == 1
    assert bm.num_new_blocks(seq, 5) == 2
    # A table already longer than needed never asks for a negative number.
    bm.allocate(seq, 8)
    assert seq.block_table == [0, 1, 2]
    assert bm.num_new_blocks(seq, 1) == 0


def test_can_allocate_at_the_exact_capacity() -> None:
    bm = BlockManager(3, BLOCK_SIZE)
    seq = make_seq(list(range(20)))
    assert bm.can_allocate(seq, 12)  # 3 * block_size
    assert not bm.can_allocate(seq, 13)  # one token more needs a 4th block
    other = make_seq(list(range(8)))
    bm.allocate(other, 8)
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(seq, 4)
    assert not bm.can_allocate(seq, 5)


def test_allocate_grows_the_table_one_block_per_boundary() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(list(range(16)))
    bm.allocate(seq, 4)
    assert seq.block_table == [0]
    seq.num_computed_tokens = 4
    bm.allocate(seq, 1)
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 5
    bm.allocate(seq, 3)  # fills block 1 exactly
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 8
    bm.allocate(seq, 5)
    assert seq.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 4


def test_free_returns_blocks_and_resets_the_sequence() -> None:
    bm = BlockManager(10, BLOCK_SIZE, enable_prefix_caching=False)
    a = make_seq(list(range(10)))
    b = make_seq(list(range(4)))
    compute(bm, a)
    compute(bm, b)
    bm.free(a)
    assert a.block_table == []
    assert a.block_hashes == []
    assert a.num_computed_tokens == 0
    assert ref_counts(bm)[:4] == [0, 0, 0, 1]
    assert bm.num_free_blocks == 9
    # Freed blocks go back on the free list and are handed out lowest id first again.
    c = make_seq(list(range(16)))
    bm.allocate(c, 16)
    assert c.block_table == [0, 1, 2, 4]


# ---- fork (n > 1) -------------------------------------------------------------------------------


def test_fork_shares_full_prompt_blocks_and_counts_references() -> None:
    bm = BlockManager(10, BLOCK_SIZE)
    prompt = list(range(10))
    parent = make_seq(prompt)
    compute(bm, parent)
    assert parent.block_table == [0, 1, 2]
    children = [make_seq(prompt), make_seq(prompt)]
    for child in children:
        bm.fork(parent, child, parent.num_prompt_tokens - 1)
        assert child.block_table == [0, 1]
        assert child.block_hashes == parent.block_hashes[:2]
        assert child.num_computed_tokens == 8
    assert ref_counts(bm)[:4] == [3, 3, 1, 0]
    assert bm.num_free_blocks == 7  # sharing takes no new blocks

    bm.free(parent)
    assert ref_counts(bm)[:4] == [2, 2, 0, 0]
    assert bm.num_free_blocks == 8
    bm.free(children[0])
    assert ref_counts(bm)[:3] == [1, 1, 0]
    bm.free(children[1])
    assert ref_counts(bm) == [0] * 10
    assert bm.num_free_blocks == 10


def test_fork_of_less_than_a_block_shares_nothing() -> None:
    bm = BlockManager(4, BLOCK_SIZE)
    parent = make_seq([1, 2, 3, 4])
    compute(bm, parent)
    child = make_seq([1, 2, 3, 4])
    bm.fork(parent, child, parent.num_prompt_tokens - 1)
    assert child.block_table == []
    assert child.num_computed_tokens == 0
    assert ref_counts(bm)[0] == 1


def test_fork_without_prefix_caching_still_shares() -> None:
    bm = BlockManager(4, BLOCK_SIZE, enable_prefix_caching=False)
    parent = make_seq(list(range(9)))
    compute(bm, parent)
    child = make_seq(list(range(9)))
    bm.fork(parent, child, 8)
    assert child.block_table == [0, 1]
    assert child.block_hashes == []
    assert ref_counts(bm) == [2, 2, 1, 0]


# ---- cache_full_blocks --------------------------------------------------------------------------


def test_cache_full_blocks_registers_only_full_computed_blocks() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    tokens = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    seq = make_seq(tokens)
    h0, h1 = hashes_of(tokens, 2)

    compute(bm, seq, 3)  # block 0 is not full yet
    assert seq.block_hashes == []
    assert bm.hash_to_block == {}

    compute(bm, seq, 3)  # 6 computed: block 0 full, block 1 half
    assert seq.block_table == [0, 1]
    assert seq.block_hashes == [h0]
    assert bm.hash_to_block == {h0: 0}
    assert bm.blocks[0].block_hash == h0
    assert bm.blocks[0].token_ids == (10, 11, 12, 13)
    assert bm.blocks[1].block_hash is None

    compute(bm, seq, 4)  # 10 computed: blocks 0 and 1 full, block 2 holds 2 tokens
    assert seq.block_table == [0, 1, 2]
    assert seq.block_hashes == [h0, h1]
    assert bm.hash_to_block == {h0: 0, h1: 1}
    assert bm.blocks[1].token_ids == (14, 15, 16, 17)
    assert bm.blocks[2].block_hash is None


def test_allocated_but_uncomputed_blocks_are_not_cached() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(list(range(12)))
    bm.allocate(seq, 12)
    seq.num_computed_tokens = 7
    bm.cache_full_blocks(seq)
    assert len(seq.block_hashes) == 1
    assert list(bm.hash_to_block.values()) == [0]


def test_decoded_tokens_fill_and_cache_blocks() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    seq = make_seq([1, 2, 3, 4, 5, 6, 7])
    compute(bm, seq)
    assert len(seq.block_hashes) == 1
    seq.append_token(8)  # the sampled token completes block 1 once computed
    compute(bm, seq, 1)
    assert seq.block_hashes == hashes_of([1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert bm.blocks[1].token_ids == (5, 6, 7, 8)


# ---- match_prefix -------------------------------------------------------------------------------


def test_match_prefix_hits_the_cached_full_blocks() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    prompt = list(range(10))
    first = make_seq(prompt)
    compute(bm, first)
    second = make_seq(prompt)
    bm.match_prefix(second)
    assert second.block_table == [0, 1]
    assert second.block_hashes == first.block_hashes
    assert second.num_computed_tokens == 8
    assert second.num_cached_tokens == 8
    assert ref_counts(bm)[:3] == [2, 2, 1]
    assert bm.num_free_blocks == 5  # hits on blocks in use take nothing from the pool
    assert bm.prefix_cache_queries == 10
    assert bm.prefix_cache_hits == 8


def test_match_prefix_leaves_the_last_prompt_token_to_compute() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    prompt = list(range(8))  # exactly two full blocks
    first = make_seq(prompt)
    compute(bm, first)
    assert len(bm.hash_to_block) == 2
    second = make_seq(prompt)
    bm.match_prefix(second)
    assert second.block_table == [0]  # block 1 is cached but would leave nothing to compute
    assert second.num_computed_tokens == 4
    assert ref_counts(bm)[:2] == [2, 1]
    assert bm.num_new_blocks(second, 4) == 1


def test_match_prefix_on_a_one_block_prompt_hits_nothing() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    first = make_seq([1, 2, 3, 4])
    compute(bm, first)
    second = make_seq([1, 2, 3, 4])
    bm.match_prefix(second)
    assert second.block_table == []
    assert second.num_computed_tokens == 0
    assert bm.prefix_cache_queries == 4
    assert bm.prefix_cache_hits == 0


def test_match_prefix_stops_at_the_first_differing_block() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    first = make_seq(list(range(13)))
    compute(bm, first)
    second = make_seq([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])
    bm.match_prefix(second)
    assert second.block_table == [0]
    assert second.num_computed_tokens == 4
    # Only the block that hit gained a reference.
    assert ref_counts(bm)[:4] == [2, 1, 1, 1]


def test_match_prefix_is_a_no_op_for_a_sequence_with_blocks_or_progress() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    prompt = list(range(10))
    compute(bm, make_seq(prompt))
    with_blocks = make_seq(prompt)
    bm.allocate(with_blocks, 4)
    bm.match_prefix(with_blocks)
    assert with_blocks.block_table == [3]
    with_progress = make_seq(prompt)
    with_progress.num_computed_tokens = 4
    bm.match_prefix(with_progress)
    assert with_progress.block_table == []
    assert bm.prefix_cache_queries == 0
    assert bm.prefix_cache_hits == 0


def test_same_block_at_another_position_does_not_hit() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    first = make_seq(x + y + [9])
    compute(bm, first)
    # Y was cached after X; as a first block it has another chained hash.
    second = make_seq(y + [9])
    bm.match_prefix(second)
    assert second.block_table == []
    assert chain_hash(None, tuple(y)) not in bm.hash_to_block


def test_same_block_after_another_prefix_is_a_separate_cache_entry() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [11, 12, 13, 14]
    first = make_seq(x + y + [9])
    second = make_seq(z + y + [9])
    compute(bm, first)
    compute(bm, second)
    # Block Y after Z is no duplicate of block Y after X: both are cached.
    assert first.block_table == [0, 1, 2]
    assert second.block_table == [3, 4, 5]
    assert bm.blocks[1].block_hash == hashes_of(x + y, 2)[1]
    assert bm.blocks[4].block_hash == hashes_of(z + y, 2)[1]
    assert bm.blocks[1].block_hash != bm.blocks[4].block_hash
    third = make_seq(z + y + [10])
    bm.match_prefix(third)
    assert third.block_table == [3, 4]


def test_a_hash_hit_with_other_tokens_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every block hashes alike, so only the token check tells blocks apart.
    monkeypatch.setattr(
        block_manager_module, "chain_hash", lambda parent, token_ids, extra_key=b"": 42
    )
    bm = BlockManager(8, BLOCK_SIZE)
    first = make_seq([1, 2, 3, 4, 5])
    compute(bm, first)
    assert bm.hash_to_block == {42: 0}
    impostor = make_seq([9, 9, 9, 9, 5])
    bm.match_prefix(impostor)
    assert impostor.block_table == []
    assert impostor.num_computed_tokens == 0
    assert ref_counts(bm)[0] == 1
    genuine = make_seq([1, 2, 3, 4, 6])
    bm.match_prefix(genuine)
    assert genuine.block_table == [0]
    assert ref_counts(bm)[0] == 2


# ---- chain keys: collision resistance ---------------------------------------------------------

_M64, _M61 = 1 << 64, (1 << 61) - 1  # CPython's hash arithmetic and its int-hash modulus
_XXP1, _XXP2, _XXP5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def _tuple_hash_inverse(target: int, lanes: tuple[int, ...], length: int) -> int:
    """The hash the last item of a `length`-tuple must have, after items hashing to `lanes`,
    for the tuple to hash to `target` (CPython's xxHash-based tuple hash, run backwards)."""
    acc = _XXP5
    for lane in lanes:
        acc = (acc + (lane % _M64) * _XXP2) % _M64
        acc = (((acc << 31) | (acc >> 33)) % _M64) * _XXP1 % _M64
    want = (target - (length ^ (_XXP5 ^ 3527539))) % _M64 * pow(_XXP1, -1, _M64) % _M64
    want = ((want >> 31) | (want << 33)) % _M64
    lane = (want - acc) * pow(_XXP2, -1, _M64) % _M64
    return lane - _M64 if lane >= 1 << 63 else lane


def _colliding_first_blocks() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two first blocks X1 != X2 whose old keys, hash((None, X)), differ but are equal modulo
    2**61 - 1, so the old key of any block after them, hash((key, Y)), is the same."""
    first = (1, 2, 3, 4)
    key = hash((None, first))
    # Same sign and the same residue modulo 2**61 - 1 (so the same int hash), and still a
    # 64-bit signed value (a tuple hash can be nothing else).
    if key >= 0:
        twin_key = key + _M61 if key + _M61 < 1 << 63 else key - _M61
    else:
        twin_key = key - _M61 if key - _M61 >= -(1 << 63) else key + _M61
    block_hash = _tuple_hash_inverse(twin_key, (hash(None),), 2)
    for middle in range(1000):
        last = _tuple_hash_inverse(block_hash, (5, 6, middle), BLOCK_SIZE)
        if abs(last) < _M61 and last != -1:  # small ints hash to themselves
            return first, (5, 6, middle, last)
    pytest.skip("no colliding block found")


def test_a_crafted_collision_of_the_old_keys_hits_no_other_chain() -> None:
    x1, x2 = _colliding_first_blocks()
    y = (7, 8, 9, 10)
    if hash((hash((None, x1)), y)) != hash((hash((None, x2)), y)):
        pytest.skip("this Python hashes tuples differently; the crafted collision does not hold")
    bm = BlockManager(16, BLOCK_SIZE)
    victim = make_seq([*x1, *y, 11])
    compute(bm, victim)  # blocks 0 (X1), 1 (Y after X1), 2
    attacker = make_seq([*x2, 12])
    compute(bm, attacker)  # block 3 (X2), 4: now X2 is cached
    probe = make_seq([*x2, *y, 11])
    bm.match_prefix(probe)
    # Y after X2 is not Y after X1: the probe gets its own X2 block and not the victim's block 1.
    assert probe.block_table == [3]
    assert probe.num_computed_tokens == BLOCK_SIZE
    assert ref_counts(bm)[:5] == [1, 1, 1, 2, 1]


def test_the_key_names_the_whole_chain() -> None:
    tokens = list(range(12))
    other_head = [99, *tokens[1:]]  # only the first token differs
    keys, other_keys = hashes_of(tokens, 3), hashes_of(other_head, 3)
    assert all(a != b for a, b in zip(keys, other_keys))
    # sha256 over the parent's key and the block's token ids as int64s, from a zero root.
    parent = bytes(32)
    for index, key in enumerate(keys):
        block = array("q", tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]).tobytes()
        assert key == hashlib.sha256(parent + block).digest()
        parent = key


def test_chains_ending_in_the_same_block_never_share_it() -> None:
    bm = BlockManager(16, BLOCK_SIZE)
    tail = [5, 6, 7, 8, 9]
    chains = [make_seq([*head, *tail]) for head in ([1, 2, 3, 4], [1, 2, 3, 40], [0, 2, 3, 4])]
    for seq in chains:
        compute(bm, seq)
    assert [seq.block_table for seq in chains] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert len({seq.block_hashes[1] for seq in chains}) == 3
    assert len(bm.hash_to_block) == 6
    probe = make_seq([1, 2, 3, 40, *tail])
    bm.match_prefix(probe)
    assert probe.block_table == [3, 4]


def test_prefix_cache_counters_accumulate_tokens() -> None:
    bm = BlockManager(16, BLOCK_SIZE)
    prompt = list(range(10))
    cold = make_seq(prompt)
    bm.match_prefix(cold)
    compute(bm, cold)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)
    warm = make_seq(prompt)
    bm.match_prefix(warm)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)
    partial = make_seq(prompt[:5] + [99, 98, 97, 96, 95, 94, 93])
    bm.match_prefix(partial)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (32, 12)


# ---- cached blocks: LRU eviction and revival ----------------------------------------------------


def three_cached_blocks(bm: BlockManager, free_order: str) -> dict[str, Sequence]:
    """Compute one-block sequences A, B, C into blocks 0, 1, 2, then free them in `free_order`."""
    seqs = {
        "A": make_seq([1, 2, 3, 4]),
        "B": make_seq([5, 6, 7, 8]),
        "C": make_seq([9, 10, 11, 12]),
    }
    for seq in seqs.values():
        compute(bm, seq)
    assert [seqs[name].block_table for name in "ABC"] == [[0], [1], [2]]
    for name in free_order:
        bm.free(seqs[name])
    return seqs


def test_freed_hashed_blocks_stay_cached_in_lru_order() -> None:
    bm = BlockManager(4, BLOCK_SIZE)
    three_cached_blocks(bm, "ACB")
    assert list(bm.cached_free) == [0, 2, 1]
    assert bm.free_block_ids == [3]
    assert bm.num_free_blocks == 4
    assert bm.usage == 0.0
    assert len(bm.hash_to_block) == 3


def test_eviction_takes_the_free_list_first_then_the_oldest_cached_block() -> None:
    bm = BlockManager(4, BLOCK_SIZE)
    three_cached_blocks(bm, "ACB")
    d = make_seq(list(range(20, 32)))
    bm.allocate(d, 12)
    assert d.block_table == [3, 0, 2]  # free block 3, then A's block, then C's
    assert list(bm.cached_free) == [1]
    assert bm.blocks[0].block_hash is None
    assert bm.blocks[0].token_ids == ()
    assert bm.hash_to_block == {hashes_of([5, 6, 7, 8], 1)[0]: 1}
    assert ref_counts(bm) == [1, 0, 1, 1]

    evicted = make_seq([1, 2, 3, 4, 99])
    bm.match_prefix(evicted)
    assert evicted.block_table == []
    kept = make_seq([5, 6, 7, 8, 99])
    bm.match_prefix(kept)
    assert kept.block_table == [1]


def test_a_hit_revives_a_cached_block_and_protects_it_from_eviction() -> None:
    bm = BlockManager(4, BLOCK_SIZE)
    three_cached_blocks(bm, "ABC")
    assert list(bm.cached_free) == [0, 1, 2]
    revived = make_seq([1, 2, 3, 4, 99])
    bm.match_prefix(revived)
    assert revived.block_table == [0]
    assert ref_counts(bm)[0] == 1
    assert list(bm.cached_free) == [1, 2]
    assert bm.num_free_blocks == 3

    bm.allocate(revived, 1)
    assert revived.block_table == [0, 3]
    other = make_seq(list(range(20, 28)))
    bm.allocate(other, 8)
    assert other.block_table == [1, 2]  # block 0 is in use again, so B and C go
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(make_seq([0]), 1)

    bm.free(revived)
    assert list(bm.cached_free) == [0]  # back as the most recently used
    assert bm.free_block_ids == [3]


def test_a_sequence_frees_its_tail_blocks_before_its_head_blocks() -> None:
    bm = BlockManager(3, BLOCK_SIZE)
    tokens = list(range(12))
    seq = make_seq(tokens)
    compute(bm, seq)
    bm.free(seq)
    assert list(bm.cached_free) == [2, 1, 0]
    newcomer = make_seq([50])
    bm.allocate(newcomer, 1)
    assert newcomer.block_table == [2]
    again = make_seq(tokens[:8] + [77])
    bm.match_prefix(again)
    assert again.block_table == [0, 1]


def test_reused_cached_blocks_are_moved_to_the_lru_end_when_freed_again() -> None:
    bm = BlockManager(4, BLOCK_SIZE)
    three_cached_blocks(bm, "ABC")
    user = make_seq([1, 2, 3, 4, 99])
    bm.match_prefix(user)
    bm.free(user)
    assert list(bm.cached_free) == [1, 2, 0]


def test_hit_on_a_block_in_use_is_cached_only_when_the_last_user_leaves() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    prompt = list(range(9))
    owner = make_seq(prompt)
    compute(bm, owner)
    sharer = make_seq(prompt)
    bm.match_prefix(sharer)
    assert ref_counts(bm)[:3] == [2, 2, 1]
    bm.free(owner)
    assert ref_counts(bm)[:3] == [1, 1, 0]
    assert list(bm.cached_free) == []
    assert bm.free_block_ids[-1] == 2  # the partial block was never hashed
    bm.free(sharer)
    assert list(bm.cached_free) == [1, 0]


# ---- duplicates, reset, disabled ----------------------------------------------------------------


def test_a_duplicate_computed_block_stays_private() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    prompt = [1, 2, 3, 4, 5]
    a, b = make_seq(prompt), make_seq(prompt)
    # Admitted in the same step, before either had computed anything: no hit for b.
    bm.allocate(a, 5)
    bm.allocate(b, 5)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    for seq in (a, b):
        seq.num_computed_tokens = 5
        bm.cache_full_blocks(seq)
    (h0,) = hashes_of(prompt, 1)
    assert a.block_hashes == [h0]
    assert b.block_hashes == [h0]  # the chain goes on even through a private block
    assert bm.hash_to_block == {h0: 0}
    assert bm.blocks[2].block_hash is None

    bm.free(b)
    assert list(bm.cached_free) == []
    assert bm.free_block_ids[-2:] == [3, 2]
    bm.free(a)
    assert list(bm.cached_free) == [0]
    assert bm.num_free_blocks == 8


def test_reset_prefix_cache_forgets_only_unreferenced_blocks() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    gone = make_seq([1, 2, 3, 4, 5])
    live = make_seq([6, 7, 8, 9, 10])
    compute(bm, gone)
    compute(bm, live)
    bm.free(gone)
    assert list(bm.cached_free) == [0]
    free_before = bm.num_free_blocks

    bm.reset_prefix_cache()
    assert list(bm.cached_free) == []
    assert bm.blocks[0].block_hash is None
    assert bm.hash_to_block == {live.block_hashes[0]: 2}
    assert bm.num_free_blocks == free_before == 6
    assert bm.free_block_ids[-1] == 0

    probe_gone = make_seq([1, 2, 3, 4, 5])
    bm.match_prefix(probe_gone)
    assert probe_gone.block_table == []
    probe_live = make_seq([6, 7, 8, 9, 10])
    bm.match_prefix(probe_live)
    assert probe_live.block_table == [2]


def test_disabled_prefix_caching_never_caches_or_hits() -> None:
    bm = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    prompt = list(range(10))
    first = make_seq(prompt)
    bm.match_prefix(first)
    compute(bm, first)
    assert first.block_hashes == []
    assert bm.hash_to_block == {}
    assert all(block.block_hash is None for block in bm.blocks)
    second = make_seq(prompt)
    bm.match_prefix(second)
    assert second.block_table == []
    assert second.num_computed_tokens == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    bm.free(first)
    assert list(bm.cached_free) == []
    assert bm.num_free_blocks == 8


def test_usage_counts_cached_blocks_as_free() -> None:
    bm = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(list(range(10)))
    compute(bm, seq)
    assert bm.usage == pytest.approx(3 / 8)
    bm.free(seq)
    assert bm.usage == 0.0
    assert len(bm.cached_free) == 2
