"""The HF tokenizer of a GGUF file: a `tokenizer.json` next to the file wins, else the one
transformers builds from the GGUF vocabulary (SentencePiece `llama` and BPE `gpt2` vocabs, special
tokens, add_bos), with the chat template from the metadata.

Building it means parsing every metadata field of the file in Python (a minute for gemma-3's
262k-token vocabulary on a busy machine), so the result is kept in axon's cache
(`cache_dir()/tokenizers/<key>/tokenizer.pickle`) keyed by the file (size, mtime, a hash of its
metadata) and the transformers and tokenizers versions. A pickle, not save_pretrained: it restores
the very object that was built (no re-normalisation of its settings) in half the time of
from_pretrained (1.5 vs 3.2 CPU-s for gemma-3); the cache is the user's own, like the compiled
kernels it sits beside, and its manifest's sha256 is checked before it is read.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

from axon.cache_dir import cached_entry, discard, file_key

logger = logging.getLogger(__name__)
PICKLE = "tokenizer.pickle"


def load_gguf_tokenizer(path: str | Path):
    """A PreTrainedTokenizerFast for the GGUF file at `path` (offline). Writes the cache entry
    on a miss; a cache entry that does not load is rebuilt."""
    from transformers import AutoTokenizer

    path = Path(path)
    if (path.parent / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(path.parent))
    key = tokenizer_cache_key(path)
    built: list = []

    def build(directory: Path) -> None:
        built.append(tokenizer_from_gguf(path))
        (directory / PICKLE).write_bytes(pickle.dumps(built[0], protocol=pickle.HIGHEST_PROTOCOL))

    entry, _ = cached_entry("tokenizers", key, build)
    if built:
        return built[0]
    try:
        return pickle.loads((entry / PICKLE).read_bytes())
    except Exception:  # noqa: BLE001 - files that match their manifest yet do not load
        discard(entry)
        entry, _ = cached_entry("tokenizers", key, build)
        return built[0] if built else pickle.loads((entry / PICKLE).read_bytes())


def tokenizer_cache_key(path: Path) -> str:
    """The cache key of `path`'s tokenizer: the file, and the libraries that build and read it."""
    import tokenizers
    import transformers

    versions = (transformers.__version__, tokenizers.__version__)
    return file_key(path, "tokenizer.pickle", *versions)


def tokenizer_from_gguf(path: Path):
    """The tokenizer transformers builds from the GGUF metadata (slow: see the module doc)."""
    from transformers import AutoTokenizer

    from axon.loader.gguf import release_freed_memory

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    release_freed_memory()  # transformers parsed the whole file's metadata for it
    return tokenizer
