"""The one ambient object: the flat batch's attention metadata, set by the runner per step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """One sequence computing `query_len` tokens ending at position `context_len - 1`."""

    query_start: int
    query_len: int
    context_len: int
    key_slots: torch.Tensor  # [context_len] cache slots of every key the chunk attends to
    state_slot: int | None = None  # hybrid models: the sequence's recurrent-state slot
    has_initial_state: bool = False  # the slot holds the state before this chunk (else zeros)
    # Hybrid models: (tokens into the chunk, state row) snapshots due strictly inside the chunk.
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # A decode step's token and the drafts it verifies (speculative decoding): its rows attend
    # as decode queries, one at a time, so that each equals to the bit the same token computed
    # by a decode step (the prefill kernel's online softmax sums in another order).
    verifies: bool = False


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    prefills: list[PrefillChunk]
    decode_token_index: torch.Tensor | None  # [Bd] rows of the flat batch that are decodes
    decode_key_slots: torch.Tensor | None  # [Bd, C] key slots, padded with slot 0
    decode_context_lens: torch.Tensor | None  # [Bd]
    decode_state_slots: torch.Tensor | None = None  # [Bd] hybrid models: recurrent-state slots
    _masks: dict = field(default_factory=dict)

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor:
        """[Q, C] bool: query i (position C-Q+i) may see key j."""
        key = ("prefill", index, window)
        if key not in self._masks:
            chunk = self.prefills[index]
            device = chunk.key_slots.device
            q_pos = torch.arange(chunk.query_len, device=device) + (
                chunk.context_len - chunk.query_len
            )
            k_pos = torch.arange(chunk.context_len, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if window is not None:
                mask &= q_pos[:, None] - k_pos[None, :] < window
            self._masks[key] = mask
        return self._masks[key]

    def prefill_layout(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The prefill chunks that verify no drafts as the C prefill-attention kernel reads them,
        built once a step: [N, 4] int64 (query_start, query_len, context_len, offset of the
        chunk's key slots) and every chunk's key slots, concatenated; None when there are none."""
        if "layout" not in self._masks:
            rows, offset = [], 0
            prompts = [chunk for chunk in self.prefills if not chunk.verifies]
            if not prompts:
                self._masks["layout"] = None
                return None
            for chunk in prompts:
                rows.append((chunk.query_start, chunk.query_len, chunk.context_len, offset))
                offset += chunk.context_len
            slots = torch.cat([chunk.key_slots.view(-1) for chunk in prompts]).long()
            self._masks["layout"] = (torch.tensor(rows, dtype=torch.long), slots.contiguous())
        return self._masks["layout"]

    def verify_queries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The chunks that verify drafts as decode queries, one a row, built once a step: their
        rows of the flat batch [R], each row's key slots [R, W] (its chunk's, padded) and
        context length [R]; None when there are none."""
        if "verify" not in self._masks:
            chunks = [chunk for chunk in self.prefills if chunk.verifies]
            if not chunks:
                self._masks["verify"] = None
                return None
            width = max(chunk.context_len for chunk in chunks)
            rows, lens = [], []
            slots = torch.zeros(sum(c.query_len for c in chunks), width, dtype=torch.long)
            for chunk in chunks:
                first = chunk.context_len - chunk.query_len + 1  # the first query's context
                for i in range(chunk.query_len):
                    slots[len(rows), : chunk.context_len] = chunk.key_slots.view(-1)
                    rows.append(chunk.query_start + i)
                    lens.append(first + i)
            device = chunks[0].key_slots.device
            self._masks["verify"] = (torch.tensor(rows, device=device), slots.to(device),
                                     torch.tensor(lens, device=device))  # fmt: skip
        return self._masks["verify"]

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Bd, C] bool: which padded key slots each decode query may see."""
        key = ("decode", window)
        if key not in self._masks:
            lens = self.decode_context_lens
            k_pos = torch.arange(self.decode_key_slots.shape[1], device=lens.device)
            mask = k_pos[None, :] < lens[:, None]
            if window is not None:
                mask &= (lens[:, None] - 1) - k_pos[None, :] < window
            self._masks[key] = mask
        return self._masks[key]


_CONTEXT: AttentionMetadata | None = None


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: run the model through ModelRunner")
    return _CONTEXT


@contextmanager
def set_forward_context(meta: AttentionMetadata) -> Iterator[None]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, meta
    try:
        yield
    finally:
        _CONTEXT = previous
