"""Incremental, UTF-8 safe detokenization.

Each new token is decoded together with a few tokens before it, so that tokenizers which merge
spaces or bytes across tokens (SentencePiece, byte-level BPE) yield the same text as decoding
the whole sequence; text ending in an incomplete UTF-8 character ("\\ufffd") is held back until
the character completes.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""
