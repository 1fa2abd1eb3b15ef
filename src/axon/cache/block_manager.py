"""Paged KV block bookkeeping: free list, ref counts, hash-chained prefix caching. No torch."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from axon.sequence import Sequence

# A block's key is the sha256 of its parent's key and its own token ids, so it names the whole
# chain of tokens up to its end: two prefixes share a block only if all their tokens are equal,
# short of a sha256 collision. (Python's hash() is 64 bits and easy to collide on purpose, which
# would let one client's prompt hit another's KV blocks: the hit checks only the last block's
# tokens.) As vLLM's `--prefix-caching-hash-algo sha256`.
_ROOT_HASH = bytes(32)  # the parent of a sequence's first block


def chain_hash(
    parent_hash: bytes | None, token_ids: tuple[int, ...], extra_key: bytes = b""
) -> bytes:
    """The 32-byte key of one full block: sha256 over the key of the block before it (none for
    the first), this block's token ids as int64s and `extra_key` (the hashes of the images the
    block covers: equal placeholder tokens, different pixels)."""
    digest = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT_HASH)
    digest.update(array("q", token_ids).tobytes())
    if extra_key:
        digest.update(extra_key)
    return digest.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full, computed and cached
    token_ids: tuple[int, ...] = field(default=())


class BlockManager:
    """Owns the physical KV blocks.

    A block is in exactly one of three states: in use (ref_count > 0), cached (ref_count == 0,
    holds a hashed full block and may be revived by a prefix hit; evicted LRU when the free list
    is empty), or free. `free_block_ids` holds only never-hashed or evicted blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() -> lowest id
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        # Hybrid models resume only where a recurrent-state snapshot exists: given the chain
        # hash of a prefix's last block, may a sequence start computing right after it?
        self.can_resume_at: Callable[[bytes], bool] | None = None

    # ---- capacity ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.cached_free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` needs beyond its block table to hold `num_new_tokens` more tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = (total + self.block_size - 1) // self.block_size
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    # ---- allocation -------------------------------------------------------------------------

    def _take_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.pop()
        else:
            block_id, _ = self.cached_free.popitem(last=False)  # evict the least recently used
            self._uncache(self.blocks[block_id])
        block = self.blocks[block_id]
        block.ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        if (
            block.block_hash is not None
            and self.hash_to_block.get(block.block_hash) == block.block_id
        ):
            del self.hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = ()

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend `seq.block_table` to hold `num_new_tokens` more tokens. Caller checked room."""
        for _ in range(self.num_new_blocks(seq, num_new_tokens)):
            seq.block_table.append(self._take_block())

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.cached_free.pop(block_id, None)
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is not None:
            self.cached_free[block_id] = None  # most recently used goes last
        else:
            self.free_block_ids.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its hashed blocks stay cached until evicted."""
        # Release in reverse so a sequence's tail blocks are evicted before its head blocks.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those holding `seq`'s computed tokens (speculative
        decoding: blocks allocated for drafts that were rejected)."""
        needed = (seq.num_computed_tokens + self.block_size - 1) // self.block_size
        while len(seq.block_table) > needed:
            self._release(seq.block_table.pop())

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """Let `child` share the parent's first `num_tokens // block_size` full blocks."""
        num_shared = num_tokens // self.block_size
        child.block_table = list(parent.block_table[:num_shared])
        child.block_hashes = list(parent.block_hashes[:num_shared])
        for block_id in child.block_table:
            self._acquire(block_id)
        child.num_computed_tokens = num_shared * self.block_size

    # ---- prefix caching ---------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> None:
        """On admission, point `seq` at cached blocks holding its longest cached full-block prefix.

        At least the last prompt token is always left to compute, so the step that finishes the
        prompt produces logits.
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent_hash = None
        hits: list[int] = []
        hashes: list[bytes] = []
        for index in range(max_blocks):
            token_ids = tuple(seq.block_token_ids(index, self.block_size))
            extra_key = seq.block_extra_key(index, self.block_size)
            parent_hash = chain_hash(parent_hash, token_ids, extra_key)
            block_id = self.hash_to_block.get(parent_hash)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break  # a miss, or a hash collision caught by checking the tokens
            hits.append(block_id)
            hashes.append(parent_hash)
        if self.can_resume_at is not None:
            while hashes and not self.can_resume_at(hashes[-1]):
                hits.pop()
                hashes.pop()
        for block_id in hits:
            self._acquire(block_id)
        seq.block_table = hits
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_computed_tokens

    def undo_match(self, seq: Sequence) -> None:
        """Take back the counters of a lookup whose sequence could not be admitted after all;
        the statistics then count each admitted prompt once."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries -= seq.num_tokens
            self.prefix_cache_hits -= seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every full, computed block of `seq` in the prefix cache (after a step)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = seq.block_hashes
        for index in range(len(hashes), num_full):
            token_ids = tuple(seq.block_token_ids(index, self.block_size))
            extra_key = seq.block_extra_key(index, self.block_size)
            block_hash = chain_hash(hashes[-1] if hashes else None, token_ids, extra_key)
            hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is not None or block_hash in self.hash_to_block:
                continue  # already cached, or an identical block is: keep this one private
            block.block_hash = block_hash
            block.token_ids = token_ids
            self.hash_to_block[block_hash] = block.block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that nobody references."""
        for block_id in list(self.cached_free):
            self._uncache(self.blocks[block_id])
            self.free_block_ids.append(block_id)
        self.cached_free.clear()

    # ---- the host and disk tiers (engine/prefix_tiers.py) ------------------------------------

    def adopt(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int:
        """A block to fill with a prefix block read from host memory or disk, registered as
        cached and unreferenced (the most recently used), as if a finished sequence had computed
        it: `match_prefix` then finds it. Caller checked room; the caller fills it before any
        step."""
        block_id = self._take_block()
        block = self.blocks[block_id]
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.hash_to_block[block_hash] = block_id
        self._release(block_id)
        return block_id
