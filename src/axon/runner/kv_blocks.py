"""Whole KV blocks and state snapshots as flat bytes, for the prefix cache's disk tier.

A block's bytes are, in a fixed order, its rows of every tensor each attention layer's cache
holds: the plain tensor attributes of the layer whose first dimension counts cache slots
(`num_blocks * block_size`, as `k_cache` and `v_cache`) or blocks (a per-block scale, say). Any
cache layout is copied whole without this module knowing its element type; `layout()` describes
it for the model's fingerprint, so a changed layout never reads old bytes. A hybrid model's
snapshot is its rows of every Gated DeltaNet layer's conv and recurrent state.
"""

from __future__ import annotations

import torch

from axon.layers.attention import Attention
from axon.layers.linear_attention import GatedDeltaNet


class BlockCopier:
    """Copies blocks and snapshot rows between the runner's caches and host byte buffers."""

    def __init__(self, runner) -> None:
        plan = runner.plan
        self.device = runner.device
        self.block_size = plan.block_size
        self.state_base = plan.num_state_slots  # snapshot index i is state row base + i
        self._blocks = []  # (name, view [num_blocks, ...]) per cache tensor
        for index, layer in enumerate(_layers(runner.model, Attention)):
            for name, tensor in sorted(vars(layer).items()):
                if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                    continue
                if tensor.shape[0] == plan.num_tokens:
                    view = tensor.unflatten(0, (plan.num_blocks, plan.block_size))
                elif tensor.shape[0] == plan.num_blocks:
                    view = tensor
                else:
                    continue
                self._blocks.append((f"{index}.{name}", view))
        self._states = []  # (name, tensor [rows, ...]) per state tensor
        for index, layer in enumerate(_layers(runner.model, GatedDeltaNet)):
            for name in ("conv_state", "recurrent_state"):
                self._states.append((f"{index}.{name}", getattr(layer, name)))
        self.block_bytes = sum(_row_bytes(v) for _, v in self._blocks)
        self.state_bytes = sum(_row_bytes(t) for _, t in self._states)

    def layout(self) -> list:
        """Every copied tensor's name, dtype and row shape: the fingerprint's part of it."""
        return [(n, str(t.dtype), list(t.shape[1:])) for n, t in (*self._blocks, *self._states)]

    @property
    def has_states(self) -> bool:
        return bool(self._states)

    # ---- blocks -----------------------------------------------------------------------------

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[n, block_bytes] uint8 on the host: the bytes of these blocks, in order."""
        return _gather([v for _, v in self._blocks], self._index(block_ids))

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Copy `data` [n, block_bytes] (from `read_blocks` or the disk) into these blocks."""
        _scatter([v for _, v in self._blocks], self._index(block_ids), data)

    # ---- state snapshots --------------------------------------------------------------------

    def read_snapshots(self, indices: list[int]) -> torch.Tensor:
        """[n, state_bytes] uint8 on the host: the states held by these snapshot indices."""
        return _gather([t for _, t in self._states], self._rows(indices))

    def write_snapshots(self, indices: list[int], data: torch.Tensor) -> None:
        _scatter([t for _, t in self._states], self._rows(indices), data)

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _rows(self, indices: list[int]) -> torch.Tensor:
        return self._index([self.state_base + i for i in indices])


def _layers(model: torch.nn.Module, kind: type) -> list:
    return [m for m in model.modules() if isinstance(m, kind)]


def _row_bytes(tensor: torch.Tensor) -> int:
    return tensor[0].numel() * tensor.element_size()


def _gather(tensors: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    n = index.shape[0]
    parts = [t.index_select(0, index).reshape(n, -1).view(torch.uint8) for t in tensors]
    return torch.cat(parts, dim=1).cpu()


@torch.inference_mode()
def _scatter(tensors: list[torch.Tensor], index: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    data = data.to(index.device)
    offset = 0
    for tensor in tensors:
        width = _row_bytes(tensor)
        part = data[:, offset : offset + width].contiguous().view(tensor.dtype)
        tensor.index_copy_(0, index, part.view(index.shape[0], *tensor.shape[1:]))
        offset += width
