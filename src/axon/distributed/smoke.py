"""`axon tp-smoke`: neuron's NcclInit + NcclSanity on their own. Spawn the ranks exactly as an
engine does, join one group, all-reduce ones (every rank must observe the world size), shut
down. Proves the backend, the rendezvous and the devices before a model is loaded on them."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from axon.distributed.parallel_state import destroy_tp_group, init_tp_group
from axon.distributed.workers import RankFailed, TPWorkers

logger = logging.getLogger(__name__)


def smoke_devices(tp_size: int, devices: list[int] | None, device: str) -> list[torch.device]:
    """One device per rank: `devices` (CUDA indices), else cuda:0..N-1 with CUDA (device auto
    or cuda), else the CPU for every rank. Raises ValueError for a list of the wrong length
    or GPUs this host does not have."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if devices and not use_cuda:
        raise ValueError("--devices names GPUs; this run is on the CPU (no CUDA)")
    if not use_cuda:
        return [torch.device("cpu")] * tp_size
    devices = list(devices) if devices else list(range(tp_size))
    if len(devices) != tp_size:
        raise ValueError(f"devices lists {len(devices)} GPUs for tp_size {tp_size}")
    count = torch.cuda.device_count()
    missing = [index for index in devices if not 0 <= index < count]
    if missing:
        raise ValueError(f"devices {missing} not found: this host has {count} GPUs")
    return [torch.device("cuda", index) for index in devices]


def observed_sum(device: torch.device) -> float:
    """All-reduce (sum) a tensor of ones over the group; returns what this rank observes."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ones = torch.ones(8, dtype=torch.float32, device=device)
    dist.all_reduce(ones)
    if not bool((ones == ones[0]).all()):
        raise RuntimeError(f"ranks disagree within one all-reduce: {ones.tolist()}")
    return float(ones[0])


def _rank_main(rank: int, store_path: str, conn, parent_pid: int, devices, timeout_s: float):
    try:
        conn.send(("joining",))
        init_tp_group(store_path, rank, len(devices), devices[rank], timeout_s)
        conn.send(("sanity", observed_sum(devices[rank])))
        conn.recv_bytes()  # shutdown
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the smoke test
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
    os._exit(0)  # no group teardown: the other ranks are exiting too


def run_smoke(tp_size: int, devices: list[torch.device], timeout_s: float = 60.0) -> None:
    """Spawn ranks 1..N-1, all-reduce ones with them, stop them. Raises RankFailed (or the
    backend's error) naming what failed; returns when every rank observed `tp_size`."""
    if tp_size < 2:
        observed = [float(tp_size)]
    else:
        workers = TPWorkers.spawn(tp_size, _rank_main, (devices, timeout_s), timeout_s)
        try:
            workers.expect("joining")
            init_tp_group(workers.store_path, 0, tp_size, devices[0], timeout_s)
            observed = [observed_sum(devices[0])]
            observed += [message[1] for message in workers.expect("sanity")]
        finally:
            workers.close()
            destroy_tp_group()
    wrong = {rank: value for rank, value in enumerate(observed) if value != tp_size}
    if wrong:
        raise RankFailed(f"all-reduce of ones: expected {tp_size} on every rank, got {wrong}")
