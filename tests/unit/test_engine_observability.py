"""The engine's counters seen from the HTTP process. Speculative decoding: vLLM's spec_decode
counters on /metrics from the engine's stats, a request's drafted / accepted totals in its usage
block, zero or absent (never an error) for an engine that does not speculate. The prefix cache's
host-memory and disk tiers: the tokens each gave back, by tier."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from axon.engine.output_processor import SampleState
from axon.outputs import TokenUpdate
from axon.sampling_params import SamplingParams
from axon.server.metrics import EngineStatsCollector
from axon.server.schemas.protocol import draft_totals, usage

PLAIN = {"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.5}
SPECULATING = {
    **PLAIN,
    "spec_num_drafts": 7,
    "spec_num_draft_tokens": 28,
    "spec_num_accepted_tokens": 19,
    "spec_accepted_per_position": [7, 6, 4, 2],
}


def _scrape(snapshots: dict[str, dict]) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a registry holding only the engine collector."""
    collector = EngineStatsCollector()
    collector.update(snapshots, {model: "loaded" for model in snapshots})
    registry = CollectorRegistry()
    registry.register(collector)
    samples = {}
    for family in registry.collect():
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    assert generate_latest(registry)  # the exposition renders
    return samples


def test_the_counters_under_vllms_names_per_model():
    samples = _scrape({"spec": SPECULATING, "plain": PLAIN})
    spec = (("model_name", "spec"),)
    assert samples["axon:spec_decode_num_drafts_total", spec] == 7
    assert samples["axon:spec_decode_num_draft_tokens_total", spec] == 28
    assert samples["axon:spec_decode_num_accepted_tokens_total", spec] == 19
    for position, count in enumerate([7, 6, 4, 2]):
        labels = (("model_name", "spec"), ("position", str(position)))
        assert samples["axon:spec_decode_num_accepted_tokens_per_pos_total", labels] == count


def test_an_engine_without_speculation_reads_zero():
    samples = _scrape({"plain": PLAIN})
    plain = (("model_name", "plain"),)
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        assert samples[f"axon:spec_decode_num_{name}_total", plain] == 0
    assert not any(name.endswith("_per_pos_total") for name, _ in samples)


def test_usage_carries_the_drafted_and_accepted_totals():
    body = usage(5, 12, drafts=(10, 7))
    assert body["completion_tokens_details"] == {
        "accepted_prediction_tokens": 7,
        "rejected_prediction_tokens": 3,
    }
    assert "completion_tokens_details" not in usage(5, 12)  # nothing drafted: as before


def _sample() -> SampleState:
    return SampleState(0, SamplingParams(max_tokens=8), [1, 2, 3], tokenizer=None)


def test_a_sample_keeps_the_engines_running_totals():
    sample = _sample()
    for token, drafted, accepted in ((4, 0, 0), (5, 3, 2), (6, 3, 2), (7, 6, 2)):
        sample.add(
            TokenUpdate("r", 0, token, num_draft_tokens=drafted, num_accepted_tokens=accepted)
        )
    assert (sample.num_draft_tokens, sample.num_accepted_tokens) == (6, 2)
    other = _sample()
    other.add(TokenUpdate("r", 1, 9, num_draft_tokens=4, num_accepted_tokens=4))
    assert draft_totals([sample, other]) == (10, 6)
    assert draft_totals([_sample()]) == (0, 0)


def test_the_prefix_cache_tiers_hits_by_tier_only_where_there_are_tiers():
    tiered = {**PLAIN, "prefix_host_hits": 48, "prefix_disk_hits": 16}
    samples = _scrape({"tiered": tiered, "disk": {**PLAIN, "prefix_disk_hits": 32}, "plain": PLAIN})
    name = "axon:external_prefix_cache_hits_total"
    hits = {labels: value for (sample, labels), value in samples.items() if sample == name}
    assert hits == {
        (("model_name", "tiered"), ("tier", "host")): 48,
        (("model_name", "tiered"), ("tier", "disk")): 16,
        (("model_name", "disk"), ("tier", "disk")): 32,
    }
