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


def test_a_second_peer_gets_its_own_columns_and_ratios(bench):
    results = {
        "axon": {1: _level(50.0, 20.0, 25.0, 8.0)},
        "llama-server": {1: _level(40.0, 25.0, 30.0, 10.0)},
        "ik_llama.cpp": {1: _level(25.0, 10.0, 30.0, 16.0)},
    }
    table = bench.format_table("m.gguf", results, [1])
    peers = "llama-server | ik_llama.cpp"
    assert f"| metric | c | axon | {peers} | axon / llama-server | axon / ik_llama.cpp |" in table
    assert "| output tok/s | 1 | 50.0 | 40.0 | 25.0 | 1.25x | 2.00x |" in table
    assert "| ITL p50 ms | 1 | 8.0 | 10.0 | 16.0 | 0.80x | 0.50x |" in table


def test_ik_llama_server_repacks_and_leaves_flash_attention_off_with_slots(bench):
    import ik_llama

    command = ik_llama.server_command(Path("/b/llama-server"), Path("m.gguf"), 9, 512, 16, 2)
    assert command[command.index("-c") + 1] == "8192" and "-rtr" in command
    assert "--log-disable" in command  # no llama.log in the working directory
    assert "-no-fa" in command
    assert "-no-fa" not in ik_llama.server_command(Path("/b/s"), Path("m.gguf"), 9, 512, 1, 2)


def test_ik_build_info_is_written_from_its_template(bench, tmp_path):
    import ik_llama

    (tmp_path / "common").mkdir()
    template = (
        'int LLAMA_BUILD_NUMBER = @BUILD_NUMBER@;\\nchar const *LLAMA_COMMIT = "@BUILD_COMMIT@";\\n'
    )
    (tmp_path / "common" / "build-info.cpp.in").write_text(template)
    ik_llama.write_build_info(tmp_path, "0.1.5")
    written = (tmp_path / "common" / "build-info.cpp").read_text()
    assert "LLAMA_BUILD_NUMBER = 0;" in written and "ik-llama-cpp-python-0.1.5" in written
    assert "@" not in written
