"""Tensor-parallel group state. With no group initialised everything is rank 0 of 1.

CPU ranks on one host all-reduce (and all-gather) through a shared-memory segment
(`shm_allreduce`); gloo carries what does not fit it, ranks on several hosts, and everything
when the `tp_allreduce` setting (`AXON_TP_ALLREDUCE`) is gloo. CUDA ranks use NCCL."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from axon.distributed.shm_allreduce import ShmCommunicator, open_shared, round_slot
from axon.settings import SETTINGS

ALLREDUCE_ENV = SETTINGS["tp_allreduce"].env
DEFAULT_REDUCE_BYTES = 8 << 20  # 2,048 tokens x 1,024 hidden x fp32
MAX_REDUCE_BYTES = 64 << 20  # per slot; larger reduces (long prefill chunks) go over gloo

# Idle ranks on other hosts wait in a broadcast on the control group: its timeout is not a
# step deadline (rank 0's deadline and the TP group's timeout are).
CONTROL_TIMEOUT = timedelta(days=365)

_TP_GROUP: dist.ProcessGroup | None = None
_SHM: ShmCommunicator | None = None
_CONTROL: dist.ProcessGroup | None = None


def allreduce_backend(environ=os.environ) -> str:
    """`AXON_TP_ALLREDUCE` (the `tp_allreduce` engine setting): "shm" (the default: shared memory
    when every rank is a CPU rank on this host) or "gloo". Raises ValueError naming it."""
    return SETTINGS["tp_allreduce"].from_env(environ)


def set_tp_group(group: dist.ProcessGroup | None) -> None:
    global _TP_GROUP
    _TP_GROUP = group


@contextmanager
def single_rank() -> Iterator[None]:
    """Within it this process is rank 0 of 1, whatever group it holds: a single-rank model
    built in a process that also runs a tensor-parallel one (tests, the offline API) must
    allocate whole weights. Layers keep the size they were built with."""
    global _TP_GROUP
    saved, _TP_GROUP = _TP_GROUP, None
    try:
        yield
    finally:
        _TP_GROUP = saved


def init_tp_group(
    store_path: str,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
    max_reduce_bytes: int = DEFAULT_REDUCE_BYTES,
    control_ranks: list[int] | None = None,
    allreduce: str | None = None,
) -> None:
    """Join the tensor-parallel group through the rendezvous `store_path` and make it the TP
    group: a file store (private to one engine, so two engines on a host never meet) or, for
    ranks on several hosts, `tcp://host:port` (torch's TCP store, hosted by rank 0). Blocks
    until every rank has joined; `timeout_s` bounds that wait and every collective after it.
    CPU ranks also map the shared-memory segment, sized by rank 0's `max_reduce_bytes` (the
    largest reduce: hidden size x max batched tokens x dtype size). `control_ranks` (rank 0
    and the ranks on other hosts) also makes the gloo group their step input travels on.
    `allreduce`: rank 0's `tp_allreduce` setting (None: read from the environment)."""
    global _SHM, _CONTROL
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = open_store(store_path, rank, world_size, timeout_s)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    set_tp_group(dist.group.WORLD)
    if device.type == "cpu" and world_size > 1:
        # Every CPU rank takes part; rank 0's setting decides (0 bytes: no segment, gloo).
        wanted = rank != 0 or (allreduce or allreduce_backend()) == "shm"
        slot_bytes = round_slot(min(max_reduce_bytes, MAX_REDUCE_BYTES)) if wanted else 0
        _SHM = open_shared(store, rank, world_size, slot_bytes, timeout_s)
    if control_ranks is not None:  # every rank makes it (new_group is collective)
        _CONTROL = dist.new_group(control_ranks, timeout=CONTROL_TIMEOUT, backend="gloo")


def open_store(rendezvous: str, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The store behind `rendezvous`: `tcp://host:port` (rank 0 listens, the others connect,
    retrying until `timeout_s`), else a file store at that path."""
    if not rendezvous.startswith("tcp://"):
        return dist.FileStore(rendezvous, world_size)
    host, _, port = rendezvous.removeprefix("tcp://").rpartition(":")
    return dist.TCPStore(
        host,
        int(port),
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def control_group() -> dist.ProcessGroup | None:
    """The group that carries step input to ranks on other hosts (None on one host)."""
    return _CONTROL


def tp_allreduce_path() -> str:
    """Which all-reduce this process's group uses: "shm", "gloo", "nccl" or "none"."""
    if _TP_GROUP is None:
        return "none"
    return "shm" if _SHM is not None else dist.get_backend(_TP_GROUP)


def destroy_tp_group() -> None:
    """Leave the group (no collective): after it this process is rank 0 of 1 again."""
    global _SHM, _CONTROL
    set_tp_group(None)
    _CONTROL = None
    if _SHM is not None:
        _SHM.close()
        _SHM = None
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_rank() -> int:
    return dist.get_rank(_TP_GROUP) if _TP_GROUP is not None else 0


def get_tp_size() -> int:
    return dist.get_world_size(_TP_GROUP) if _TP_GROUP is not None else 1


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks (in place); a no-op with one rank."""
    if _TP_GROUP is None or get_tp_size() == 1:
        return x
    if _SHM is not None and _SHM.fits(x):
        return _SHM.all_reduce(x)
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_reduce_min(values: list[int]) -> list[int]:
    """The element-wise minimum of `values` over the ranks (what every rank can hold)."""
    if _TP_GROUP is None or get_tp_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend(_TP_GROUP) == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_TP_GROUP)
    return [int(v) for v in tensor.tolist()]


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim`; returns `x` itself with one rank."""
    if _TP_GROUP is None or get_tp_size() == 1:
        return x
    if _SHM is not None and _SHM.fits(x):
        return _SHM.all_gather(x, dim=dim)
    parts = [torch.empty_like(x) for _ in range(get_tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
