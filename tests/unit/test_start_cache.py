"""The start-up cache (axon/cache_dir.py) and the GGUF tokenizer kept in it: an entry is reused
while its source is unchanged, a changed source misses, and a corrupt entry is rebuilt, never
trusted. Also the lazily zeroed host tensors the KV cache is allocated with."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import pickle
import shutil

import gguf
import numpy as np
import pytest
import torch

from axon import cache_dir as start_cache
from axon.kernels import build
from axon.runner.host_memory import zeros
from axon.tokenizer import gguf_tokenizer


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AXON_CACHE_DIR", str(tmp_path / "cache"))


def _write_gguf(path, words: list[str]) -> None:
    """A GGUF holding a SentencePiece ("llama") vocabulary: 3 specials then `words`."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_head_count(2)
    tokens = ["<unk>", "<s>", "</s>", *words]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(len(words))])
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_token_types([control] * 3 + [normal] * len(words))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


WORDS = ["\u2581hello", "\u2581world", "\u2581a", "\u2581b", "h", "e", "l", "o", "w", "r", "d"]


def _entries() -> list:
    root = start_cache.cache_dir() / "tokenizers"
    return sorted(p for p in root.iterdir() if not p.name.startswith("."))


def _from_gguf_forbidden(monkeypatch) -> None:
    def fail(path):
        raise AssertionError("the tokenizer was rebuilt from the GGUF on a cache hit")

    monkeypatch.setattr(gguf_tokenizer, "tokenizer_from_gguf", fail)


def test_gguf_tokenizer_is_cached_and_reused(tmp_path, monkeypatch):
    model = tmp_path / "model.gguf"
    _write_gguf(model, WORDS)
    built = gguf_tokenizer.load_gguf_tokenizer(model)
    assert len(_entries()) == 1 and start_cache.verified(_entries()[0])
    _from_gguf_forbidden(monkeypatch)
    cached = gguf_tokenizer.load_gguf_tokenizer(model)
    text = "hello world hello"
    assert cached(text).input_ids == built(text).input_ids
    assert cached(text).input_ids[:3] == [1, 7, 8]  # <s> h e: the specials, then WORDS
    assert (cached.bos_token_id, cached.eos_token_id) == (built.bos_token_id, 2)
    assert cached.get_vocab() == built.get_vocab()


def test_changed_gguf_invalidates_its_tokenizer(tmp_path):
    model = tmp_path / "model.gguf"
    _write_gguf(model, WORDS)
    before = gguf_tokenizer.load_gguf_tokenizer(model)
    swapped = [*WORDS[:4], "e", "h", *WORDS[6:]]  # same size, same names: only the order moved
    _write_gguf(model, swapped)
    after = gguf_tokenizer.load_gguf_tokenizer(model)
    assert before("he").input_ids[1:] == [7, 8]
    assert after("he").input_ids[1:] == [8, 7]
    assert after("he").input_ids == gguf_tokenizer.tokenizer_from_gguf(model)("he").input_ids
    assert len(_entries()) == 2


def test_tokenizer_json_beside_the_gguf_is_autotokenizers_with_its_class_cached(
    tmp_path, monkeypatch
):
    """A tokenizer.json next to the file wins over the GGUF vocabulary; the class AutoTokenizer
    picks for that directory is recorded, so a repeat load calls AutoTokenizer no more."""
    from transformers import AutoTokenizer

    from tests.server.conftest import write_tokenizer

    model = tmp_path / "model" / "model.gguf"
    model.parent.mkdir()
    _write_gguf(model, WORDS)
    write_tokenizer(model.parent)
    _from_gguf_forbidden(monkeypatch)
    reference = AutoTokenizer.from_pretrained(str(model.parent))
    first = gguf_tokenizer.load_gguf_tokenizer(model)

    def fail(*args, **kwargs):
        raise AssertionError("AutoTokenizer ran on a repeat load")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", staticmethod(fail))
    repeat = gguf_tokenizer.load_gguf_tokenizer(model)
    for tokenizer in (first, repeat):
        assert type(tokenizer) is type(reference)
        assert tokenizer("hello world w17").input_ids == reference("hello world w17").input_ids
        assert tokenizer.chat_template == reference.chat_template


def test_file_key_follows_content_and_mtime(tmp_path):
    source = tmp_path / "f.bin"
    source.write_bytes(b"a" * 100)
    stat = source.stat()
    key = start_cache.file_key(source, "v1")
    assert start_cache.file_key(source, "v1") == key
    assert start_cache.file_key(source, "v2") != key  # e.g. another transformers version
    source.write_bytes(b"b" + b"a" * 99)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime
    assert start_cache.file_key(source, "v1") != key
    changed = start_cache.file_key(source, "v1")
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert start_cache.file_key(source, "v1") != changed


def _counting_build(calls: list):
    def build(directory):
        calls.append(directory)
        (directory / "data.json").write_text(json.dumps({"value": 42}))

    return build


def test_corrupt_or_partial_entry_is_rebuilt():
    calls: list = []
    build = _counting_build(calls)
    entry, hit = start_cache.cached_entry("things", "k", build)
    assert (hit, len(calls)) == (False, 1)
    assert start_cache.cached_entry("things", "k", build) == (entry, True) and len(calls) == 1
    (entry / "data.json").write_text('{"value": 4')  # truncated
    assert start_cache.cached_entry("things", "k", build) == (entry, False) and len(calls) == 2
    assert json.loads((entry / "data.json").read_text()) == {"value": 42}
    (entry / start_cache.MANIFEST).unlink()  # a build that died before its manifest
    assert start_cache.cached_entry("things", "k", build) == (entry, False) and len(calls) == 3
    (entry / "data.json").unlink()
    assert start_cache.cached_entry("things", "k", build) == (entry, False) and len(calls) == 4


