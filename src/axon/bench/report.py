"""The benchmark's terminal output: vLLM's result block per level, a Markdown table at the end."""

from __future__ import annotations

import math
from collections.abc import Sequence

from axon.bench.metrics import percentile_key

_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _number(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def level_label(level: dict) -> str:
    """`concurrency 4`, `rate 2/s, concurrency 8`, `rate inf/s`: which level this is."""
    rate, concurrency = level["request_rate"], level["max_concurrency"]
    parts = [] if rate in ("inf", math.inf) else [f"rate {rate:g}/s"]
    if concurrency is not None:
        parts.append(f"concurrency {concurrency}")
    return ", ".join(parts) or "rate inf/s"


def _stats(percentiles: Sequence[float]) -> tuple[str, ...]:
    """mean, then median unless p50 is asked for (it is the same number), then percentiles."""
    median = () if 50 in percentiles else ("median",)
    return ("mean", *median, *(percentile_key(q) for q in percentiles))


def format_level(level: dict, percentiles: Sequence[float]) -> str:
    """vLLM's `Serving Benchmark Result` block for one level."""
    rows = [
        ("Successful requests", f"{level['completed']} / {level['num_prompts']}"),
        ("Benchmark duration (s)", _number(level["duration"])),
        ("Total input tokens", str(level["total_input_tokens"])),
        ("Total generated tokens", str(level["total_output_tokens"])),
        ("Request throughput (req/s)", _number(level["request_throughput"])),
        ("Output token throughput (tok/s)", _number(level["output_throughput"])),
        ("Total token throughput (tok/s)", _number(level["total_token_throughput"])),
    ]
    lines = [f"{f' Serving Benchmark Result: {level_label(level)} ':=^50}"]
    lines += [f"{name + ':':<40} {value:<10}" for name, value in rows]
    for metric, (title, short) in _TITLES.items():
        lines.append(f"{f'{title}':-^50}")
        for stat in _stats(percentiles):
            name = f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {short} (ms):"
            lines.append(f"{name:<40} {_number(level[f'{stat}_{metric}_ms']):<10}")
    lines += [f"Error: {error}" for error in level.get("errors", [])]
    return "\n".join(lines + ["=" * 50])


def markdown_table(levels: Sequence[dict], percentiles: Sequence[float]) -> str:
    """One row per level: throughput, then each latency's mean / percentiles in ms."""
    stats = _stats(percentiles)
    spread = " / ".join(stats)
    header = ["level", "ok", "duration s", "req/s", "output tok/s"]
    header += [f"{short} ms {spread}" for _, short in _TITLES.values()]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for level in levels:
        row = [
            level_label(level),
            f"{level['completed']}/{level['num_prompts']}",
            _number(level["duration"], 1),
            _number(level["request_throughput"]),
            _number(level["output_throughput"], 1),
        ]
        for metric in _TITLES:
            row.append(" / ".join(_number(level[f"{s}_{metric}_ms"], 1) for s in stats))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
