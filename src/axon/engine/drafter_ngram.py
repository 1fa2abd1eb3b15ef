"""N-gram drafting (prompt lookup, as vLLM's `ngram` and llama.cpp's lookup decoding).

The longest suffix of a sequence, between `min_n` and `max_n` tokens long, that occurred earlier
in its prompt or output proposes the tokens that followed its first occurrence. Each sequence
keeps an index, per length n, from every n-gram seen to the position right after its first
occurrence, extended by the tokens appended since the last call: a step costs
O((max_n - min_n + 1) * new tokens) dictionary operations, never a scan of the whole sequence.

How far to trust a match: a long match (n = max_n) in text that repeats its prompt is right
nine times in ten, a two-token match in free text one time in eight past its first token. The
drafter measures, per match length n and draft position i, how often the first i + 1 tokens of
its lookups came true (`MatchRates`): every lookup it makes is checked against the tokens the
sequence then gets, whether or not its drafts were verified, so the measuring costs no verify
rows. The rates are kept for the engine (every sequence's lookups) and for each sequence: a
sequence's own weighs more as its lookups come in (half at `_OWN_HALF`), so a session that
edits code and a chat in one batch each draft as their own text repeats. A draft is cut before
the first position whose rate is below `required` (the acceptance a draft token needs to pay for
its verify row, which the engine sets each step: see engine/speculation.py); with `required` 0
nothing is cut.
"""

from __future__ import annotations

from collections.abc import Iterable

from axon.sequence import Sequence

_RATE_WEIGHT = 0.02  # of the newest lookup in a rate, once 50 came in (a plain mean before)
_OWN_HALF = 8  # a sequence's own rate weighs as much as the engine's after this many lookups


class MatchRates:
    """Per match length n and draft position i: how often the first i + 1 drafted tokens were
    the sequence's next ones (optimistic, 1.0, until a lookup of that length came true or not)."""

    def __init__(self, sizes: range) -> None:
        self._rates: dict[int, list[float]] = {n: [] for n in sizes}
        self._counts: dict[int, list[int]] = {n: [] for n in sizes}

    def rate(self, n: int, position: int, prior: MatchRates | None = None) -> float:
        """The rate; with a `prior` (the engine's, for a sequence's own), the two weighed by
        how many lookups this one counted."""
        rates = self._rates[n]
        own = rates[position] if position < len(rates) else 1.0
        if prior is None:
            return own
        counts = self._counts[n]
        weight = counts[position] / (counts[position] + _OWN_HALF) if position < len(counts) else 0
        return weight * own + (1.0 - weight) * prior.rate(n, position)

    def observe(self, n: int, drafted: int, correct: int) -> None:
        """A lookup of match length n that drafted `drafted` tokens, the first `correct` right."""
        rates, counts = self._rates[n], self._counts[n]
        while len(rates) < drafted:
            rates.append(1.0)
            counts.append(0)
        for position in range(drafted):
            counts[position] += 1
            weight = max(_RATE_WEIGHT, 1.0 / counts[position])
            rates[position] += weight * (float(position < correct) - rates[position])

    def cut(
        self, n: int, draft: list[int], required: float, prior: MatchRates | None = None
    ) -> list[int]:
        """`draft` up to the first position whose rate (with `prior`) is below `required`."""
        for position in range(len(draft)):
            if self.rate(n, position, prior) < required:
                return draft[:position]
        return draft


class _Index:
    """One sequence's n-grams: per n, n-gram -> the position after its first occurrence; its
    lookups not yet checked against the tokens that followed them, and its own rates."""

    __slots__ = ("by_n", "indexed", "pending", "rates")

    def __init__(self, sizes: range) -> None:
        self.by_n: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending at positions < indexed are in
        self.pending: list[tuple[int, list[int], int]] = []  # (n, draft, its first position)
        self.rates = MatchRates(sizes)

    def extend(self, tokens: list[int], end: int) -> None:
        """Index the n-grams that end at positions [indexed, end) (their next token known)."""
        for position in range(self.indexed, end):
            for n, grams in self.by_n.items():
                if position >= n:
                    grams.setdefault(tuple(tokens[position - n : position]), position)
        self.indexed = max(self.indexed, end)

    def lookup(self, tokens: list[int], max_tokens: int) -> tuple[int, list[int]]:
        """(n, what followed the first earlier occurrence of the longest suffix that has one),
        or (0, [])."""
        length = len(tokens)
        for n in sorted(self.by_n, reverse=True):
            if n >= length:
                continue
            position = self.by_n[n].get(tuple(tokens[length - n :]))
            if position is not None:
                return n, tokens[position : min(position + max_tokens, length)]
        return 0, []

    def check(self, tokens: list[int], engine_rates: MatchRates) -> None:
        """Count the pending lookups whose outcome the tokens now tell (a wrong token, or all
        of the draft come true), in the sequence's rates and the engine's; keep the others."""
        still = []
        for n, draft, start in self.pending:
            known = tokens[start : start + len(draft)]
            correct = 0
            while correct < len(known) and known[correct] == draft[correct]:
                correct += 1
            if correct < len(known) or correct == len(draft):
                self.rates.observe(n, len(draft), correct)
                engine_rates.observe(n, len(draft), correct)
            else:
                still.append((n, draft, start))
        self.pending = still


class NgramDrafter:
    """Drafts by prompt lookup; no model, no device memory."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(min_n, max_n + 1)
        self._indexes: dict[int, _Index] = {}
        self.rates = MatchRates(self.sizes)
        self.required = 0.0  # the rate a draft position needs (set by the engine each step)

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        drafts = []
        for seq, limit in zip(seqs, max_tokens):
            index = self._indexes.get(seq.seq_id)
            if index is None:
                index = self._indexes[seq.seq_id] = _Index(self.sizes)
            tokens = seq.token_ids
            index.check(tokens, self.rates)
            # The suffix itself (ending at the last token) must not find itself.
            index.extend(tokens, len(tokens))
            n, draft = index.lookup(tokens, limit) if limit > 0 else (0, [])
            if draft:
                index.pending.append((n, draft, len(tokens)))
                draft = index.rates.cut(n, draft, self.required, prior=self.rates)
            drafts.append(draft)
        return drafts

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._indexes.pop(seq_id, None)
