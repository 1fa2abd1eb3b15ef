"""The HF tokenizer of a GGUF file: a `tokenizer.json` next to the file wins, else the one
transformers builds from the GGUF vocabulary (SentencePiece `llama` and BPE `gpt2` vocabs, special
tokens, add_bos), with the chat template from the metadata."""

from __future__ import annotations

from pathlib import Path


def load_gguf_tokenizer(path: str | Path):
    """A PreTrainedTokenizerFast for the GGUF file at `path` (offline)."""
    from transformers import AutoTokenizer

    from axon.loader.gguf import release_freed_memory

    path = Path(path)
    if (path.parent / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(path.parent))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    release_freed_memory()  # transformers parsed the whole file's metadata for it
    return tokenizer
