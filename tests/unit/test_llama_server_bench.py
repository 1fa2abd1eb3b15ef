"""The pure logic of benchmarks/serve_vs_llama_server.py and benchmarks/llama_server.py: best-of
selection, issue 16's targets, prompts and the llama-server command line (nothing is built or
started)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("serve_vs_llama_server")
    finally:
        sys.path.remove(str(BENCH))


def _level(tok_s: float, ttft_p50: float, ttft_p99: float, itl_p50: float) -> dict:
    return {
        "output_throughput": tok_s,
        "median_ttft_ms": ttft_p50,
        "p99_ttft_ms": ttft_p99,
        "median_itl_ms": itl_p50,
    }


def test_best_of_takes_highest_throughput_and_lowest_latency(bench):
    runs = [_level(100.0, 30.0, 50.0, 9.0), _level(120.0, 35.0, 40.0, 10.0)]
    best = bench.best_of(runs + [{"output_throughput": 90.0, "median_itl_ms": None}])
    assert best == _level(120.0, 30.0, 40.0, 9.0)


def test_targets_pass_and_miss(bench):
    results = {
        "axon": {1: _level(50.0, 20.0, 25.0, 8.0), 16: _level(300.0, 90.0, 45.0, 20.0)},
        "llama-server": {1: _level(40.0, 25.0, 30.0, 10.0), 16: _level(160.0, 80.0, 120.0, 30.0)},
    }
    rows = {name: (value, met) for name, value, _, met in bench.evaluate_targets(results)}
    assert rows["c16 output tok/s >= 2.0x llama-server"] == (300.0 / 160.0, False)
    assert rows["c1 TTFT p50 <= 1.0x llama-server"] == (0.8, True)
    assert rows["c1 ITL p50 <= 0.9x llama-server"] == (0.8, True)
    # axon's own TTFT p99 at 16 (45) against its TTFT p50 at 1 (20): 2.25x, over 2x
    assert rows["c16 TTFT p99 <= 2x axon's c1 TTFT p50"] == (2.25, False)
    table = bench.format_table("m.gguf", results, [1, 16])
    assert "| output tok/s | 16 | 300.0 | 160.0 | 1.88x |" in table
    assert "| c1 ITL p50 <= 0.9x llama-server | 0.80x | 0.9x | pass |" in table


def test_random_token_prompts_distinct_in_range_and_seeded(bench):
    prompts = bench.random_token_prompts(8, 32, (3, 1000), seed=5)
    assert len({tuple(p) for p in prompts}) == 8
    assert all(len(p) == 32 and min(p) >= 3 and max(p) < 1000 for p in prompts)
    assert prompts == bench.random_token_prompts(8, 32, (3, 1000), seed=5)
    assert prompts != bench.random_token_prompts(8, 32, (3, 1000), seed=6)


def test_llama_server_context_is_split_across_slots(bench):
    import llama_server

    command = llama_server.server_command(Path("/b/llama-server"), Path("m.gguf"), 9, 512, 16, 2)
    # -c is the total: 16 slots of 512 tokens, the 8192 tokens axon's KV cache holds
    assert command[command.index("-c") + 1] == "8192"
    assert command[command.index("-np") + 1] == "16"
    assert command[command.index("-t") + 1] == command[command.index("-tb") + 1] == "2"


def test_requests_per_level(bench):
    assert [bench.requests_at(level) for level in (1, 4, 16)] == [6, 8, 32]
    assert [bench.requests_at(level, 1, 3) for level in (1, 4, 16)] == [3, 4, 16]
