"""Prometheus metrics under vLLM's names, with the prefix `axon:` instead of `vllm:`.

Latencies and token counts are observed here in the HTTP process as tokens stream out; the
engine-side gauges (running / waiting requests, KV usage, prefix-cache counters) are read
from each engine when /metrics is scraped, so a dashboard built for vLLM works unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
_LABELS = ["model_name"]
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)

TTFT = Histogram(
    "axon:time_to_first_token_seconds",
    "Time to first token.",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
ITL = Histogram(
    "axon:inter_token_latency_seconds",
    "Inter-token latency.",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
E2E = Histogram(
    "axon:e2e_request_latency_seconds",
    "End-to-end request latency.",
    _LABELS,
    buckets=_E2E_BUCKETS,
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "axon:prompt_tokens", "Prompt tokens processed.", _LABELS, registry=REGISTRY
)
GENERATION_TOKENS = Counter(
    "axon:generation_tokens", "Generation tokens produced.", _LABELS, registry=REGISTRY
)
REQUEST_SUCCESS = Counter(
    "axon:request_success",
    "Finished requests.",
    ["model_name", "finished_reason"],
    registry=REGISTRY,
)


def first_token(model_id: str, seconds: float) -> None:
    TTFT.labels(model_id).observe(seconds)


_ITL_BY_MODEL: dict = {}  # model id -> its ITL child: `labels` (a lock, a check) ran per token


def inter_token(model_id: str, seconds: float) -> None:
    child = _ITL_BY_MODEL.get(model_id)
    if child is None:
        child = _ITL_BY_MODEL[model_id] = ITL.labels(model_id)
    child.observe(seconds)


def request_finished(
    model_id: str,
    e2e_seconds: float,
    prompt_tokens: int,
    generation_tokens: int,
    finish_reason: str | None,
) -> None:
    E2E.labels(model_id).observe(e2e_seconds)
    PROMPT_TOKENS.labels(model_id).inc(prompt_tokens)
    GENERATION_TOKENS.labels(model_id).inc(generation_tokens)
    REQUEST_SUCCESS.labels(model_id, finish_reason or "abort").inc()


def _observe(hook, *args) -> None:
    """Calls `hook(*args)`; metrics never break serving."""
    try:
        hook(*args)
    except Exception:  # noqa: BLE001
        logger.exception("metrics hook %s failed", hook.__name__)


class RequestObserver:
    """Feeds one request's token timings to the metrics above."""

    def __init__(self, model_id: str, started_at: float):
        self.model_id = model_id
        self.started_at = started_at
        self.last_token_at: float | None = None
        self.num_tokens = 0

    def update(self, state) -> None:
        """`state`: the request's RequestState after an engine update."""
        num_tokens = sum(len(sample.token_ids) for sample in state.samples)
        if num_tokens == self.num_tokens:
            return
        self.num_tokens, at = num_tokens, time.monotonic()
        if self.last_token_at is None:
            _observe(first_token, self.model_id, at - self.started_at)
        else:
            _observe(inter_token, self.model_id, at - self.last_token_at)
        self.last_token_at = at

    def finish(self, state) -> None:
        reason = state.samples[0].finish_reason if state.finished else "abort"
        elapsed = time.monotonic() - self.started_at
        num_prompt = len(state.prompt_token_ids)
        _observe(request_finished, self.model_id, elapsed, num_prompt, self.num_tokens, reason)


