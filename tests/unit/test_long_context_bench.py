"""The pure logic of benchmarks/long_context.py: which steps count as all streams decoding, the
lengths a file's trained context keeps, the peers' cache flags, the table's ratios (nothing is
built or started)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("long_context")
    finally:
        sys.path.remove(str(BENCH))


def test_only_the_steps_after_every_first_token_count(bench):
    # stream a decodes from 1.0 s while b still prefills until 3.0 s
    a = SimpleNamespace(ttft=1.0, itl=[0.5, 0.5, 0.5, 0.5, 0.5, 0.5])  # 1.5 ... 4.0
    b = SimpleNamespace(ttft=3.0, itl=[0.25, 0.25])  # 3.25, 3.5
    assert bench.arrivals(a.ttft, a.itl) == [1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
    assert bench.all_decoding_itls([a, b]) == [0.5, 0.5, 0.25, 0.25]


def test_lengths_past_the_trained_context_are_left_out_with_a_note(bench):
    kept, notes = bench.usable_lengths([4096, 16384, 32768], 8192)
    assert kept == [4096]
    assert len(notes) == 2 and "16384" in notes[0] and "8192" in notes[0]
    assert bench.usable_lengths([4096], None) == ([4096], [])


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_peers_run_the_same_cache_type(bench, cache):
    args = argparse.Namespace(ctx_per_slot=4200, streams=4, threads=2, cache_type=cache)
    for peer in bench.PEERS:
        command = bench.peer_command(peer, Path("/bin/x"), Path("m.gguf"), 8080, args)
        if cache == "f16":
            assert "-ctk" not in command
            continue
        assert command[command.index("-ctk") + 1] == "q8_0"
        assert command[command.index("-ctv") + 1] == "q8_0"
        assert "-no-fa" not in command and "-fa" in command


def test_table_marks_the_rows_that_reach_the_target(bench):
    rows = {"prefill 4096": {"axon": 300.0, "llama-server": 200.0, "ik_llama.cpp": 280.0}}
    table = bench.format_table(rows, ["axon", "llama-server", "ik_llama.cpp"])
    assert "**1.50x**" in table and "| 1.07x |" in table
