"""Whole KV blocks and state snapshots as flat bytes, for the prefix cache's disk tier.

A block's bytes are, in a fixed order, its rows of every tensor each attention layer's cache
holds: the plain tensor attributes of the layer whose first dimension counts cache slots
(`num_blocks * block_size`, as `k_cache` and `v_cache`) or blocks (a per-block scale, say). Any
cache layout is copied whole without this module knowing its element type; `layout()` describes
it for the model's fingerprint, so a changed layout never reads old bytes. A hybrid model's
snapshot is its rows of every Gated DeltaNet layer's conv and recurrent state.
"""

from __future__ import annotations

import numpy as np
import torch

from axon.layers.attention import Attention
from axon.layers.linear_attention import GatedDeltaNet


class BlockCopier:
    """Copies blocks and snapshot rows between the runner's caches and host byte buffers."""

    def __init__(self, runner) -> None:
        plan = runner.plan
        self.device = runner.device
        self.state_base = plan.num_state_slots  # snapshot index i is state row base + i
        blocks = []  # (name, view [num_blocks, ...]) per cache tensor
        for index, layer in enumerate(_layers(runner.model, Attention)):
            for name, tensor in sorted(vars(layer).items()):
                if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
                    continue
                if tensor.shape[0] == plan.num_tokens:
                    blocks.append((f"{index}.{name}", tensor.unflatten(0, (plan.num_blocks, -1))))
                elif tensor.shape[0] == plan.num_blocks:
                    blocks.append((f"{index}.{name}", tensor))
        states = []  # (name, tensor [rows, ...]) per state tensor
        for index, layer in enumerate(_layers(runner.model, GatedDeltaNet)):
            for name in ("conv_state", "recurrent_state"):
                states.append((f"{index}.{name}", getattr(layer, name)))
        self._layout = [(n, str(t.dtype), list(t.shape[1:])) for n, t in (*blocks, *states)]
        self._blocks = ByteRows([t for _, t in blocks])
        self._states = ByteRows([t for _, t in states])
        self.block_bytes = self._blocks.width
        self.state_bytes = self._states.width

    def layout(self) -> list:
        """Every copied tensor's name, dtype and row shape: the fingerprint's part of it."""
        return self._layout

    @property
    def has_states(self) -> bool:
        return self.state_bytes > 0

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[n, block_bytes] uint8 on the host: the bytes of these blocks, in order."""
        return self._blocks.gather(block_ids)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Copy `data` [n, block_bytes] (from `read_blocks` or the disk) into these blocks."""
        self._blocks.scatter(block_ids, data)

    def read_snapshots(self, indices: list[int]) -> torch.Tensor:
        """[n, state_bytes] uint8 on the host: the states held by these snapshot indices."""
        return self._states.gather([self.state_base + i for i in indices])

    def write_snapshots(self, indices: list[int], data: torch.Tensor) -> None:
        self._states.scatter([self.state_base + i for i in indices], data)


class ByteRows:
    """Tensors of as many rows each, as one byte matrix [rows, sum of their row bytes]: a
    row's bytes are each tensor's row in turn. Views, so writes land in the tensors.

    On the CPU the copies are numpy's: one thread each, where torch's parallel copies of these
    small slices wait on OpenMP threads (tens of ms each on a busy machine)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.flats = [t.view(t.shape[0], -1).view(torch.uint8) for t in tensors]
        self.widths = [flat.shape[1] for flat in self.flats]
        self.width = sum(self.widths)
        cpu = all(flat.device.type == "cpu" for flat in self.flats)
        self.arrays = [flat.numpy() for flat in self.flats] if cpu else None

    def _spans(self):
        offset = 0
        for index, width in enumerate(self.widths):
            yield index, slice(offset, offset + width)
            offset += width

    def gather(self, rows: list[int]) -> torch.Tensor:
        if self.arrays is not None:
            out = np.empty((len(rows), self.width), dtype=np.uint8)
            for index, span in self._spans():
                out[:, span] = self.arrays[index][rows]
            return torch.from_numpy(out)
        index = torch.tensor(rows, dtype=torch.long, device=self.flats[0].device)
        return torch.cat([flat.index_select(0, index) for flat in self.flats], dim=1).cpu()

    @torch.inference_mode()
    def scatter(self, rows: list[int], data: torch.Tensor) -> None:
        if self.arrays is not None:
            source = data.numpy()
            for index, span in self._spans():
                self.arrays[index][rows] = source[:, span]
            return
        device = self.flats[0].device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        data = data.to(device)
        for flat, (_, span) in zip(self.flats, self._spans()):
            flat.index_copy_(0, index, data[:, span])


def _layers(model: torch.nn.Module, kind: type) -> list:
    return [m for m in model.modules() if isinstance(m, kind)]
