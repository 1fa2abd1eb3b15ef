"""Loading a model's HF tokenizer, for the HTTP process and the offline LLM alike. Light on
purpose: the HTTP process imports it without the engine stack (torch), which only the engine
process needs."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)
_TOKENIZER_LOAD = threading.Lock()


def load_tokenizer(path: str):
    """The model's HF tokenizer, or None when the directory has none (token-id prompts only).
    One load at a time per process: the HTTP process loads models' tokenizers on threads, and
    transformers' lazy imports are not thread-safe (two at once: "cannot import name
    'AutoTokenizer'")."""
    with _TOKENIZER_LOAD:
        from axon.loader import is_gguf
        from axon.loader.gguf_tokenizer import load_gguf_tokenizer

        try:
            if is_gguf(path):
                return load_gguf_tokenizer(path)
            # AutoTokenizer's choice of class without its torch import, once recorded.
            from axon.tokenizer.auto_class import load_auto_tokenizer

            return load_auto_tokenizer(path)
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("no tokenizer from %s (%s); only token-id prompts work", path, exc)
            return None