class EngineStatsCollector:
    """Exposes the latest engine snapshot of each model (refreshed by each scrape where the
    engine answers, kept where it does not) and each model's state."""

    def __init__(self) -> None:
        self.snapshots: dict[str, dict] = {}
        self.states: dict[str, str] = {}  # model -> loaded | unresponsive | recovering | ...

    def update(self, fresh: dict[str, dict], states: dict[str, str]) -> None:
        """Takes this scrape's snapshots; a model without one keeps its last (a stopped engine
        keeps its gauges, marked by its state), a model no longer on the node loses its own."""
        kept = {model: self.snapshots[model] for model in states if model in self.snapshots}
        self.snapshots = {**kept, **fresh}
        self.states = dict(states)

    def collect(self):
        families = {
            "running": GaugeMetricFamily(
                "axon:num_requests_running", "Requests running in the engine.", labels=_LABELS
            ),
            "waiting": GaugeMetricFamily(
                "axon:num_requests_waiting", "Requests waiting in the engine.", labels=_LABELS
            ),
            "kv": GaugeMetricFamily(
                "axon:kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0-1).",
                labels=_LABELS,
            ),
            "queries": CounterMetricFamily(
                "axon:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                labels=_LABELS,
            ),
            "hits": CounterMetricFamily(
                "axon:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=_LABELS
            ),
            "preemptions": CounterMetricFamily(
                "axon:num_preemptions", "Sequences preempted.", labels=_LABELS
            ),
            **_spec_decode_families(),
        }
        keys = {
            "running": "num_running",
            "waiting": "num_waiting",
            "kv": "kv_cache_usage",
            "queries": "prefix_cache_queries",
            "hits": "prefix_cache_hits",
            "preemptions": "num_preemptions",
            **_SPEC_DECODE_KEYS,
        }
        for model_id, stats in self.snapshots.items():
            for name, family in families.items():
                family.add_metric([model_id], float(stats.get(keys[name], 0)))
        state = GaugeMetricFamily(
            "axon:model_state",
            "The model's state (label `state`: loaded, unresponsive: its engine is silent and "
            "its gauges are the last it reported, loading, poisoned, recovering, failed).",
            labels=[*_LABELS, "state"],
        )
        for model_id, model_state in self.states.items():
            state.add_metric([model_id, model_state], 1.0)
        yield from (*families.values(), *_labelled_families(self.snapshots), state)


def _labelled_families(snapshots: dict[str, dict]) -> tuple:
    """The counters with a label besides the model's: accepted draft tokens by position, and
    the prompt tokens each tier of the prefix cache past the KV cache gave back (a model
    without such a tier has no sample)."""
    per_position = CounterMetricFamily(
        "axon:spec_decode_num_accepted_tokens_per_pos",
        "Accepted draft tokens, by their position in the draft (0: the first).",
        labels=[*_LABELS, "position"],
    )
    tiers = CounterMetricFamily(
        "axon:external_prefix_cache_hits",
        "Prompt tokens the prefix cache read back from host memory or disk (label `tier`; "
        "counted in prefix_cache_hits too).",
        labels=[*_LABELS, "tier"],
    )
    for model_id, stats in snapshots.items():
        for position, count in enumerate(stats.get("spec_accepted_per_position") or ()):
            per_position.add_metric([model_id, str(position)], float(count))
        for tier in ("host", "disk"):
            if f"prefix_{tier}_hits" in stats:
                tiers.add_metric([model_id, tier], float(stats[f"prefix_{tier}_hits"]))
    return per_position, tiers


# Speculative decoding's counters (vLLM's spec_decode_* names): zero for an engine that does
# not speculate (its stats have no such keys).
_SPEC_DECODE_KEYS = {
    "spec_drafts": "spec_num_drafts",
    "spec_draft_tokens": "spec_num_draft_tokens",
    "spec_accepted_tokens": "spec_num_accepted_tokens",
}


def _spec_decode_families() -> dict:
    return {
        "spec_drafts": CounterMetricFamily(
            "axon:spec_decode_num_drafts",
            "Drafts proposed by speculative decoding (one a sequence a step that drafted).",
            labels=_LABELS,
        ),
        "spec_draft_tokens": CounterMetricFamily(
            "axon:spec_decode_num_draft_tokens", "Draft tokens proposed.", labels=_LABELS
        ),
        "spec_accepted_tokens": CounterMetricFamily(
            "axon:spec_decode_num_accepted_tokens",
            "Draft tokens the target model accepted.",
            labels=_LABELS,
        ),
    }


ENGINE_STATS = EngineStatsCollector()
REGISTRY.register(ENGINE_STATS)

router = APIRouter()
STATS_TIMEOUT_S = 2.0


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Answers from this process's own state: only engines heard from lately are asked for
    their gauges (bounded); a silent one keeps its last and is marked unresponsive."""
    registry = request.app.state.axon.registry
    states = {model_id: registry.status(model_id) for model_id in registry.model_ids()}
    models = [m for m in registry.list_models() if m.status == "loaded"]
    asked = [m for m in models if getattr(m, "responsive", True)]
    # Bounded: a wedged engine must not hold the scrape (the watchdog deals with the engine).
    results = await asyncio.gather(
        *(asyncio.wait_for(m.stats(), STATS_TIMEOUT_S) for m in asked), return_exceptions=True
    )
    fresh = {}
    for model, result in zip(asked, results):
        if isinstance(result, Exception):
            logger.warning("metrics: no stats from %s: %s", model.id, result)
        else:
            fresh[model.id] = result
    for model in models:
        if model.id not in fresh:
            states[model.id] = "unresponsive"
    ENGINE_STATS.update(fresh, states)
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
