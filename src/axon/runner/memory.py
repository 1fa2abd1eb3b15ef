"""The KV-cache memory plan: how many blocks fit the budget, and what each token costs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_CPU_DEFAULT_CAP = 4 << 30  # a CPU default that leaves the host usable


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} "
            f"tokens, {self.bytes_per_token} B/token, {self.total_bytes / 2**20:.1f} MiB; "
            f"max_model_len {self.max_model_len}"
        )


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


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


def plan_kv_cache(
    config, bytes_per_token: int, model_max_len: int, device: torch.device
) -> KVCachePlan:
    """Size the cache from `kv_cache_memory` or a fraction of free memory, never beyond what
    `max_num_seqs` sequences of `max_model_len` tokens can use. Raises ValueError when the
    budget cannot hold one block."""
    block_bytes = bytes_per_token * config.block_size
    if config.max_model_len is not None and config.max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's context {model_max_len}"
        )
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    else:
        budget = int(available_memory(device) * config.kv_cache_memory_fraction)
        if device.type == "cpu":
            budget = min(budget, _CPU_DEFAULT_CAP)
    wanted_len = min(config.max_model_len or model_max_len, model_max_len)
    blocks_per_seq = -(-wanted_len // config.block_size)
    num_blocks = min(budget // block_bytes, blocks_per_seq * config.max_num_seqs)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory {budget} B cannot hold one block of {config.block_size} tokens "
            f"({block_bytes} B)"
        )
    max_model_len = min(wanted_len, num_blocks * config.block_size)
    if config.max_model_len is not None and max_model_len < config.max_model_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} needs {blocks_per_seq} KV blocks but the cache "
            f"budget holds {num_blocks}; raise kv_cache_memory or lower max_model_len"
        )
    plan = KVCachePlan(num_blocks, config.block_size, bytes_per_token, max_model_len)
    logger.info(plan.describe())
    return plan
