"""Incremental detokenization and stop strings on the real Qwen3 and Qwen3.5 vocabularies:
multi-byte characters split across byte-level tokens are never emitted broken, the deltas add
up to `tokenizer.decode`, and stop strings that span tokens end the sample, trimmed."""

from __future__ import annotations

import random

import pytest

from axon.engine.output_processor import SampleState
from axon.outputs import TokenUpdate
from axon.sampling_params import SamplingParams
from axon.tokenizer.detokenizer import IncrementalDetokenizer

TEXTS = [
    "你好，世界！今天天气很好。",
    "日本語のテキスト、カタカナとひらがな。한국어 문장도 있어요.",
    "emoji 🦙🚀😶‍🌫️ 👩🏽‍💻 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "Ελληνικά, русский текст, العربية, हिन्दी भाषा, ภาษาไทย",
    "e\u0301 cafe\u0301 naïve 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ½ ∑∫ — “quotes” …",
    "code: def f(x):\n    return x ** 2  # 平方\n\n\t tabs",
]
PROMPT = "The answer is:"


def _stream(tokenizer, prompt_ids, token_ids, skip_special_tokens=True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas = [detokenizer.add(token_id) for token_id in token_ids]
    return [*deltas, detokenizer.flush()]


def _check_stream(tokenizer, token_ids, skip_special_tokens=True) -> None:
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    deltas = _stream(tokenizer, prompt_ids, token_ids, skip_special_tokens)
    full = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        broken = [delta for delta in deltas if "\ufffd" in delta]
        assert not broken, f"a delta holds a broken character: {broken}"


def _split_characters(tokenizer, text: str) -> bool:
    """True when some token of `text` holds only part of a character's UTF-8 bytes."""
    return any(
        "\ufffd" in tokenizer.decode([token_id])
        for token_id in tokenizer.encode(text, add_special_tokens=False)
    )


@pytest.mark.parametrize("text", TEXTS)
def test_crafted_text_streams_whole_characters(qwen_tokenizer, text):
    _check_stream(qwen_tokenizer, qwen_tokenizer.encode(text, add_special_tokens=False))


def test_crafted_texts_do_split_characters(qwen_tokenizer):
    # The crafted texts must exercise the hold-back: some of their tokens are partial characters.
    assert sum(_split_characters(qwen_tokenizer, text) for text in TEXTS) >= 2


def test_random_token_sequences(qwen_tokenizer):
    rng = random.Random(0)
    vocab_size = len(qwen_tokenizer)
    # Byte-level tokens of single bytes >= 0x80 (and CJK pieces) are where characters break.
    high_bytes = [
        token_id for token_id in range(256, 4000) if "\ufffd" in qwen_tokenizer.decode([token_id])
    ]
    assert high_bytes
    for _ in range(40):
        pool = [rng.randrange(vocab_size) for _ in range(8)] + rng.sample(high_bytes, 8)
        _check_stream(qwen_tokenizer, [rng.choice(pool) for _ in range(rng.randint(1, 24))])


def test_random_characters_split_and_rejoined(qwen_tokenizer):
    rng = random.Random(1)
    alphabet = "".join(TEXTS)
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        _check_stream(qwen_tokenizer, qwen_tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(qwen_tokenizer, skip):
    text = "<|im_start|>assistant\n<think>\n想一想 🤔\n</think>\n\n答案<|im_end|><|endoftext|>"
    token_ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    assert qwen_tokenizer.convert_tokens_to_ids("<|im_end|>") in token_ids
    _check_stream(qwen_tokenizer, token_ids, skip_special_tokens=skip)
    streamed = "".join(_stream(qwen_tokenizer, [], token_ids, skip))
    assert ("<|im_end|>" in streamed) is not skip
    assert "<think>" in streamed  # added but not special: the reasoning parser needs it


# ---- stop strings through SampleState -----------------------------------------------------


def _sample(tokenizer, text: str, **params) -> tuple[SampleState, list[str], bool]:
    """Feeds `text`'s tokens to a SampleState one TokenUpdate at a time (a length finish after
    the last) and collects what streaming would send; returns the state, the deltas and
    whether a stop string ended the sample."""
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    state = SampleState(0, SamplingParams(max_tokens=1000, **params), prompt_ids, tokenizer)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, stopped = [], False
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1
        update = TokenUpdate("r", 0, token_id, finish_reason="length" if last else None)
        stopped = state.add(update)
        deltas.append(state.new_text())
        if state.finished:
            break
    return state, deltas, stopped


def _spans_tokens(tokenizer, text: str, stop: str) -> bool:
    """True when no single token of `text` holds all of `stop`."""
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(text, add_special_tokens=False)]
    return not any(stop in piece for piece in pieces)


STOP_CASES = [
    ("Sure. The result is 42. END OF ANSWER and more text", "END OF ANSWER"),
    ("第一步：计算。第二步：完成！之后的内容", "步：完"),
    ("rockets 🚀🚀 launch 🌕 then more", "🚀 launch"),
    ("a\n\nUser: next turn begins", "\n\nUser:"),
]


@pytest.mark.parametrize(("text", "stop"), STOP_CASES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(qwen_tokenizer, text, stop, include):
    assert _spans_tokens(qwen_tokenizer, text, stop)
    state, deltas, stopped = _sample(
        qwen_tokenizer, text, stop=[stop], include_stop_str_in_output=include
    )
    expected = text[: text.index(stop) + (len(stop) if include else 0)]
    assert stopped and state.finish_reason == "stop" and state.stop_reason == stop
    assert state.text == expected
    assert "".join(deltas) == expected
    assert "\ufffd" not in "".join(deltas)


@pytest.mark.parametrize(("text", "stop"), STOP_CASES)
def test_hold_back_never_streams_part_of_a_stop_string(qwen_tokenizer, text, stop):
    _, deltas, _ = _sample(qwen_tokenizer, text, stop=[stop])
    streamed = ""
    for delta in deltas:
        streamed += delta
        # Whatever was sent is a prefix of the answer without the stop string: no partial stop.
        assert text[: text.index(stop)].startswith(streamed)


def test_no_stop_string_streams_everything(qwen_tokenizer):
    text = "一段没有停止词的文字 🦙 with emoji"
    state, deltas, stopped = _sample(qwen_tokenizer, text, stop=["NEVER"])
    assert not stopped and state.finish_reason == "length"
    assert "".join(deltas) == state.text == text


def test_stop_string_after_a_near_miss(qwen_tokenizer):
    # "ENDING" starts like the stop "END!" but is not it: held back, then released.
    text = "ENDING soon, END! done"
    state, deltas, _ = _sample(qwen_tokenizer, text, stop=["END!"])
    assert state.text == "".join(deltas) == "ENDING soon, "


# ---- marker tokens flagged special ----------------------------------------------------------

MARKED = "<|im_start|>x<think>\n想 🤔\n</think>\n\n<tool_call>{}</tool_call>答<|im_end|>"


@pytest.mark.parametrize("markers_special", [False, True])
def test_marker_tokens_survive_skip_special_tokens(markers_special):
    from tests.parsers.conftest import byte_tokenizer

    tokenizer = byte_tokenizer(markers_special)
    token_ids = tokenizer.encode(MARKED, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("</think>") in token_ids  # one token each
    prompt_ids = tokenizer.encode("<|im_start|>assistant\n<think>", add_special_tokens=False)
    streamed = "".join(_stream(tokenizer, prompt_ids, token_ids))
    # Whether or not the tokenizer flags them special, the parsers' markers stay; the other
    # special tokens go.
    assert streamed == "x<think>\n想 🤔\n</think>\n\n<tool_call>{}</tool_call>答"
    assert "".join(_stream(tokenizer, prompt_ids, token_ids, skip_special_tokens=False)) == MARKED


def test_a_tokenizer_without_special_markers_skips_as_it_always_did(qwen_tokenizer):
    from axon.tokenizer.detokenizer import skipped_special_ids

    assert skipped_special_ids(qwen_tokenizer) is None  # its decode(skip_special_tokens) is used
