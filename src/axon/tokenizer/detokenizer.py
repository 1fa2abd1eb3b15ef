"""Incremental, UTF-8 safe detokenization.

Each new token is decoded together with a few tokens before it, so that tokenizers which merge
spaces or bytes across tokens (SentencePiece, byte-level BPE) yield the same text as decoding
the whole sequence; text ending in an incomplete UTF-8 character ("\\ufffd") is held back until
the character completes.

`skip_special_tokens` never drops the output parsers' markers (`<think>`, `</think>`,
`<tool_call>`, `</tool_call>`): a tokenizer may flag them special, and the reasoning and tool-call
parsers must still see them (they strip them from what they emit). So the text is the same
whether or not the tokenizer flags them special; every other special token is still skipped.
"""

from __future__ import annotations

from axon.tokenizer.parsers import MARKER_TOKENS

_CONTEXT_TOKENS = 5

_skipped_ids: dict[int, tuple[object, frozenset[int] | None]] = {}


def skipped_special_ids(tokenizer) -> frozenset[int] | None:
    """The ids `skip_special_tokens` must drop when some marker token is flagged special (all
    special ids but the markers'); None when no marker is special, so the tokenizer's own
    skipping is already right. Looked up once per tokenizer."""
    cached = _skipped_ids.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {token_id for token_id, token in added.items() if getattr(token, "special", False)}
    special.update(getattr(tokenizer, "all_special_ids", None) or ())
    markers = {i for i, token in added.items() if getattr(token, "content", token) in MARKER_TOKENS}
    skipped = frozenset(special - markers) if markers & special else None
    _skipped_ids[id(tokenizer)] = (tokenizer, skipped)
    return skipped


def backend_decode(tokenizer):
    """The Rust tokenizer's `decode(ids, skip_special_tokens=...)` when `tokenizer.decode` is
    exactly that (a transformers fast tokenizer that does not clean up spaces), else None.
    Streaming decodes twice per token, and the Python wrapper around it costs more than the
    decode itself."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(tokenizer)
    if (
        kind.decode is not PreTrainedTokenizerBase.decode
        or getattr(kind, "_decode", None) is not TokenizersBackend._decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False
    ):
        return None
    return tokenizer.backend_tokenizer.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.decode = backend_decode(tokenizer) or tokenizer.decode
        self.skip_special_tokens = skip_special_tokens
        # Set when skipping must spare special marker tokens: then this list is what is skipped.
        self.skipped_ids = skipped_special_ids(tokenizer) if skip_special_tokens else None
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        if self.skipped_ids is not None:
            kept = [token_id for token_id in token_ids if token_id not in self.skipped_ids]
            return self.decode(kept, skip_special_tokens=False)
        return self.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

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
