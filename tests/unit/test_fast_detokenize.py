"""Streaming detokenization calls the Rust tokenizer directly where that is exactly what
`tokenizer.decode` does (issue 16 point 6: the Python wrapper cost more than the decode, twice per
streamed token), and streams the very same text as through the wrapper."""

from __future__ import annotations

import random

import pytest

from axon.tokenizer.detokenizer import IncrementalDetokenizer, backend_decode


def _deltas(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detokenizer.add(token_id) for token_id in token_ids] + [detokenizer.flush()]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_fast_path_streams_what_the_wrapper_streams(qwen3_tokenizer, skip_special_tokens):
    tokenizer = qwen3_tokenizer
    rng = random.Random(0)
    special = sorted(tokenizer.added_tokens_decoder)  # special ones and the markers
    prompt = tokenizer.encode("The answer is:", add_special_tokens=False)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(30)] + rng.sample(special, 3)
        rng.shuffle(ids)
        fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        assert fast.decode == tokenizer.backend_tokenizer.decode  # the fast path is taken
        wrapped = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        wrapped.decode = tokenizer.decode
        assert _deltas(fast, ids) == _deltas(wrapped, ids)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(qwen3_tokenizer):
    tokenizer = qwen3_tokenizer
    assert backend_decode(tokenizer) is not None
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert backend_decode(tokenizer) is None
        assert IncrementalDetokenizer(tokenizer, []).decode == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = False


def test_anything_but_a_fast_tokenizer_keeps_its_own_decode():
    class Plain:
        clean_up_tokenization_spaces = False

        def decode(self, token_ids, skip_special_tokens=False):
            return " ".join(map(str, token_ids))

    assert backend_decode(Plain()) is None
    detokenizer = IncrementalDetokenizer(Plain(), [1, 2])
    assert detokenizer.add(3) == " 3"
