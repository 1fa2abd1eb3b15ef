"""A tensor-parallel rank as its own program: `python -m axon.distributed.rank`, the way torchrun
starts its workers. multiprocessing's spawn would re-import the starting program's `__main__`
in every rank, which runs the whole of a script that lacks `if __name__ == "__main__":` (and
fails there); a rank program runs nothing of it.

The command line carries the rank, the rendezvous, the parent's pid, the fd of the rank's end
of its pipe and the function the rank runs (`module:qualname`, imported by name). The pipe is
an inherited socket pair wrapped as multiprocessing Connections, as `multiprocessing.Pipe`
makes it; its first message is the parent's `sys.path` and the function's other arguments,
pickled. The rank then calls `function(rank, rendezvous, conn, parent_pid, *args)`.

Rank 0 sees a rank exit through a sentinel: the read end of a pipe whose write end only the
rank holds, so it reads end-of-file once the rank is gone (multiprocessing's own sentinel).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import importlib
import os
import pickle
import signal
import site
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection

ENTRY_MODULE = "axon.distributed.rank"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when `parent_pid` dies: the kernel's parent-death signal where there
    is one, and a watcher thread (which also covers a parent that died before the prctl)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)  # the parent is gone: nobody can use what this process holds

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class RankProcess:
    """The starting process's handle on one rank program: the parts of multiprocessing.Process
    that rank 0 uses (pid, sentinel, join, exitcode, is_alive, kill)."""

    def __init__(self, popen: subprocess.Popen, sentinel: int):
        self.popen = popen
        self.sentinel = sentinel
        # Closed once nothing holds this handle: a watcher thread may still wait on it.
        weakref.finalize(self, os.close, sentinel)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        """The exit status (-N for signal N), None while it runs."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds (None: as long as it takes) for the rank to exit."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def kill(self) -> None:
        self.popen.kill()


def target_name(target: Callable | str) -> str:
    """`module:qualname` of `target`, which the rank program imports by that name. Raises
    ValueError for a function the rank cannot import (defined in `__main__` or locally)."""
    if isinstance(target, str):
        return target
    name = f"{target.__module__}:{target.__qualname__}"
    if target.__module__ == "__main__" or "<locals>" in target.__qualname__:
        raise ValueError(f"a rank runs a function it can import by name, not {name}")
    return name


def start_rank(
    target: Callable | str, rank: int, rendezvous: str | None, args: tuple = ()
) -> tuple[RankProcess, Connection]:
    """Start the rank program for `rank`, in this process's process group (a killpg of this
    process's group takes it), running `target(rank, rendezvous, conn, os.getpid(), *args)`.
    Returns its handle and this side of its pipe."""
    command = [sys.executable, "-m", ENTRY_MODULE, target_name(target)]
    command += ["--rank", str(rank), "--parent-pid", str(os.getpid())]
    ours, theirs = socket.socketpair()
    sentinel, held = os.pipe()
    command += ["--conn-fd", str(theirs.fileno())]
    if rendezvous is not None:
        command += ["--rendezvous", rendezvous]
    try:
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(), held),
            env=_rank_environment(),
        )
    except BaseException:
        ours.close()
        os.close(sentinel)
        raise
    finally:
        theirs.close()
        os.close(held)
    conn = Connection(ours.detach())
    # Plain pickle (rank 0's step payloads travel the same way); a rank that died before it
    # read this is reported by the caller's next receive, with its exit code.
    with contextlib.suppress(OSError):
        conn.send_bytes(pickle.dumps((sys.path, pickle.dumps(args)), pickle.HIGHEST_PROTOCOL))
    return RankProcess(popen, sentinel), conn


def _rank_environment() -> dict[str, str]:
    """This process's environment, with the directory this `axon` came from first on the
    rank's PYTHONPATH unless it is a site-packages directory (found there anyway): the rank
    program imports the same `axon` before it takes this process's sys.path."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    environ = dict(os.environ)
    if root in {*site.getsitepackages(), site.getusersitepackages()}:
        return environ
    path = environ.get("PYTHONPATH")
    environ["PYTHONPATH"] = os.pathsep.join([root, path] if path else [root])
    return environ


def run_rank(argv: list[str] | None = None) -> int:
    """The rank program's body (`python -m axon.distributed.rank`): tie this process to its
    parent, take the first message of its pipe, run the named function. Returns 0 when the
    function returns (it raises, or exits the process itself, otherwise)."""
    parser = argparse.ArgumentParser(prog=f"python -m {ENTRY_MODULE}")
    parser.add_argument("target", help="module:qualname of the function this rank runs")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--conn-fd", type=int, required=True)
    parser.add_argument("--rendezvous", default=None)
    ns = parser.parse_args(argv)
    die_with_parent(ns.parent_pid)
    conn = Connection(ns.conn_fd)
    try:
        path, payload = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return 1  # the parent went away before it sent the arguments
    sys.path[:] = path  # the parent's: what it pickled by name imports the same here
    args = pickle.loads(payload)
    target = _import_target(ns.target)
    target(ns.rank, ns.rendezvous, conn, ns.parent_pid, *args)
    return 0


def _import_target(name: str) -> Callable:
    module_name, _, qualname = name.partition(":")
    module = importlib.import_module(module_name)
    return functools.reduce(getattr, qualname.split("."), module)
