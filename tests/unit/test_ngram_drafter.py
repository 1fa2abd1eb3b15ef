"""The n-gram drafter (prompt lookup): the longest suffix seen before proposes what followed it,
kept up to date incrementally as tokens are appended."""

from __future__ import annotations

from axon.engine.drafter_ngram import NgramDrafter
from axon.sampling_params import SamplingParams
from axon.sequence import Sequence


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams())


def test_the_longest_suffix_proposes_what_followed_it():
    drafter = NgramDrafter(1, 3)
    # Suffix [7, 8, 9] occurred at the start, followed by 1, 2; [9] alone by 5 (later).
    seq = _seq([7, 8, 9, 1, 2, 9, 5, 6, 7, 8, 9])
    assert drafter.propose([seq], [2]) == [[1, 2]]
    assert drafter.propose([seq], [0]) == [[]]


def test_the_first_occurrence_and_what_is_known_of_it():
    drafter = NgramDrafter(1, 1)
    seq = _seq([4, 1, 4, 2, 4])  # [4] first at 0, followed by 1, 4, 2, 4
    assert drafter.propose([seq], [8]) == [[1, 4, 2, 4]]


def test_no_match_proposes_nothing():
    drafter = NgramDrafter(2, 3)
    assert drafter.propose([_seq([1, 2, 3, 4])], [4]) == [[]]


def test_the_index_follows_appended_tokens_and_forgets_released_sequences():
    drafter = NgramDrafter(2, 2)
    seq = _seq([1, 2, 3, 4])
    assert drafter.propose([seq], [3]) == [[]]
    for token in (5, 1, 2):
        seq.append_token(token)
    assert drafter.propose([seq], [3]) == [[3, 4, 5]]  # [1, 2] first at 0
    assert seq.seq_id in drafter._indexes
    drafter.release([seq.seq_id])
    assert seq.seq_id not in drafter._indexes
    assert drafter.propose([seq], [2]) == [[3, 4]]  # rebuilt from the tokens