def test_failed_build_leaves_no_entry():
    def build(directory):
        (directory / "half.json").write_text("{")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        start_cache.cached_entry("things", "k", build)
    assert list((start_cache.cache_dir() / "things").iterdir()) == []


def test_tokenizer_entry_that_does_not_load_is_rebuilt(tmp_path):
    model = tmp_path / "model.gguf"
    _write_gguf(model, WORDS)
    gguf_tokenizer.load_gguf_tokenizer(model)
    (entry,) = _entries()
    # Garbage that matches its manifest: only loading it can tell.
    pickled = entry / gguf_tokenizer.PICKLE
    pickled.write_bytes(b"not a pickle")
    manifest = json.loads((entry / start_cache.MANIFEST).read_text())
    manifest["files"][pickled.name] = start_cache._sha256(pickled)
    (entry / start_cache.MANIFEST).write_text(json.dumps(manifest))
    tokenizer = gguf_tokenizer.load_gguf_tokenizer(model)
    assert tokenizer("he").input_ids == [1, 7, 8]
    assert gguf_tokenizer.read_tokenizer(pickled)("he").input_ids == [1, 7, 8]


def _bpe_tokenizer():
    """A byte-fallback BPE tokenizer like gemma-3's, with added tokens special and not, in the
    vocabulary and beyond it, in mixed order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "\n": 2, "h": 3, "e": 4, "l": 5, "o": 6, "he": 7, "ll": 8}
    merges = [("h", "e"), ("l", "l")]
    rust = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    rust.normalizer = normalizers.Replace(" ", "\u2581")
    rust.decoder = decoders.ByteFallback()
    rust.add_special_tokens([AddedToken("<s>", normalized=False)])
    rust.add_tokens([AddedToken("\n", normalized=False)])
    rust.add_special_tokens([AddedToken("<turn>", lstrip=True), AddedToken("<eot>")])
    return rust


def test_bpe_tokenizer_is_pickled_in_parts_and_rebuilt_exactly():
    rust = _bpe_tokenizer()
    parts = gguf_tokenizer.rust_parts(rust)
    assert parts[0] == "bpe" and parts[2]["ll"] == 8 and parts[3] == [("h", "e"), ("l", "l")]
    assert [token["content"] for token in parts[4]] == ["<s>", "\n", "<turn>", "<eot>"]
    rebuilt = gguf_tokenizer.rust_from_parts(parts)
    assert json.loads(rebuilt.to_str()) == json.loads(rust.to_str())
    text = "<s>hello\n<turn> ohell<eot>"
    assert rebuilt.encode(text).ids == rust.encode(text).ids
    assert rebuilt.encode(text).ids[:4] == [1, 7, 8, 6]
    assert (
        rebuilt.token_to_id("<eot>") == 10
        and rebuilt.get_added_tokens_decoder()[2].special is False
    )


def test_non_bpe_tokenizer_is_pickled_as_its_json():
    from tokenizers import Tokenizer, models, pre_tokenizers

    rust = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1, "there": 2}, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    parts = gguf_tokenizer.rust_parts(rust)
    assert parts == ("json", rust.to_str())
    assert gguf_tokenizer.rust_from_parts(parts).encode("hi you there").ids == [1, 0, 2]


def test_cached_pickle_holds_the_rust_tokenizer_in_parts(tmp_path):
    model = tmp_path / "model.gguf"
    _write_gguf(model, WORDS)
    built = gguf_tokenizer.load_gguf_tokenizer(model)
    (entry,) = _entries()
    kinds = []

    class Recording(gguf_tokenizer._PartsUnpickler):
        def persistent_load(self, pid):
            kinds.append(pid[0])
            return super().persistent_load(pid)

    with open(entry / gguf_tokenizer.PICKLE, "rb") as handle:
        cached = Recording(handle).load()
    assert kinds == [gguf_tokenizer.rust_parts(built._tokenizer)[0]] and kinds[0] in ("bpe", "json")
    assert cached._tokenizer.to_str() == built._tokenizer.to_str()
    with pytest.raises(pickle.UnpicklingError):  # a plain unpickler cannot read it: new key
        pickle.loads((entry / gguf_tokenizer.PICKLE).read_bytes())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_zeros_are_zero_and_writable(dtype):
    cache = zeros((2, 3, 64, 2, 8), dtype, torch.device("cpu"))
    assert cache.shape == (2, 3, 64, 2, 8) and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.any()
    layer = cache[1, 2]  # views outlive the parent, as the attention layers' caches do
    del cache
    layer[5].fill_(1.5)
    assert float(layer.sum()) == 1.5 * 16


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no cc")
def test_kernel_cache_miss_is_logged_once(tmp_path, caplog):
    source = tmp_path / "tiny.c"
    source.write_text("int axon_tiny(void) { return 7; }\n")
    compiler = shutil.which("cc") or shutil.which("gcc")
    with caplog.at_level(logging.INFO, logger="axon.kernels.build"):
        first = build._build(compiler, (source,))
        assert "C kernels: cache miss" in caplog.text and "compiled the C kernels" in caplog.text
        caplog.clear()
        assert build._build(compiler, (source,)) == first
        assert caplog.text == ""
        source.write_text("int axon_tiny(void) { return 8; }\n")  # an edited source rebuilds
        assert build._build(compiler, (source,)) != first
    assert ctypes.CDLL(str(first)).axon_tiny() == 7
