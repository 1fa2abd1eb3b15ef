"""The table and the targets of benchmarks/speculative.py (pure: figures in, markdown out).

`result["best"]` is {variant: {workload: {level: metrics}}} with `axon bench serve`'s metric
keys plus `total_draft_tokens` / `total_accepted_tokens`; `result["speculative"]` names the
variants that draft.
"""

from __future__ import annotations

BASELINE = "axon"
SPECULATIVE_AXON = "axon ngram"
# issue 33 point 7: (workload, streams, against, bound)
TARGETS = (
    ("edit", 1, "axon", 2.0),
    ("edit", 1, "llama-server speculative", 1.3),
    ("free", 1, "axon", 0.95),
    ("edit", 16, "axon", 0.95),
    ("summary", 16, "axon", 0.95),
    ("free", 16, "axon", 0.95),
)


def speed(metrics: dict, level: int) -> float | None:
    """The figure a level is compared on: decode tok/s per stream (1000 / TPOT p50) at one
    stream, output tok/s of all streams at more."""
    if level == 1:
        tpot = metrics.get("median_tpot_ms")
        return 1000.0 / tpot if tpot else None
    return metrics.get("output_throughput")


def acceptance(metrics: dict) -> float | None:
    drafted = metrics.get("total_draft_tokens") or 0
    return metrics.get("total_accepted_tokens", 0) / drafted if drafted else None


def best_llama_speculative(result: dict, workload: str, level: int) -> tuple[str, float] | None:
    """(name, speed) of the fastest llama-server speculative row of a level, or None."""
    rows = [
        (name, speed(figures[workload][level], level))
        for name, figures in result["best"].items()
        if name.startswith("llama-server")
        and name in result["speculative"]
        and workload in figures
        and level in figures[workload]
    ]
    rows = [(name, value) for name, value in rows if value]
    return max(rows, key=lambda row: row[1]) if rows else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def format_table(result: dict, levels: list[int], cpu: str) -> str:
    """One markdown table: a row per (workload, streams, variant)."""
    best = result["best"]
    lines = [
        f"#### {result['model'].rsplit('/', 1)[-1]} ({cpu})",
        "",
        "| workload | streams | engine | decode tok/s per stream | output tok/s "
        "| accepted / drafted | vs axon | vs best llama-server speculative |",
        "|---|---|---|---|---|---|---|---|",
    ]
    workloads = next((list(figures) for figures in best.values()), [])
    for workload in workloads:
        for level in levels:
            base = best.get(BASELINE, {}).get(workload, {}).get(level)
            peer = best_llama_speculative(result, workload, level)
            for name, figures in best.items():
                m = figures.get(workload, {}).get(level)
                if m is None:
                    continue
                lines.append(_row(name, workload, level, m, base, peer, result["speculative"]))
    lines += [f"- {note}" for note in result.get("notes", [])]
    return "\n".join(lines)


def _row(name, workload, level, m, base, peer, speculative) -> str:
    tpot = m.get("median_tpot_ms")
    rate = acceptance(m)
    accepted = (
        f"{rate:.1%} ({m['total_accepted_tokens']}/{m['total_draft_tokens']})"
        if rate is not None
        else "-"
    )
    ours = speed(m, level)
    against_axon = _ratio(ours, speed(base, level)) if base and name != BASELINE else "-"
    against_peer = "-"
    if peer and name.startswith("axon") and name in speculative:
        against_peer = f"{_ratio(ours, peer[1])} ({peer[0]})"
    return (
        f"| {workload} | {level} | {name} | {1000 / tpot if tpot else 0:.1f} | "
        f"{m['output_throughput']:.1f} | {accepted} | {against_axon} | {against_peer} |"
    )


def evaluate_targets(result: dict) -> list[tuple[str, float | None, float, bool | None]]:
    """(target, measured ratio, bound, met) per target whose rows were measured."""
    rows = []
    best = result["best"]
    ours_all = best.get(SPECULATIVE_AXON)
    for workload, level, against, bound in TARGETS:
        name = f"{SPECULATIVE_AXON} {workload} c{level} >= {bound}x {against}"
        ours = speed(ours_all[workload][level], level) if _has(ours_all, workload, level) else None
        if against == "axon":
            base = best.get(BASELINE)
            theirs = speed(base[workload][level], level) if _has(base, workload, level) else None
        else:
            peer = best_llama_speculative(result, workload, level)
            theirs = peer[1] if peer else None
        if ours is None or theirs is None:
            continue
        ratio = ours / theirs
        rows.append((name, ratio, bound, ratio >= bound))
    return rows


def _has(figures: dict | None, workload: str, level: int) -> bool:
    return bool(figures) and level in figures.get(workload, {})


def summarize_targets(result: dict) -> str:
    rows = evaluate_targets(result)
    if not rows:
        return "(no target measured: it needs the axon and axon ngram rows at its level)"
    lines = ["| target | measured | |", "|---|---|---|"]
    for name, ratio, _, met in rows:
        lines.append(f"| {name} | {ratio:.2f}x | {'pass' if met else 'MISS'} |")
    return "\n".join(lines)
