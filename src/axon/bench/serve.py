"""`axon bench serve`: the serving benchmark against any OpenAI-compatible server.

For each level of the sweep (`--concurrency 1,4,16`: at most that many requests in flight, all
sent at once; or `--request-rate 2,8`: Poisson arrivals per second) it sends `--num-prompts`
streamed requests and reports vLLM's `vllm bench serve` metrics (axon.bench.metrics): TTFT,
TPOT, ITL and E2E latency (mean, median, std and percentiles) and request / output / total
token throughput. Every level gets fresh random prompts, so no level is served from another's
prefix cache. Results go to the terminal, to `--result-json` (vLLM's key names, one entry per
level) and to `--plot` (a PNG; needs matplotlib: `pip install 'axon[bench]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math

import httpx

from axon.bench.args import DEFAULT_CONCURRENCY
from axon.bench.client import BenchPrompt, RequestConfig, run_level
from axon.bench.metrics import DEFAULT_PERCENTILES, level_metrics
from axon.bench.plot import plot_sweep, require_matplotlib
from axon.bench.prompts import (
    LocalTokenizer,
    ServerTokenizer,
    TokenCounter,
    WordCounter,
    dataset_prompts,
    random_prompts,
)
from axon.bench.report import format_level, level_label, markdown_table


def sweep_levels(ns: argparse.Namespace) -> list[tuple[int | None, float]]:
    """(max concurrency or None, request rate) per level; raises ValueError for two sweeps."""
    rates, concurrency = ns.request_rate, ns.concurrency
    if rates is None:
        return [(level, math.inf) for level in concurrency or DEFAULT_CONCURRENCY]
    if concurrency and len(concurrency) > 1 and len(rates) > 1:
        raise ValueError("sweep --concurrency or --request-rate, not both")
    if concurrency and len(concurrency) > 1:
        return [(level, rates[0]) for level in concurrency]
    return [(concurrency[0] if concurrency else None, rate) for rate in rates]


def resolve_model(client: httpx.Client, model: str | None) -> str:
    """`model`, or the only loaded model /v1/models lists; raises ValueError when that is
    unclear."""
    try:
        response = client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"--base-url {client.base_url}: cannot reach the server ({exc})") from None
    if response.status_code == 401:
        raise ValueError(f"{client.base_url} needs an API key: pass --api-key")
    if response.status_code != 200:
        raise ValueError(f"GET /v1/models: HTTP {response.status_code}: {response.text[:200]}")
    cards = response.json().get("data", [])
    # Models a request would load on demand first are no default: only the loaded ones count.
    listed = [card.get("id") for card in cards if card.get("status", "loaded") == "loaded"]
    if model is not None:
        return model
    if len(listed) != 1:
        raise ValueError(f"/v1/models lists {len(listed)} models {listed}: choose one with --model")
    return listed[0]


def token_counter(ns: argparse.Namespace, client: httpx.Client, model: str) -> TokenCounter:
    if ns.tokenizer:
        try:
            return LocalTokenizer(ns.tokenizer)
        except OSError as exc:
            raise ValueError(f"--tokenizer {ns.tokenizer!r}: {exc}") from None
    return ServerTokenizer.probe(client, model) or WordCounter()


def level_prompts(ns: argparse.Namespace, counter: TokenCounter, level: int) -> list[BenchPrompt]:
    """The prompts of level `level` (fresh random ones per level; a dataset's, reshuffled)."""
    seed = ns.seed + level
    if ns.dataset is not None:
        return dataset_prompts(counter, ns.dataset, ns.num_prompts, ns.dataset_output_len, seed)
    return random_prompts(
        counter,
        ns.num_prompts,
        ns.random_input_len,
        ns.random_output_len,
        ns.random_range_ratio,
        seed,
        send_token_ids=ns.endpoint == "completions",
    )


def _run_one_level(ns, config, headers, prompts, level, percentiles) -> dict:
    """One level's result entry: its (concurrency, rate), metrics and first errors."""
    from tqdm import tqdm

    concurrency, rate = level
    label = level_label({"max_concurrency": concurrency, "request_rate": rate})
    with tqdm(total=len(prompts), desc=label, unit="req", disable=ns.disable_tqdm) as bar:
        duration, results = asyncio.run(
            run_level(config, headers, prompts, concurrency, rate, ns.seed, bar)
        )
    metrics = level_metrics(results, duration, percentiles)
    errors = sorted({r.error for r in results if not r.success})[:5]
    return {
        "max_concurrency": concurrency,
        "request_rate": rate if math.isfinite(rate) else "inf",
        **metrics,
        "errors": errors,
    }


def _prepare(ns: argparse.Namespace, levels: list, headers: dict):
    """(RequestConfig, counter source, warm-up prompts, each level's prompts), asking the
    server for its model and tokenizer."""
    base_url = ns.base_url.rstrip("/")
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        model = resolve_model(client, ns.model)
        counter = token_counter(ns, client, model)
        warmups = random_prompts(counter, max(ns.num_warmups, 0), 16, 4, seed=-1)
        prompts = [level_prompts(ns, counter, index) for index in range(len(levels))]
    config = RequestConfig(base_url, ns.endpoint, model, ns.temperature, ns.ignore_eos)
    return config, counter.source, warmups, prompts


def _run_info(ns: argparse.Namespace, config: RequestConfig, counted_by: str) -> dict:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "model_id": config.model,
        "dataset": str(ns.dataset) if ns.dataset else "random",
        "random_input_len": ns.random_input_len,
        "random_output_len": ns.random_output_len,
        "prompt_lengths_counted_by": counted_by,
        "num_prompts": ns.num_prompts,
        "ignore_eos": ns.ignore_eos,
        "temperature": ns.temperature,
        "seed": ns.seed,
    }


def run_bench_serve(ns: argparse.Namespace) -> int:
    """Runs the sweep, prints and writes the results; returns 1 if any request failed, else 0."""
    levels = sweep_levels(ns)
    percentiles = ns.metric_percentiles or DEFAULT_PERCENTILES
    if ns.plot is not None:
        require_matplotlib()  # before the run, not after it
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    config, counted_by, warmups, prompts = _prepare(ns, levels, headers)
    info = _run_info(ns, config, counted_by)
    print(
        f"axon bench serve: {config.url}, model {config.model!r}, {len(levels)} level(s), "
        f"prompt lengths counted by {counted_by}",
        flush=True,
    )
    if warmups:
        asyncio.run(run_level(config, headers, warmups, max_concurrency=1))
    results = []
    for level, level_set in zip(levels, prompts):
        results.append(_run_one_level(ns, config, headers, level_set, level, percentiles))
        print(format_level(results[-1], percentiles), flush=True)
    print(markdown_table(results, percentiles))
    if ns.result_json is not None:
        ns.result_json.write_text(json.dumps({**info, "levels": results}, indent=2) + "\n")
    if ns.plot is not None:
        rate_sweep = len({rate for _, rate in levels}) > 1 or levels[0][0] is None
        x_key = "request_rate" if rate_sweep else "max_concurrency"
        plot_sweep(results, ns.plot, x_key, percentiles, f"{config.model} at {config.base_url}")
    return 0 if all(level["failed"] == 0 for level in results) else 1
