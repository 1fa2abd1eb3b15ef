"""N-gram drafting (prompt lookup, as vLLM's `ngram` and llama.cpp's lookup decoding).

The longest suffix of a sequence, between `min_n` and `max_n` tokens long, that occurred earlier
in its prompt or output proposes the tokens that followed its first occurrence. Each sequence
keeps an index, per length n, from every n-gram seen to the position right after its first
occurrence, extended by the tokens appended since the last call: a step costs
O((max_n - min_n + 1) * new tokens) dictionary operations, never a scan of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Iterable

from axon.sequence import Sequence


class _Index:
    """One sequence's n-grams: per n, n-gram -> the position after its first occurrence."""

    __slots__ = ("by_n", "indexed")

    def __init__(self, sizes: range) -> None:
        self.by_n: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending at positions < indexed are in

    def extend(self, tokens: list[int], end: int) -> None:
        """Index the n-grams that end at positions [indexed, end) (their next token known)."""
        for position in range(self.indexed, end):
            for n, grams in self.by_n.items():
                if position >= n:
                    grams.setdefault(tuple(tokens[position - n : position]), position)
        self.indexed = max(self.indexed, end)

    def lookup(self, tokens: list[int], max_tokens: int) -> list[int]:
        """What followed the first earlier occurrence of the longest suffix that has one."""
        length = len(tokens)
        for n in sorted(self.by_n, reverse=True):
            if n >= length:
                continue
            position = self.by_n[n].get(tuple(tokens[length - n :]))
            if position is not None:
                return tokens[position : min(position + max_tokens, length)]
        return []


class NgramDrafter:
    """Drafts by prompt lookup; no model, no device memory."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(min_n, max_n + 1)
        self._indexes: dict[int, _Index] = {}

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        drafts = []
        for seq, limit in zip(seqs, max_tokens):
            index = self._indexes.get(seq.seq_id)
            if index is None:
                index = self._indexes[seq.seq_id] = _Index(self.sizes)
            tokens = seq.token_ids
            # The suffix itself (ending at the last token) must not find itself.
            index.extend(tokens, len(tokens))
            drafts.append(index.lookup(tokens, limit) if limit > 0 else [])
        return drafts

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._indexes.pop(seq_id, None)
