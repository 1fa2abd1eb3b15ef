"""All-reduce and all-gather through shared memory for CPU ranks on one host (vLLM's CPU backend
does the same): a rank copies its tensor into its slot of one /dev/shm segment, raises its
sequence flag, waits for every other rank's flag, and sums the slots in rank order. No TCP, no
gloo ring: a small reduce is a few copies instead of a loopback round trip.

Layout of the segment (one per engine, made by rank 0 at group init):

    [0, 8 KiB)   control: a header (magic, world size, slot bytes, each rank's pid) and one
                 sequence flag per rank, each on its own 64-byte cache line
    then         2 buffers (by call parity) x world_size slots of `slot_bytes`

Why one barrier per call is enough: call `seq` writes buffer `seq % 2`, which call `seq - 2`
read. A rank reaches call `seq` only after every rank raised its flag to `seq - 1`, and a rank
raises that flag only after it finished reading call `seq - 2`: the slot is free to reuse. The
second barrier of a single-buffer design is the first barrier of the next call here.

The flag protocol relies on x86's store order (the data a rank writes is visible before the
flag it writes after it); torch's copy finishes its threads before the flag store.

Every wait has a deadline, and past a short spin it checks that the ranks it waits for are
alive: a dead or wedged rank is an error that names it, never a hang. The segment's name is
unlinked as soon as every rank has mapped it, so a SIGKILL of any rank leaks nothing.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_MAGIC = 0x4158_4F4E_5348_4D31  # "AXONSHM1"
_CONTROL_BYTES = 8192
_LINE = 64  # one flag per cache line: ranks spinning on their flags do not share a line
_PID_INDEX = 8  # header int64 index of rank 0's pid
_MAX_WORLD = _CONTROL_BYTES // 2 // _LINE  # flags fill the control area's second half
_SPIN_S = 0.001  # poll this long before yielding the core
_YIELD_S = 0.005  # then poll between sched_yields up to this, then sleep-poll
_LIVENESS_S = 0.05  # how often a sleeping wait checks that the ranks it waits on are alive


class ShmCollectiveError(RuntimeError):
    """A shared-memory collective could not complete (a rank died or missed the deadline).
    The text names the process group, so the engine treats it as a device fault."""


def host_id() -> str:
    """This host's identity: the hostname and this boot's id (two containers may share a
    hostname, never a boot id and a /dev/shm unless they share the kernel's tmpfs too)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def segment_bytes(world_size: int, slot_bytes: int) -> int:
    return _CONTROL_BYTES + 2 * world_size * slot_bytes


def round_slot(max_bytes: int) -> int:
    """Slot size for reduces of up to `max_bytes`: a multiple of a cache line."""
    return max(_LINE, (max_bytes + _LINE - 1) // _LINE * _LINE)


def create_segment(world_size: int, slot_bytes: int) -> str:
    """Rank 0: create, fully allocate (no SIGBUS later on a full tmpfs) and stamp a new
    segment; returns its path. Raises OSError when /dev/shm cannot hold it."""
    if not 1 < world_size <= _MAX_WORLD:
        raise OSError(f"world size {world_size} outside 2..{_MAX_WORLD}")
    path = os.path.join(SHM_DIR, f"axon-tp-{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(world_size, slot_bytes))
        header = np.array([_MAGIC, world_size, slot_bytes], dtype=np.int64)
        os.pwrite(fd, header.tobytes(), 0)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


class ShmCommunicator:
    """One rank's handle on the segment. Every rank must make the same calls in the same
    order with tensors of the same shape and dtype (as with any collective)."""

    def __init__(self, path: str, rank: int, world_size: int, timeout_s: float):
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        words = np.frombuffer(self._mm, dtype=np.int64, count=_CONTROL_BYTES // 8)
        if words[0] != _MAGIC or words[1] != world_size:
            self._mm.close()
            raise OSError(f"{path} is not this group's segment")
        self.path, self.rank, self.world_size = path, rank, world_size
        self.slot_bytes = int(words[2])
        self.timeout_s = timeout_s
        self._words = words
        words[_PID_INDEX + rank] = os.getpid()
        self._flag = [(_CONTROL_BYTES // 2 + r * _LINE) // 8 for r in range(world_size)]
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._seq = int(words[self._flag[rank]])
        self._views: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` can go through the segment (else the caller uses gloo)."""
        return x.device.type == "cpu" and x.is_contiguous() and x.nbytes <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place, adding in rank order (0 + 1 + 2 ...), so every rank
        holds bit-identical results; returns `x`."""
        flat = x.view(-1)
        slots = self._exchange(flat)  # [world, numel]
        torch.add(slots[0], slots[1], out=flat)
        for rank in range(2, self.world_size):
            flat.add_(slots[rank])
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order (a new tensor)."""
        slots = self._exchange(x.view(-1))
        return torch.cat([slots[r].view(x.shape) for r in range(self.world_size)], dim=dim)

    def _exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """Publish `flat` in this rank's slot and wait for every rank's; returns the slots of
        this call, [world, numel], valid until the call after next."""
        seq = self._seq + 1
        slots = self._slot_view(seq % 2, flat.dtype)[:, : flat.numel()]
        slots[self.rank].copy_(flat)
        self._words[self._flag[self.rank]] = seq
        self._wait_all(seq)
        self._seq = seq
        return slots

    def _slot_view(self, parity: int, dtype: torch.dtype) -> torch.Tensor:
        view = self._views.get((parity, dtype))
        if view is None:
            start = _CONTROL_BYTES + parity * self.world_size * self.slot_bytes
            region = self._bytes[start : start + self.world_size * self.slot_bytes]
            view = region.view(dtype).view(self.world_size, -1)  # [world, slot elements]
            self._views[(parity, dtype)] = view
        return view

    def _waiting_for(self, seq: int) -> list[int]:
        words = self._words
        return [r for r, index in enumerate(self._flag) if words[index] < seq]

    def _wait_all(self, seq: int) -> None:
        """Poll the flags for `_SPIN_S` (the ranks usually arrive within microseconds of each
        other), then poll between sched_yields up to `_YIELD_S`, then sleep-poll."""
        words, flags = self._words, self._flag
        start = time.monotonic()
        while True:
            for _ in range(64):
                if all(words[index] >= seq for index in flags):
                    return
            waited = time.monotonic() - start
            if waited > _YIELD_S:
                break
            if waited > _SPIN_S:
                os.sched_yield()
        self._wait_slow(seq, start)

    def _wait_slow(self, seq: int, start: float) -> None:
        """Sleep-poll until every flag reaches `seq`; raises ShmCollectiveError when a rank
        waited for is dead or the deadline passes."""
        deadline = start + self.timeout_s
        pause, next_check = 20e-6, 0.0
        while waiting := self._waiting_for(seq):
            now = time.monotonic()
            if now >= next_check:
                self._check_alive(waiting, seq)
                next_check = now + _LIVENESS_S
            if now >= deadline:
                raise ShmCollectiveError(
                    f"shared-memory all-reduce: ranks {waiting} missed the {self.timeout_s:g} s "
                    f"deadline (call {seq}); the process group is out of step"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _check_alive(self, ranks: list[int], seq: int) -> None:
        for rank in ranks:
            pid = int(self._words[_PID_INDEX + rank])
            if pid and not process_alive(pid):
                raise ShmCollectiveError(
                    f"shared-memory all-reduce: rank {rank} (pid {pid}) died (call {seq}); "
                    "the process group is broken"
                )

    def close(self) -> None:
        """Unmap the segment (after unlink its memory goes with the last rank's mapping)."""
        self._views.clear()
        self._bytes = self._words = None
        with contextlib.suppress(BufferError):  # a caller still holds a view: the GC unmaps
            self._mm.close()


def open_shared(store, rank: int, world_size: int, slot_bytes: int, timeout_s: float):
    """Collective over the group just joined through `store`: rank 0 makes the segment when
    every rank runs on this host (else, or when /dev/shm cannot hold it, nobody does), each rank
    maps it, and once all have (a gloo all-reduce) rank 0 unlinks its name. Returns this rank's
    ShmCommunicator, or None on every rank when any rank could not map it (gloo it is)."""
    store.set(f"axon_shm/host/{rank}", host_id())
    if rank == 0:
        path = _create_if_one_host(store, world_size, slot_bytes)
        store.set("axon_shm/path", path)
    else:
        path = store.get("axon_shm/path").decode()
    comm = None
    try:
        if path:
            comm = ShmCommunicator(path, rank, world_size, timeout_s)
    except OSError as exc:
        logger.warning("rank %d cannot map %s (%s): all-reduce stays on gloo", rank, path, exc)
    mapped = torch.tensor([int(comm is not None)], dtype=torch.int64)
    try:
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN)
    finally:
        if rank == 0 and path:  # every rank has mapped it (or failed): the name can go
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    if comm is not None and not int(mapped[0]):
        comm.close()
        comm = None
    return comm


def _create_if_one_host(store, world_size: int, slot_bytes: int) -> str:
    """Rank 0: the new segment's path, or "" for gloo (0 slot bytes: gloo was asked for)."""
    if slot_bytes <= 0:
        return ""
    hosts = {store.get(f"axon_shm/host/{rank}").decode() for rank in range(world_size)}
    if len(hosts) != 1:
        logger.info("tensor-parallel ranks span %d hosts: all-reduce over gloo", len(hosts))
        return ""
    try:
        return create_segment(world_size, slot_bytes)
    except OSError as exc:
        logger.warning("no shared-memory all-reduce (%s): all-reduce over gloo", exc)
        return ""


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
