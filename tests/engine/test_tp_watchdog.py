"""Rank 0's step deadline and the rendezvous sweep, on real rank subprocesses (no model)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from axon.distributed.workers import RankFailed, TPWorkers, sweep_stale_stores


def _silent_rank(rank, store_path, conn, parent_pid):
    """A rank that takes its steps and never answers (a wedged forward)."""
    while True:
        conn.recv_bytes()
        time.sleep(0.01)


def test_a_rank_that_never_answers_misses_the_deadline():
    workers = TPWorkers.spawn(2, _silent_rank, (), step_timeout_s=0.5)
    try:
        workers.send_step(("tokens",))
        with pytest.raises(RankFailed, match="rank 1 missed its step deadline"):
            workers.collect()
    finally:
        workers.close(0.0)
    assert not os.path.exists(workers.store_dir)


def test_sweep_removes_only_the_stores_of_dead_engines(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"axon-tp-{dead.pid}-abc").mkdir()
    (tmp_path / f"axon-tp-{os.getpid()}-def").mkdir()
    (tmp_path / "axon-tp-other").mkdir()
    assert sweep_stale_stores(str(tmp_path)) == [f"axon-tp-{dead.pid}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"axon-tp-{os.getpid()}-def",
        "axon-tp-other",
    ]


def test_a_rank_runs_only_a_function_it_can_import():
    """A rank program imports its function by name: none from a script's `__main__`, none
    defined inside another function."""

    def local_rank(rank, store_path, conn, parent_pid):
        pass

    with pytest.raises(ValueError, match=r"import by name, not \S*test_tp_watchdog:.*local_rank"):
        TPWorkers.spawn(2, local_rank, (), step_timeout_s=0.5)
    local_rank.__module__ = "__main__"
    local_rank.__qualname__ = "local_rank"
    with pytest.raises(ValueError, match="import by name, not __main__:local_rank"):
        TPWorkers.spawn(2, local_rank, (), step_timeout_s=0.5)


def test_a_rank_that_fails_to_start_is_named_with_its_exit_code():
    workers = TPWorkers.spawn(2, "axon.distributed.no_such_module:main", (), step_timeout_s=5)
    try:
        with pytest.raises(RankFailed, match=r"rank 1 died \(exit code 1\)"):
            workers.expect("joining")
    finally:
        workers.close(0.0)
