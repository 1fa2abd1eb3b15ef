"""Constrained decoding with llguidance: a request's `structured_output` becomes a grammar,
each sequence gets a matcher, and every step the matchers' allowed-token bitmasks are applied
to the logits before sampling; the sampled tokens then advance the matchers.

llguidance (Rust, CPU wheels with no dependencies) computes a mask lazily from the grammar's
current lexer state over a token trie, in tens of microseconds for a 150k vocabulary, with no
per-grammar precompilation over the vocabulary; it covers JSON Schema broadly and takes Lark
grammars with inline `%json{…}`, which tool calls use.

The grammar state lives on the Sequence. Preemption recomputes the KV cache but keeps the
generated tokens, so the matcher, which has consumed exactly those tokens, stays consistent.
Under speculative decoding a drafted sequence's verified rows are masked in turn, each after
the drafts before it (llguidance consumes them and rolls them back), and the matcher then
consumes only the tokens the step kept.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections import OrderedDict

import numpy as np
import torch

from axon.structured.grammars import build_grammar
from axon.tokenizer.loading import load_tokenizer

logger = logging.getLogger(__name__)
# Compiled grammars kept per engine: every distinct schema or tool list is a new key, so the
# cache is bounded (least recently used out) lest a stream of distinct requests grow it forever.
GRAMMAR_CACHE_SIZE = 256


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
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._executor = None
        self._build_lock = threading.Lock()
        self._build_error: Exception | None = None
        self._building = False

    @property
    def ready(self) -> bool:
        """Whether a matcher can be made without waiting for the tokenizer build (it is done,
        or it failed and making one raises at once)."""
        return self._tokenizer is not None or self._build_error is not None

    def start_build(self) -> None:
        """Builds the tokenizer info in a background thread (for a large vocabulary it takes
        seconds to tens of seconds), so the engine keeps stepping other requests meanwhile."""
        if self.ready or self._building:
            return
        self._building = True
        threading.Thread(target=self._build_in_background, name="llg-build", daemon=True).start()

    def _build_in_background(self) -> None:
        with contextlib.suppress(ValueError):  # kept in _build_error: matcher() raises it
            self._ll_tokenizer()

    def _ll_tokenizer(self):
        with self._build_lock:  # a build in progress (the background one) is waited for
            if self._tokenizer is None and self._build_error is None:
                try:
                    self._tokenizer = self._build_tokenizer()
                except Exception as exc:  # noqa: BLE001 - one failure, reported to all
                    logger.error("structured output is unavailable: %s", exc)
                    self._build_error = exc
            if self._build_error is not None:
                raise ValueError(f"structured output is unavailable: {self._build_error}")
        return self._tokenizer

    def _build_tokenizer(self):
        from llguidance.hf import from_tokenizer

        hf_tokenizer = load_tokenizer(self.tokenizer_path)
        if hf_tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        size = max(self.vocab_size, len(hf_tokenizer))
        eos = self.eos_token_ids or hf_tokenizer.eos_token_id
        self._executor = _llguidance().LLExecutor()
        return from_tokenizer(hf_tokenizer, n_vocab=size, eos_token=eos)

    def matcher(self, spec: dict):
        """A fresh matcher for `spec`; raises ValueError if its grammar is invalid."""
        grammar = self._grammar(spec)
        matcher = _llguidance().LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            self._grammars.pop(_grammar_key(spec), None)
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
        return matcher

    def _grammar(self, spec: dict) -> str:
        """The compiled grammar of `spec`, from the LRU cache when it is there."""
        key = _grammar_key(spec)
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        grammar = self._grammars[key] = build_grammar(spec)
        while len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    @torch.inference_mode()
    def apply_masks(
        self, matchers: list, logits: torch.Tensor, drafts: list[list[int]] | None = None
    ) -> None:
        """Set to -inf, in place, every logit [B, V] a row's matcher forbids (rows whose
        matcher is None are left alone). `drafts[i]` (speculative decoding): the drafts that
        rows i + 1 .. i + len(drafts[i]) verify, rows of the same matcher: row i + j is masked
        as after the drafts before it (the matcher consumes them and rolls them back)."""
        tasks, rows = [], []  # (matcher, its first mask, drafts); the logits row of each mask
        row = 0
        while row < len(matchers):
            draft = drafts[row] if drafts is not None else []
            if matchers[row] is not None:
                tasks.append((matchers[row], len(rows), draft))
                rows.extend(range(row, row + 1 + len(draft)))
            row += 1 + len(draft)
        if not tasks:
            return
        words = (self._ll_tokenizer().vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)  # [R, W]
        # The masks, computed in parallel by llguidance's thread pool (a drafted matcher's
        # in turn, each after consuming the draft before it).
        executor, pointer, size = self._executor, bitmask.data_ptr(), words * 4
        plain = [(matcher, first) for matcher, first, draft in tasks if not draft]
        if plain:
            executor.unsafe_compute_mask_ptr(plain, pointer, size, len(rows))
        drafted = [task for task in tasks if task[2]]
        if drafted:
            executor.unsafe_compute_mask_ptr_with_draft_token(drafted, pointer, size, len(rows))
        allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])  # [R, V]
        if len(rows) == logits.shape[0]:  # every row (one stream, its drafts): in place
            logits.masked_fill_(~allowed, float("-inf"))
            return
        row_index = torch.tensor(rows, device=logits.device)  # [R]
        logits[row_index] = logits[row_index].masked_fill(~allowed, float("-inf"))

    @staticmethod
    def advance(matchers: list, token_ids: list[list[int]]) -> None:
        """Feed each matcher its sequence's new tokens (one, or a drafted step's kept ones),
        one at a time as without drafts (a stopped grammar takes EOS once a token)."""
        for matcher, tokens in zip(matchers, token_ids):
            for token_id in tokens if matcher is not None else ():
                if not matcher.consume_token(token_id):
                    logger.warning("grammar rejected token %d: %s", token_id, matcher.get_error())
                    break


def _grammar_key(spec: dict) -> str:
    return repr(sorted(spec.items()))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool mask [R, vocab_size] of a packed int32 bitmask [R, W] (bit j of word i is token
    32 * i + j); tokens past the bitmask are forbidden."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        # Bit j of word i is bit j % 8 of byte 4 i + j // 8: numpy unpacks the bytes in one
        # pass, 10x faster than the shifts below over a 262k vocabulary (per verified row).
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)  # [R, 32W], 0 or 1 a byte
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [R, 32W]
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    padding = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
    return torch.cat([allowed, padding], dim=1)
