"""The HF tokenizer of a GGUF file: a `tokenizer.json` next to the file wins, else the one
transformers builds from the GGUF vocabulary (SentencePiece `llama` and BPE `gpt2` vocabs, special
tokens, add_bos), with the chat template from the metadata.

Building it means parsing every metadata field of the file in Python (slow for a 262k-token
vocabulary such as gemma-3's), so the result is kept in axon's cache
(`cache_dir()/tokenizers/<key>/tokenizer.pickle`) keyed by the file (size, mtime, a hash of its
metadata) and the transformers and tokenizers versions. A pickle, not save_pretrained: it restores
the very object that was built (no re-normalisation of its settings) in half the time of
from_pretrained; the cache is the user's own, like the compiled kernels it sits beside, and its
manifest's sha256 is checked before it is read.

Most of an unpickle is the Rust tokenizer parsing its own JSON (`Tokenizer.from_file` of a
saved tokenizer.json costs the same). So the pickle holds a BPE tokenizer in parts
(`rust_parts`): its settings as JSON, and the vocabulary, merges and added tokens as Python
objects, from which `models.BPE` builds it. What is left is the BPE model's own build
(vocabulary and merge maps), which no serialization avoids.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import pickle
from pathlib import Path

from axon.cache_dir import cached_entry, discard, file_key
from axon.tokenizer.auto_class import load_auto_tokenizer

logger = logging.getLogger(__name__)
PICKLE = "tokenizer.pickle"
# Part of the cache key: names the pickle's layout (bump when `rust_parts` changes shape).
PICKLE_FORMAT = "tokenizer.pickle/bpe-parts-1"
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def load_gguf_tokenizer(path: str | Path):
    """A PreTrainedTokenizerFast for the GGUF file at `path` (offline). Writes the cache entry
    on a miss; a cache entry that does not load is rebuilt. A cache hit imports neither torch
    nor AutoTokenizer (whose module imports torch): unpickling needs the tokenizer's class only,
    so the HTTP process stays free of torch."""
    path = Path(path)
    if (path.parent / "tokenizer.json").exists():
        # AutoTokenizer's class, recorded once: a repeat load imports neither torch nor it.
        return load_auto_tokenizer(str(path.parent))
    key = tokenizer_cache_key(path)
    built: list = []

    def build(directory: Path) -> None:
        built.append(tokenizer_from_gguf(path))
        (directory / PICKLE).write_bytes(dump_tokenizer(built[0]))

    entry, _ = cached_entry("tokenizers", key, build)
    if built:
        return built[0]
    try:
        return read_tokenizer(entry / PICKLE)
    except Exception:  # noqa: BLE001 - files that match their manifest yet do not load
        discard(entry)
        entry, _ = cached_entry("tokenizers", key, build)
        return built[0] if built else read_tokenizer(entry / PICKLE)


def tokenizer_cache_key(path: Path) -> str:
    """The cache key of `path`'s tokenizer: the file, the pickle's layout, and the libraries
    that build and read it."""
    import tokenizers
    import transformers

    versions = (transformers.__version__, tokenizers.__version__)
    return file_key(path, PICKLE_FORMAT, *versions)


def dump_tokenizer(tokenizer) -> bytes:
    """`tokenizer` pickled, its Rust tokenizer (`tokenizers.Tokenizer`) as `rust_parts`."""
    buffer = io.BytesIO()
    _PartsPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(tokenizer)
    return buffer.getvalue()


def read_tokenizer(path: Path):
    """The tokenizer `dump_tokenizer` wrote to `path`."""
    return _PartsUnpickler(io.BytesIO(path.read_bytes())).load()


class _PartsPickler(pickle.Pickler):
    def persistent_id(self, obj):
        from tokenizers import Tokenizer

        return rust_parts(obj) if type(obj) is Tokenizer else None


class _PartsUnpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        return rust_from_parts(pid)


def rust_parts(rust) -> tuple:
    """What `rust_from_parts` rebuilds the `tokenizers.Tokenizer` `rust` from: ("bpe", settings
    JSON without vocabulary, merges and added tokens; vocab dict; merge pairs; added tokens'
    dicts) for a BPE model that they rebuild exactly, else ("json", its JSON)."""
    whole = rust.to_str()
    state = json.loads(whole)
    model = state["model"]
    if model.get("type") != "BPE" or not all(isinstance(m, list) for m in model["merges"]):
        return ("json", whole)
    vocab, merges = model["vocab"], [tuple(m) for m in model["merges"]]
    added, state["added_tokens"] = state["added_tokens"], []
    model.update(vocab={}, merges=[])
    parts = ("bpe", json.dumps(state), vocab, merges, added)
    try:
        exact = json.loads(rust_from_parts(parts).to_str()) == json.loads(whole)
    except Exception:  # noqa: BLE001 - settings models.BPE does not take: keep the JSON
        exact = False
    return parts if exact else ("json", whole)


def rust_from_parts(parts: tuple):
    """The `tokenizers.Tokenizer` that `rust_parts` took apart."""
    from tokenizers import AddedToken, Tokenizer, models

    if parts[0] == "json":
        return Tokenizer.from_str(parts[1])
    _, settings, vocab, merges, added = parts
    rust = Tokenizer.from_str(settings)  # normalizer, pre-tokenizer, decoder...: small
    model = json.loads(settings)["model"]
    # models.BPE takes the JSON's settings by name, an unset one (null) only by leaving it out.
    options = {name: value for name, value in model.items() if value is not None}
    for name in ("type", "vocab", "merges"):
        options.pop(name)
    rust.model = models.BPE(vocab, merges, **options)
    # After the model, in their order: an added token in the vocabulary takes its id from it.
    for special, run in itertools.groupby(added, key=lambda token: token["special"]):
        tokens = [
            AddedToken(token["content"], **{flag: token[flag] for flag in _ADDED_TOKEN_FLAGS})
            for token in run
        ]
        (rust.add_special_tokens if special else rust.add_tokens)(tokens)
    return rust


def tokenizer_from_gguf(path: Path):
    """The tokenizer transformers builds from the GGUF metadata (slow: see the module doc)."""
    from transformers import AutoTokenizer

    from axon.loader.gguf import release_freed_memory  # lazy: imports torch

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    release_freed_memory()  # transformers parsed the whole file's metadata for it
    return tokenizer
