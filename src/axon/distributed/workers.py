"""Tensor-parallel ranks 1..N-1: rank programs (see rank_process) started by the engine process
(rank 0), one pipe each.

The protocol follows neuron's worker pool: rank 0 fans a message out to every rank, does its
own part, then drains exactly one reply from every rank, so the pipes never fall out of step.
Each step's input travels pickled with plain `pickle` (the tensors' bytes inline, a few KB):
multiprocessing's own pickler would move CPU tensors through shared-memory files instead.

Rank -> rank 0 messages: ("joining",) | ("loaded",) | ("load_failed", text) | ("ok",)
                         | ("error", text) | ("bye",)
Rank 0 -> rank:          pickled ("step", StepBatch) | ("shutdown",) | ("wedge",)

Ranks on other hosts (`multinode`) take the same messages from a broadcast on the control group
instead of a pipe, and send no replies.

Rank 0 waits for the step replies under a deadline (`AXON_TP_STEP_TIMEOUT_S`, which also bounds
every collective): a rank that never answers fails the step as a process-group fault, which
poisons the model (the registry kills the engine's process group and starts it again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing.connection
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from axon.distributed import multinode
from axon.distributed.rank_process import start_rank
from axon.settings import SETTINGS

logger = logging.getLogger(__name__)

STEP_TIMEOUT_ENV = SETTINGS["tp_step_timeout_s"].env
STORE_PREFIX = "axon-tp-"


def move_tensors(value, device: torch.device):
    """`value` with every tensor inside it (dataclass fields, lists, tuples, dicts) on `device`."""
    if torch.is_tensor(value):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: move_tensors(getattr(value, f.name), device)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, list | tuple):
        return type(value)(move_tensors(item, device) for item in value)
    if isinstance(value, dict):
        return {key: move_tensors(item, device) for key, item in value.items()}
    return value


class RankFailed(RuntimeError):
    """A tensor-parallel rank failed or died; its text names the process group, which makes the
    engine treat it as a device fault (the group is out of step)."""


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: spawn, load handshake, per-step fan-out, shutdown."""

    def __init__(
        self,
        processes: list,
        conns: list,
        store_dir: str,
        step_timeout_s: float,
        store_path: str | None = None,
    ):
        self.processes = processes
        self.conns = conns
        self.store_dir = store_dir
        self.store_path = store_path or os.path.join(store_dir, "store")
        self.control = None  # the broadcast group of the ranks on other hosts (none: one host)
        self.step_timeout_s = step_timeout_s
        self.closing = False  # set by close: the ranks' exits are expected from then on
        self.wedge_rank: int | None = None  # debug hook: this rank blocks in the next step
        self.images_sent: set[int] = set()  # requests whose pixels the ranks hold the output of

    @classmethod
    def spawn(
        cls,
        world_size: int,
        target: Callable | str,
        args: tuple,
        step_timeout_s: float,
        rendezvous: str | None = None,
    ) -> TPWorkers:
        """Start ranks 1..world_size-1, each a rank program running
        `target(rank, store_path, conn, parent_pid, *args)` (`target`: a function the ranks
        import by name, or its `module:qualname`), in this process's process group (a killpg
        of the engine takes them all). The rendezvous is a file store in a fresh private
        directory named by this pid: unique per engine, no port to collide on, and swept by
        the next start on the host once this process is gone; or `rendezvous`
        (`tcp://host:port`, for ranks on several hosts)."""
        sweep_stale_stores()
        store_dir = tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")
        store_path = rendezvous or os.path.join(store_dir, "store")
        workers = cls([], [], store_dir, step_timeout_s, store_path)
        try:
            for rank in range(1, world_size):
                process, conn = start_rank(target, rank, store_path, args)
                workers.processes.append(process)
                workers.conns.append(conn)
        except BaseException:
            workers.close(0.0)
            raise
        return workers

    def watch(self, on_death: Callable[[int, int | None], None]) -> None:
        """Call `on_death(rank, exit code)` from a watcher thread when a rank exits before
        `close` asks it to: idle ranks wait on their pipe, so no collective would notice.
        Ranks on other hosts are not watched: the next step's collectives notice them."""
        if not self.processes:
            return

        def run() -> None:
            sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, 1)}
            ready = multiprocessing.connection.wait(list(sentinels))
            if not self.closing:
                rank = sentinels[ready[0]]
                process = self.processes[rank - 1]
                process.join(1)
                on_death(rank, process.exitcode)

        threading.Thread(target=run, name="tp-rank-watch", daemon=True).start()

    @property
    def world_size(self) -> int:
        return len(self.processes) + 1

    def expect(self, kind: str) -> list[tuple]:
        """Wait for message `kind` from every rank; returns them in rank order. Raises
        RankFailed naming the rank when one reports a failure instead or dies."""
        messages = []
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            message = self._receive(rank, process, conn)
            if message[0] != kind:
                detail = message[1] if len(message) > 1 else message[0]
                raise RankFailed(f"tensor-parallel rank {rank}: {detail}")
            messages.append(message)
        return messages

    def _receive(self, rank: int, process, conn, deadline: float | None = None) -> tuple:
        """Rank `rank`'s next message; raises RankFailed when it dies or `deadline` (monotonic)
        passes first."""
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait([conn, process.sentinel], timeout)
            if not ready:
                raise RankFailed(
                    f"tensor-parallel rank {rank} missed its step deadline "
                    f"({STEP_TIMEOUT_ENV}={self.step_timeout_s:g}s); its process group is wedged"
                )
            if conn in ready:
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    pass
            process.join(1)
            raise RankFailed(
                f"tensor-parallel rank {rank} died (exit code {process.exitcode}); "
                "its process group is broken"
            )

    def send_step(self, batch) -> None:
        """Fan this step's input out to every rank (each runs the same forward)."""
        payload = pickle.dumps(("step", batch), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if rank == self.wedge_rank:
                    self.wedge_rank = None
                    conn.send_bytes(pickle.dumps(("wedge",)))
                conn.send_bytes(payload)
            except OSError as exc:
                raise RankFailed(f"tensor-parallel rank {rank} is gone: {exc}") from exc
        if self.control is not None:
            try:
                multinode.send_bytes(payload, self.control, self.step_timeout_s)
            except RuntimeError as exc:
                raise RankFailed(
                    f"tensor-parallel ranks on other hosts did not take the step: {exc}; "
                    "the process group is broken"
                ) from exc

    def ask(self, kind: str, *args) -> list:
        """Send (kind, *args) to every rank on this host, between steps; their answers in rank
        order (each replies (kind, answer)); RankFailed when one fails, dies or is late as a step
        would be."""
        payload = pickle.dumps((kind, *args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(payload)
            except OSError as exc:
                raise RankFailed(f"tensor-parallel rank {rank} is gone: {exc}") from exc
        answers, deadline = [], time.monotonic() + self.step_timeout_s
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            message = self._receive(rank, process, conn, deadline)
            if message[0] != kind:
                raise RankFailed(f"tensor-parallel rank {rank}: {message[-1]}")
            answers.append(message[1])
        return answers

    def collect(self) -> None:
        """Drain one step reply from every rank; raises RankFailed with every rank's error, or
        when a rank has not answered within the step deadline."""
        errors, deadline = [], time.monotonic() + self.step_timeout_s
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            message = self._receive(rank, process, conn, deadline)
            if message[0] != "ok":
                errors.append(f"rank {rank}: {message[-1]}")
        if errors:
            raise RankFailed(f"tensor-parallel step failed in the process group: {errors}")

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask every rank to exit, wait `timeout_s`, kill what is left, remove the store."""
        self.closing = True
        payload = pickle.dumps(("shutdown",))
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(payload)
        if self.control is not None:  # best effort: a remote rank that is gone exits anyway
            with contextlib.suppress(RuntimeError):
                multinode.send_bytes(payload, self.control, timeout_s)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(1)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)


def sweep_stale_stores(root: str | None = None) -> list[str]:
    """Remove the rendezvous directories of engines that are gone (killed, so never closed):
    `axon-tp-<pid>-*` under `root` (the temp dir) whose pid is not running. Returns them."""
    root = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name.removeprefix(STORE_PREFIX).split("-", 1)[0]
            if not name.startswith(STORE_PREFIX) or not pid.isdigit() or _alive(int(pid)):
                continue
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
