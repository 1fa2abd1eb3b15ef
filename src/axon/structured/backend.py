"""Constrained decoding with llguidance: a request's `structured_output` becomes a grammar,
each sequence gets a matcher, and every step the matchers' allowed-token bitmasks are applied
to the logits before sampling; the sampled tokens then advance the matchers.

llguidance (Rust, CPU wheels with no dependencies) computes a mask lazily from the grammar's
current lexer state over a token trie, in tens of microseconds for a 150k vocabulary, with no
per-grammar precompilation over the vocabulary; it covers JSON Schema broadly and takes Lark
grammars with inline `%json{…}`, which tool calls use.

The grammar state lives on the Sequence. Preemption recomputes the KV cache but keeps the
generated tokens, so the matcher, which has consumed exactly those tokens, stays consistent.
"""

from __future__ import annotations

import logging

import torch

from axon.structured.grammars import build_grammar

logger = logging.getLogger(__name__)


def _llguidance():
    import llguidance

    return llguidance


def check_grammar(spec: dict) -> None:
    """Raises ValueError when `spec` does not compile to a valid grammar (cheap: no vocab)."""
    llguidance = _llguidance()
    grammar = build_grammar(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"invalid grammar: {messages[0] if messages else 'unknown error'}")


class StructuredOutputs:
    """The engine's grammar side: the tokenizer info llguidance needs (built on first use from
    the model's tokenizer files), per-sequence matchers, and the per-step bitmask."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: frozenset[int]):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._grammars: dict[str, str] = {}
        self._executor = None

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            from axon.engine.llm import load_tokenizer

            hf_tokenizer = load_tokenizer(self.tokenizer_path)
            if hf_tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer")
            from llguidance.hf import from_tokenizer

            size = max(self.vocab_size, len(hf_tokenizer))
            eos = self.eos_token_ids or hf_tokenizer.eos_token_id
            self._tokenizer = from_tokenizer(hf_tokenizer, n_vocab=size, eos_token=eos)
            self._executor = _llguidance().LLExecutor()
        return self._tokenizer

    def matcher(self, spec: dict):
        """A fresh matcher for `spec`; raises ValueError if its grammar is invalid."""
        key = repr(sorted(spec.items()))
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = self._grammars[key] = build_grammar(spec)
        matcher = _llguidance().LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            self._grammars.pop(key, None)
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
        return matcher

    @torch.inference_mode()
    def apply_masks(self, matchers: list, logits: torch.Tensor) -> None:
        """Set to -inf, in place, every logit [B, V] a row's matcher forbids (rows whose
        matcher is None are left alone)."""
        rows = [(m, row) for row, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        size = self._ll_tokenizer().vocab_size
        words = (size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)  # [R, W]
        local = [(matcher, i) for i, (matcher, _) in enumerate(rows)]
        # The rows' masks, computed in parallel by llguidance's thread pool.
        self._executor.unsafe_compute_mask_ptr(local, bitmask.data_ptr(), words * 4, len(rows))
        row_index = torch.tensor([row for _, row in rows], device=logits.device)  # [R]
        allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])  # [R, V]
        logits[row_index] = logits[row_index].masked_fill(~allowed, float("-inf"))

    @staticmethod
    def advance(matchers: list, token_ids: list[int]) -> None:
        """Feed each row's sampled token to its matcher."""
        for matcher, token_id in zip(matchers, token_ids):
            if matcher is not None and not matcher.consume_token(token_id):
                logger.warning("grammar rejected token %d: %s", token_id, matcher.get_error())


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool mask [R, vocab_size] of a packed int32 bitmask [R, W] (bit j of word i is token
    32 * i + j); tokens past the bitmask are forbidden."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.flatten(1).bool()  # [R, 32W]
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    padding = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
    return torch.cat([allowed, padding], dim=1)
