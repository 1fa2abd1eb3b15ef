"""The benchmark's HTTP client: streamed OpenAI requests, timestamped chunk by chunk.

Each request is a streamed `/v1/completions` or `/v1/chat/completions` with `max_tokens`,
`ignore_eos` (vLLM's and llama-server's extension, so every answer has its full length) and
`stream_options.include_usage`, so the output token count comes from the server's usage chunk
(the number of output chunks when the server sends none). Speculative decoding's drafted and
accepted tokens come from axon's usage (`completion_tokens_details`: accepted / rejected
prediction tokens) or llama-server's last chunk (`timings`: `draft_n`, `draft_n_accepted`).

An output chunk is a completions chunk with `choices` (its text may be empty: a model without
a tokenizer streams token ids only; vLLM's client counts these too), or a chat chunk whose delta
carries anything besides the role: axon sends the role chunk before the prompt is computed, so
counting it would make TTFT the time to the response headers.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from axon.bench.metrics import RequestResult

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class BenchPrompt:
    """One request's input: text (or token ids, sent as is to /v1/completions) and lengths."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class RequestConfig:
    base_url: str
    endpoint: str  # "completions" or "chat"
    model: str
    temperature: float = 0.0
    ignore_eos: bool = True

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]


def request_body(config: RequestConfig, prompt: BenchPrompt) -> dict:
    """The JSON body of one streamed request."""
    body = {
        "model": config.model,
        "max_tokens": prompt.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    return body


def is_output_chunk(chunk: dict, endpoint: str) -> bool:
    """Whether an SSE chunk carries generated tokens (see the module docstring)."""
    choices = chunk.get("choices")
    if not choices:
        return False
    if endpoint == "completions":
        return True
    delta = choices[0].get("delta") or {}
    return any(value for key, value in delta.items() if key != "role")


def _read_usage(result: RequestResult, usage: dict) -> int | None:
    """Takes the prompt length and cached tokens from `usage`; returns its completion tokens."""
    if usage.get("prompt_tokens") is not None:
        result.prompt_len = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens") or 0
    drafts = usage.get("completion_tokens_details") or {}
    if drafts.get("accepted_prediction_tokens") is not None:
        result.accepted_tokens = drafts["accepted_prediction_tokens"]
        result.draft_tokens = result.accepted_tokens + (
            drafts.get("rejected_prediction_tokens") or 0
        )
    return usage.get("completion_tokens")


def _read_timings(result: RequestResult, timings: dict) -> None:
    """llama-server's per-request speculation counts (present once it drafted)."""
    if timings.get("draft_n") is not None:
        result.draft_tokens = timings["draft_n"]
        result.accepted_tokens = timings.get("draft_n_accepted") or 0


async def _read_stream(
    response: httpx.Response, result: RequestResult, endpoint: str, sent: float
) -> int | None:
    """Timestamps the output chunks into `result`; returns the usage's completion tokens."""
    usage_tokens = None
    async for line in response.aiter_lines():
        arrived = time.perf_counter()
        if not line.startswith("data:"):
            continue  # blank separators, SSE comments, `event:` lines
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = json.dumps(chunk["error"])[:300]
            return None
        if is_output_chunk(chunk, endpoint):
            result.record_chunk(arrived - sent)
        if usage := chunk.get("usage"):
            usage_tokens = _read_usage(result, usage)
        if timings := chunk.get("timings"):
            _read_timings(result, timings)
    return usage_tokens


async def send_request(
    client: httpx.AsyncClient, config: RequestConfig, prompt: BenchPrompt
) -> RequestResult:
    """Sends one streamed request; returns its timings (`success` False, `error` set on failure)."""
    result = RequestResult(prompt_len=prompt.prompt_len)
    sent = time.perf_counter()
    try:
        async with client.stream("POST", config.url, json=request_body(config, prompt)) as response:
            if response.status_code != 200:
                body = (await response.aread())[:300].decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body}"
                return result
            usage_tokens = await _read_stream(response, result, config.endpoint, sent)
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if result.error:
        return result
    result.output_tokens = usage_tokens if usage_tokens is not None else result.chunks
    result.success = result.chunks > 0
    if not result.success:
        result.error = "no output chunk"
    return result


async def run_level(
    config: RequestConfig,
    headers: dict[str, str],
    prompts: Sequence[BenchPrompt],
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    progress=None,
    keep_alive: bool = True,
) -> tuple[float, list[RequestResult]]:
    """Sends every prompt, returns (duration s, results in prompt order).

    Requests start as a Poisson process of `request_rate` per second (all at once when
    infinite), with at most `max_concurrency` in flight (vLLM's --request-rate and
    --max-concurrency); `progress` (a tqdm bar, or None) advances as each request ends.
    `keep_alive=False` opens a connection per request: llama-server can close a kept-alive
    connection after a streamed response without saying so, failing the next request on it.
    """
    in_flight = max_concurrency or len(prompts)
    kept = in_flight if keep_alive else 0
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=kept)
    timeout = httpx.Timeout(None, connect=30.0)
    semaphore = asyncio.Semaphore(in_flight)
    gaps = random.Random(seed)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:

        async def one(prompt: BenchPrompt) -> RequestResult:
            async with semaphore:
                result = await send_request(client, config, prompt)
            if progress is not None:
                progress.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for index, prompt in enumerate(prompts):
            if index and math.isfinite(request_rate):
                await asyncio.sleep(gaps.expovariate(request_rate))
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return duration, list(results)
