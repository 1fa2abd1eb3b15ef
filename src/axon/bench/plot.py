"""The sweep as a PNG: latency percentiles and throughput against the concurrency (or rate).

matplotlib is an optional extra (`pip install 'axon[bench]'`), imported only when a plot is
asked for; the figure is drawn on matplotlib's Agg canvas without pyplot, so no display or GUI
backend is needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from axon.bench.metrics import percentile_key

_LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
_THROUGHPUTS = (("output_throughput", "output tokens / s"), ("request_throughput", "requests / s"))


def require_matplotlib():
    """matplotlib's Figure class; raises ValueError (how to install it) when it is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'axon[bench]' (or pip install matplotlib)"
        ) from None
    return Figure


def _value(level: dict, key: str) -> float:
    value = level.get(key)
    return math.nan if value is None else value


def plot_sweep(
    levels: Sequence[dict], path: Path, x_key: str, percentiles: Sequence[float], title: str = ""
) -> None:
    """Writes a 2 x 3 PNG to `path`: TTFT, TPOT, ITL and E2E (mean and each percentile, ms),
    output and request throughput, one point per level; `x_key` (`max_concurrency` or
    `request_rate`) labels the x axis, whose levels are evenly spaced."""
    figure = require_matplotlib()(figsize=(15, 8), layout="constrained")
    axes = list(figure.subplots(2, 3).flat)
    positions = list(range(len(levels)))
    labels = [str(level[x_key]) for level in levels]
    x_label = "max concurrency" if x_key == "max_concurrency" else "request rate (req/s)"
    stats = ("mean", *(percentile_key(q) for q in percentiles))
    for ax, (metric, name) in zip(axes[:4], _LATENCIES):
        for stat in stats:
            values = [_value(level, f"{stat}_{metric}_ms") for level in levels]
            ax.plot(positions, values, marker="o", label=stat)
        ax.set_title(f"{name} (ms)")
        ax.set_ylim(bottom=0)
        ax.legend()
    for ax, (key, name) in zip(axes[4:], _THROUGHPUTS):
        ax.plot(positions, [_value(level, key) for level in levels], marker="o", color="C3")
        ax.set_title(name)
        ax.set_ylim(bottom=0)
    for ax in figure.axes:
        ax.set_xticks(positions, labels)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=80)
