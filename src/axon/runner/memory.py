"""The KV-cache memory plan: how many blocks fit the budget, and what each token costs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from axon.layers.kv_quant import cache_shape, head_bytes
from axon.speculative_config import draft_state_rows

logger = logging.getLogger(__name__)

_CPU_DEFAULT_CAP = 4 << 30  # a CPU default that leaves the host usable


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int
    # Hybrid models: recurrent-state slots (one per running sequence) and prefix snapshots.
    num_state_slots: int = 0
    num_state_snapshots: int = 0
    state_bytes_per_slot: int = 0
    # Memory left out of the budget for the vision tower's activations on the largest image.
    reserved_bytes: int = 0
    # Speculative decoding: scratch state rows, each a draft position's state until verified.
    num_draft_state_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def state_bytes(self) -> int:
        rows = self.num_state_slots + self.num_state_snapshots + self.num_draft_state_rows
        return rows * self.state_bytes_per_slot

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token + self.state_bytes

    def describe(self) -> str:
        text = (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} "
            f"tokens, {self.bytes_per_token} B/token, {self.total_bytes / 2**20:.1f} MiB; "
            f"max_model_len {self.max_model_len}"
        )
        if self.state_bytes_per_slot:
            text += (
                f"; state: {self.num_state_slots} slots + {self.num_state_snapshots} snapshots "
                f"+ {self.num_draft_state_rows} draft rows "
                f"x {self.state_bytes_per_slot / 2**20:.2f} MiB"
            )
        if self.reserved_bytes:
            text += f"; {self.reserved_bytes / 2**20:.1f} MiB reserved for image encoding"
        return text


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K and V of one token in every layer: a q8_0 cache (uint8) counts its scales."""
    return 2 * num_layers * num_kv_heads * head_bytes(dtype, head_dim)


def kv_cache_shape(
    num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, ...]:
    """The whole cache's shape: [2 (K, V), layers, tokens, Hkv, D], the last dim a q8_0 head's
    bytes in a q8_0 (uint8) cache."""
    return (2, num_layers, *cache_shape(dtype, num_tokens, num_kv_heads, head_dim))


def available_memory(device: torch.device) -> int:
    """Free bytes on `device`: cudaMemGetInfo on GPU, MemAvailable on Linux hosts."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _CPU_DEFAULT_CAP


def state_rows_of(config) -> tuple[int, int]:
    """(state slots, snapshots) a hybrid model needs: one slot per schedulable sequence, and
    snapshots only with prefix caching."""
    snapshots = config.num_state_snapshots
    if snapshots is None:
        snapshots = config.max_num_seqs
    return config.max_num_seqs, snapshots if config.enable_prefix_caching else 0


def _cache_budget(config, device: torch.device, reserve_bytes: int = 0) -> int:
    """An explicit `kv_cache_memory` is the budget as it is; otherwise a fraction of what is
    free once `reserve_bytes` (activations the cache must leave room for) are set aside."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    free = max(available_memory(device) - reserve_bytes, 0)
    budget = int(free * config.kv_cache_memory_fraction)
    return min(budget, _CPU_DEFAULT_CAP) if device.type == "cpu" else budget


def plan_kv_cache(
    config,
    bytes_per_token: int,
    model_max_len: int,
    device: torch.device,
    state_bytes_per_slot: int = 0,
    reserve_bytes: int = 0,
) -> KVCachePlan:
    """Size the cache from `kv_cache_memory` or a fraction of free memory, never beyond what
    `max_num_seqs` sequences of `max_model_len` tokens can use. A hybrid model's state slots and
    snapshots come out of the same budget first; `reserve_bytes` (the vision tower's peak
    activations) are left free. Raises ValueError when what is left cannot hold one block."""
    block_bytes = bytes_per_token * config.block_size
    if config.max_model_len is not None and config.max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's context {model_max_len}"
        )
    slots, snapshots = state_rows_of(config) if state_bytes_per_slot else (0, 0)
    draft_rows = draft_state_rows(config) if state_bytes_per_slot else 0
    state_bytes = (slots + snapshots + draft_rows) * state_bytes_per_slot
    budget = _cache_budget(config, device, reserve_bytes) - state_bytes
    wanted_len = min(config.max_model_len or model_max_len, model_max_len)
    blocks_per_seq = -(-wanted_len // config.block_size)
    num_blocks = min(max(budget, 0) // block_bytes, blocks_per_seq * config.max_num_seqs)
    if num_blocks < 1:
        raise ValueError(
            f"cache budget {budget + state_bytes} B cannot hold one block of {config.block_size} "
            f"tokens ({block_bytes} B) after {state_bytes} B of recurrent state"
        )
    max_model_len = min(wanted_len, num_blocks * config.block_size)
    if config.max_model_len is not None and max_model_len < config.max_model_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} needs {blocks_per_seq} KV blocks but the cache "
            f"budget holds {num_blocks}; raise kv_cache_memory or lower max_model_len"
        )
    plan = KVCachePlan(
        num_blocks, config.block_size, bytes_per_token, max_model_len,
        slots, snapshots, state_bytes_per_slot, reserve_bytes, draft_rows,
    )  # fmt: skip
    logger.info(plan.describe())
    return plan
