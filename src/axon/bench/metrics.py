"""Serving metrics with vLLM's `vllm bench serve` definitions, from per-request timestamps.

Per request (the client's clock, seconds from sending the request):

- TTFT: arrival of the first output chunk;
- E2E latency (`e2el`): arrival of the last output chunk;
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token;
- ITL: the gaps between successive output chunks, pooled over all requests (a chunk that carries
  several tokens is one gap, as in vLLM).

Per level: request throughput = completed requests / duration, output throughput = output
tokens / duration, total token throughput = (input + output tokens) / duration, where duration
is the wall time from the first request sent to the last one finished. Percentiles interpolate
linearly between closest ranks (numpy's default, which vLLM uses); std is the population one.
Pure Python: no numpy, so the definitions read the same as the tests that pin them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """One request's outcome; times are seconds from sending it."""

    prompt_len: int  # from the server's usage when it reports one, else counted by the client
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0  # E2E
    itl: list[float] = field(default_factory=list)  # one per output chunk after the first
    output_tokens: int = 0
    chunks: int = 0
    cached_tokens: int = 0
    # speculative decoding, where the server reports it: tokens drafted, and of those accepted
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def record_chunk(self, elapsed: float) -> None:
        """Adds an output chunk that arrived `elapsed` s after the send (TTFT, ITL, E2E)."""
        if self.chunks == 0:
            self.ttft = elapsed
        else:
            self.itl.append(elapsed - self.latency)
        self.latency = elapsed
        self.chunks += 1

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """numpy.percentile's default: linear interpolation between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentile_key(q: float) -> str:
    """`p99`, `p99.9`: how a percentile is spelled in the result keys."""
    return f"p{q:g}"


def summarize_ms(
    name: str, values_s: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict[str, float | None]:
    """vLLM's keys for one metric in ms: mean_, median_, std_ and p<q>_<name>_ms (None if empty)."""
    ms = [value * 1000.0 for value in values_s]
    keys = ["mean", "median", "std", *(percentile_key(q) for q in percentiles)]
    if not ms:
        return {f"{key}_{name}_ms": None for key in keys}
    stats = {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
    }
    stats.update({f"{percentile_key(q)}_{name}_ms": percentile(ms, q) for q in percentiles})
    return stats


def level_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, float | int | None]:
    """The metrics of one level (one concurrency or request rate), keyed as vLLM's result JSON."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    metrics: dict[str, float | int | None] = {
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "total_draft_tokens": sum(r.draft_tokens for r in ok),
        "total_accepted_tokens": sum(r.accepted_tokens for r in ok),
    }
    per_metric = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name in LATENCY_METRICS:
        metrics.update(summarize_ms(name, per_metric[name], percentiles))
    return metrics
