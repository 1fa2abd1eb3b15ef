"""Tensor-parallel group state. With no group initialised everything is rank 0 of 1."""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None


def set_tp_group(group: dist.ProcessGroup | None) -> None:
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_rank() -> int:
    return dist.get_rank(_TP_GROUP) if _TP_GROUP is not None else 0


def get_tp_size() -> int:
    return dist.get_world_size(_TP_GROUP) if _TP_GROUP is not None else 1


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks (in place); a no-op with one rank."""
    if _TP_GROUP is None or get_tp_size() == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`; returns `x` itself with one rank."""
    if _TP_GROUP is None or get_tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(get_tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
