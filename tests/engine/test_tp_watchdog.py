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
