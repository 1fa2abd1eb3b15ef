"""The inputs of a decode-only step, built with a few numpy operations and no torch ones.

A decode computes one token per sequence, so its inputs are a few integers per sequence plus
the key slots of its context. A decode with drafts to verify (speculative decoding) is one such
row per token, each attending to the keys up to its own position: the step stays decode-only, so
it runs the C decode layers (layers/fused_decode.py) that a prefill chunk would leave, whose
Python around 30 small layers cost more than a verify row's compute.

The general path (`ModelRunner.prepare`) builds them with a torch operation per list, ~10 small
tensors a step, each costing far more than its data right after a forward has evicted the
caches. Here the integers go into numpy arrays that tensors view without a copy: on one CPU rank
persistent ones (`HostBuffers`), elsewhere fresh ones, copied once to an accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from axon.batch import SchedulerOutput
from axon.layers.forward_context import AttentionMetadata
from axon.sampling.metadata import row_range
from axon.sequence import Sequence


@dataclass
class DecodeInputs:
    """One decode-only step's tensors; the scheduled sequences' rows in order, each sampled:
    one a sequence, 1 + drafts for a sequence that verifies drafts."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    attn: AttentionMetadata  # decodes only: slot mapping, key slots [B, C], context lengths
    rows: torch.Tensor  # [B] arange: the decode rows, and the rows whose logits are sampled
    seqs: list[Sequence]  # [B] each row's sequence
    offsets: list[int] | None = None  # [B] each row's output position past the next, if drafted


def is_decode_only(out: SchedulerOutput) -> bool:
    """Whether every scheduled sequence computes just its last token (a decode, or a prompt's
    final token past any image) and the drafts it verifies, after at least one computed token,
    with no state snapshot due this step: the steps `decode_inputs` builds. Drafts only where
    the sequence has no recurrent state (a GDN layer's verify rows chain their states)."""
    if out.state_saves:
        return False
    for seq, num_new in out.scheduled:
        start = seq.num_computed_tokens
        if start == 0 or seq.num_tokens - start != 1:
            return False
        if num_new != 1 and (num_new != 1 + len(seq.spec_token_ids) or seq.state_slot is not None):
            return False
        if seq.images is not None and start < seq.num_prompt_tokens:
            return False
    return True


def decode_inputs(
    out: SchedulerOutput,
    block_size: int,
    device: torch.device,
    host: HostBuffers | None = None,
) -> DecodeInputs:
    """Return the tensors of a decode-only step (`is_decode_only(out)`) on `device`; with
    `host` (CPU only) they are views of its arrays, valid until its next use.

    The same values as the general path's: a row's key slots cover its block table's first
    ceil(C / block_size) blocks, block 0 standing in past the table's end.
    """
    seqs = [seq for seq, num_new in out.scheduled for _ in range(num_new)]
    drafted = len(seqs) > len(out.scheduled)
    columns = _columns(out.scheduled, block_size)
    width = max(columns[3])
    if host is not None:
        # Not the kept key slots when drafted: they assume a table only grows, and a rejected
        # draft's block is given back (BlockManager.trim) and may come back another one.
        keep = not drafted
        keys = (host.key_slots if keep else _key_slots)(seqs, width, block_size)
        key_slots = torch.from_numpy(keys)  # [B, C]
        values = host.tensors(columns)
    else:
        key_slots = torch.from_numpy(_key_slots(seqs, width, block_size))  # [B, C]
        values = torch.from_numpy(np.array(columns, np.int64))  # [4 or 5, B]
        if device.type != "cpu":
            values, key_slots = values.to(device), key_slots.to(device)
        values = values.unbind(0)  # [B] each
    rows = row_range(len(seqs), device)
    attn = AttentionMetadata(
        slot_mapping=values[2],
        prefills=[],
        decode_token_index=rows,
        decode_key_slots=key_slots,
        decode_context_lens=values[3],
        decode_state_slots=values[4] if len(values) > 4 else None,
    )
    offsets = [i for _, num_new in out.scheduled for i in range(num_new)] if drafted else None
    return DecodeInputs(values[0], values[1], attn, rows, seqs, offsets)


