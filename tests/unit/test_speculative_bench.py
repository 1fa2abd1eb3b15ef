"""The pure logic of benchmarks/speculative.py: its prompts, its variants' flags, its table's
figures and ratios, issue 33's targets (nothing is built or started)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def modules():
    sys.path.insert(0, str(BENCH))
    try:
        yield {
            name: importlib.import_module(name) for name in ("speculative", "speculative_report")
        }
    finally:
        sys.path.remove(str(BENCH))


def _level(tpot_ms: float, tok_s: float, drafted: int = 0, accepted: int = 0) -> dict:
    return {
        "median_tpot_ms": tpot_ms,
        "output_throughput": tok_s,
        "total_draft_tokens": drafted,
        "total_accepted_tokens": accepted,
    }


RESULT = {
    "model": "/m/SmolLM2.gguf",
    "speculative": ["axon ngram", "llama-server ngram-simple", "llama-server ngram-mod"],
    "notes": ["llama-server draft-simple left out: another vocabulary"],
    "best": {
        "axon": {"edit": {1: _level(10.0, 90.0), 16: _level(40.0, 300.0)}},
        "axon ngram": {"edit": {1: _level(4.0, 200.0, 100, 80), 16: _level(40.0, 297.0)}},
        "llama-server": {"edit": {1: _level(12.5, 70.0), 16: _level(80.0, 150.0)}},
        "llama-server ngram-simple": {"edit": {1: _level(6.25, 120.0, 50, 20)}},
        "llama-server ngram-mod": {"edit": {1: _level(5.0, 150.0, 90, 60)}},
    },
}


def test_prompts_are_distinct_per_workload_and_seeded(modules):
    from speculative_prompts import WORKLOADS, workload_prompts

    for workload in WORKLOADS:
        chat = workload_prompts(workload, 32, chat=True, seed=1)
        assert len(set(chat)) == 32 and chat == workload_prompts(workload, 32, True, seed=1)
        assert workload_prompts(workload, 32, chat=False, seed=1) != chat  # base-model framing
    edit = workload_prompts("edit", 1, chat=True, seed=0)[0]
    assert "```python" in edit and "Rename" in edit


def test_variants_flags(modules):
    speculative = modules["speculative"]
    args = speculative.parse_args(["--k", "5", "--llama-spec-types", "ngram-mod"])
    axon = {v.name: v for v in speculative.axon_variants(args, None)}
    assert axon["axon"].flags == () and not axon["axon"].speculative
    flag, value = axon["axon ngram"].flags
    assert flag == "--speculative-config"
    assert json.loads(value) == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    llama, notes = speculative.llama_variants(args, Path("m.gguf"), None)
    assert [v.name for v in llama] == ["llama-server", "llama-server ngram-mod"] and not notes
    assert llama[1].flags == ("--spec-type", "ngram-mod")
    with_draft = {v.name: v for v in speculative.axon_variants(args, Path("d.gguf"))}
    config = json.loads(with_draft["axon draft"].flags[1])
    assert config == {"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 5}


def test_table_figures_and_ratios(modules):
    table = modules["speculative_report"].format_table(RESULT, [1, 16], "cpu, 2 threads")
    # 1 stream: decode tok/s per stream (1000 / TPOT p50); the axon row against axon, and
    # against the fastest llama-server speculative row (ngram-mod, 200 tok/s)
    assert (
        "| edit | 1 | axon ngram | 250.0 | 200.0 | 80.0% (80/100) | 2.50x "
        "| 1.25x (llama-server ngram-mod) |" in table
    )
    assert (
        "| edit | 1 | llama-server ngram-simple | 160.0 | 120.0 | 40.0% (20/50) | 1.60x | - |"
        in table
    )
    # 16 streams: output tok/s of all streams
    assert "| edit | 16 | axon ngram | 25.0 | 297.0 | - | 0.99x | - |" in table
    assert "- llama-server draft-simple left out: another vocabulary" in table


def test_targets(modules):
    report = modules["speculative_report"]
    rows = {name: (round(ratio, 3), met) for name, ratio, _, met in report.evaluate_targets(RESULT)}
    assert rows == {
        "axon ngram edit c1 >= 2.0x axon": (2.5, True),
        "axon ngram edit c1 >= 1.3x llama-server speculative": (1.25, False),
        "axon ngram edit c16 >= 0.95x axon": (0.99, True),
    }
    assert "| axon ngram edit c1 >= 1.3x llama-server speculative | 1.25x | MISS |" in (
        report.summarize_targets(RESULT)
    )


def test_quick_is_one_short_level(modules):
    args = modules["speculative"].parse_args(["--quick"])
    assert isinstance(args, argparse.Namespace)
    assert (args.concurrency, args.repeats, args.max_tokens) == ([1], 1, 24)
