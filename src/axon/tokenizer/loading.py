"""Loading a model's HF tokenizer, for the HTTP process and the offline LLM alike. Light on
purpose: the HTTP process imports it without the engine stack (torch), which only the engine
process needs."""

from __future__ import annotations

import logging
import threading

from axon.loader import is_gguf
from axon.tokenizer.auto_class import load_auto_tokenizer
from axon.tokenizer.gguf_tokenizer import load_gguf_tokenizer

logger = logging.getLogger(__name__)
_TOKENIZER_LOAD = threading.Lock()


def load_tokenizer(path: str):
    """The model's HF tokenizer, or None when the directory has none (token-id prompts only).
    One load at a time per process: the HTTP process loads models' tokenizers on threads, and
    transformers' lazy imports are not thread-safe (two at once: "cannot import name
    'AutoTokenizer'")."""
    with _TOKENIZER_LOAD:
        try:
            if is_gguf(path):
                return load_gguf_tokenizer(path)
            # AutoTokenizer's choice of class without its torch import, once recorded.
            return load_auto_tokenizer(path)
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("no tokenizer from %s (%s); only token-id prompts work", path, exc)
            return None