def _columns(scheduled: list[tuple[Sequence, int]], block_size: int) -> list[list[int]]:
    """Return [input ids, positions, cache slots, context lengths(, state slots)], [B] each:
    a row per scheduled token (a decode's, then its drafts')."""
    columns = [[], [], [], []]
    for seq, num_new in scheduled:
        start = seq.num_computed_tokens
        delta = seq.images.mrope_delta if seq.images is not None else 0
        tokens = seq.scheduled_token_ids(start, start + num_new) if num_new > 1 else None
        for position in range(start, start + num_new):
            block, offset = divmod(position, block_size)
            columns[0].append(seq.token_ids[start] if tokens is None else tokens[position - start])
            columns[1].append(position + delta)
            columns[2].append(seq.block_table[block] * block_size + offset)
            columns[3].append(position + 1)
    if scheduled[0][0].state_slot is not None:  # decodes only (is_decode_only)
        columns.append([seq.state_slot for seq, _ in scheduled])
    return columns


def _key_slots(seqs: list[Sequence], width: int, block_size: int) -> np.ndarray:
    """Return the cache slots [B, width] of each row's key positions [0, width)."""
    num_blocks = -(-width // block_size)
    tables = [seq.block_table[:num_blocks] for seq in seqs]
    tables = np.array([t + [0] * (num_blocks - len(t)) for t in tables], np.int64)  # [B, nb]
    block_of, offset_of = _key_layout(width, block_size)  # [C], [C]
    key_slots = tables.take(block_of, axis=1)  # [B, C], C-contiguous (tables[:, i] is not)
    key_slots *= block_size
    key_slots += offset_of
    return key_slots


class HostBuffers:
    """Persistent host arrays of decode steps on one CPU rank, so that a step makes no tensor
    for its per-row columns and, at batch 1, no key slots beyond its new block's.

    The columns are views made once per (columns, rows) shape, which each step overwrites; a
    lone sequence's key slots are kept across steps and extended as its block table grows
    (append-only while it runs: a new list after preemption). So a step's tensors are valid
    until the next step is prepared: fine for one engine running one step at a time, not for
    inputs that outlive the step (tensor-parallel ranks are sent theirs, an accelerator gets
    copies) — those take fresh arrays instead.
    """

    def __init__(self) -> None:
        self.host = np.zeros((5, 16), np.int64)  # [columns, rows]
        self.views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.table: list[int] | None = None  # the lone sequence's block table, as last seen
        self.slots = np.zeros(0, np.int64)  # its key slots, the first `num_blocks` blocks'
        self.num_blocks = 0

    def tensors(self, columns: list[list[int]]) -> list[torch.Tensor]:
        """Return `columns` as [B] long tensors that share this object's memory."""
        shape = (len(columns), len(columns[0]))
        if shape[1] > self.host.shape[1]:  # a new array: the views handed out keep the old one
            self.host = np.zeros((5, 2 * shape[1]), np.int64)
            self.views = {}
        views = self.views.get(shape)
        if views is None:
            rows = [self.host[i, : shape[1]] for i in range(shape[0])]
            views = self.views[shape] = [torch.from_numpy(row) for row in rows]
        self.host[: shape[0], : shape[1]] = columns
        return views

    def key_slots(self, seqs: list[Sequence], width: int, block_size: int) -> np.ndarray:
        """Return `_key_slots(seqs, width, block_size)`; for one sequence from the kept ones."""
        if len(seqs) != 1:
            return _key_slots(seqs, width, block_size)
        table = seqs[0].block_table
        if table is not self.table:
            self.table, self.num_blocks = table, 0
        num_blocks = -(-width // block_size)  # <= len(table): its new token's block is there
        if num_blocks > self.num_blocks:
            if num_blocks * block_size > self.slots.shape[0]:
                slots = np.zeros(2 * num_blocks * block_size, np.int64)
                slots[: self.num_blocks * block_size] = self.slots[: self.num_blocks * block_size]
                self.slots = slots
            added = np.array(table[self.num_blocks : num_blocks], np.int64)[:, None] * block_size
            added = added + np.arange(block_size, dtype=np.int64)  # [new blocks, block_size]
            self.slots[self.num_blocks * block_size : num_blocks * block_size] = added.ravel()
            self.num_blocks = num_blocks
        return self.slots[:width].reshape(1, width)


# (block index, offset in the block) of key positions [0, n), per block size, grown as needed.
_KEY_LAYOUTS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _key_layout(width: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (position // block_size, position % block_size) [width] each, read-only views."""
    layout = _KEY_LAYOUTS.get(block_size)
    if layout is None or layout[0].shape[0] < width:
        positions = np.arange(max(width, 4096) * 2, dtype=np.int64)
        layout = _KEY_LAYOUTS[block_size] = (positions // block_size, positions % block_size)
    return layout[0][:width], layout[1][:width]
