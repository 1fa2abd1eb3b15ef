"""Freed heap memory goes back to the system after a load (see axon/runner/heap.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
from axon.runner.heap import release_freed_heap

def anon_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) >> 10 for l in f if l.startswith("RssAnon"))

start = anon_mib()
chunks = [bytearray(4000) for _ in range(50_000)]  # ~200 MiB of small malloc chunks
keep = bytearray(4000)  # allocated last: the heap's top cannot shrink past it on free()
del chunks
before = anon_mib()
print(before - start, release_freed_heap(), before - anon_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_memory_freed_under_a_live_chunk_is_returned():
    """Freed chunks below a live one stay resident (free() trims only the heap's top) until
    release_freed_heap hands their pages back."""
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    retained, released, returned = done.stdout.split()
    assert int(retained) > 150  # what this test is about: free() alone kept it
    assert released == "True"
    assert int(returned) > 150


KEEP = """
from axon.runner.heap import keep_freed_heap, release_freed_heap

def anon_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) >> 10 for l in f if l.startswith("RssAnon"))

print(keep_freed_heap())
start = anon_mib()
step = bytearray(64 << 20)  # a prefill step's activations: mapped afresh each time by default
del step
kept = anon_mib() - start
again = bytearray(64 << 20)  # the next step's come from what the last one freed
reused = anon_mib() - start
del again
print(kept, reused, release_freed_heap(), anon_mib() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_a_steps_freed_activations_stay_in_the_heap_until_trimmed():
    """keep_freed_heap: a 64 MiB buffer, freed, stays resident and serves the next one (glibc
    would otherwise unmap it on free and fault it in again), until release_freed_heap."""
    done = subprocess.run([sys.executable, "-c", KEEP], capture_output=True, text=True, check=True)
    kept_set, kept, reused, released, after = done.stdout.split()
    assert kept_set == "True"
    assert int(kept) >= 60 and int(reused) < int(kept) + 8  # the same pages, no second 64 MiB
    assert released == "True" and int(after) < 16


class _IdleCore:
    def has_unfinished(self) -> bool:
        return False


class _QuietPipe:
    """Nothing ever arrives; stops the loop after `polls` heartbeats."""

    def __init__(self, loop_ref: list, polls: int):
        self.loop_ref, self.polls = loop_ref, polls

    def poll(self, timeout: float) -> bool:
        self.polls -= 1
        if self.polls <= 0:
            self.loop_ref[0].running = False
        return False

    def send_bytes(self, data: bytes) -> None:
        pass

    def send(self, message) -> None:
        pass


def test_the_engine_trims_the_heap_once_it_has_been_idle(monkeypatch):
    """After stepping, a heartbeat with nothing to do hands the kept heap back, once."""
    from axon.engine import engine_proc

    trims = []
    monkeypatch.setattr(engine_proc, "release_freed_heap", lambda: trims.append(1))
    ref: list = [None]
    loop = engine_proc.EngineLoop(_IdleCore(), _QuietPipe(ref, polls=5), heartbeat_s=0.001)
    ref[0] = loop
    loop.run()
    assert trims == []  # never stepped: nothing kept
    loop.running, loop.heap_in_use, loop.conn = True, True, _QuietPipe(ref, polls=5)
    loop.run()
    assert trims == [1]  # stepped, then idle: trimmed once, not every heartbeat
