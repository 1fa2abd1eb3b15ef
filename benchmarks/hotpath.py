"""Drive a running server with concurrent streamed completions, with or without penalties.

The load that issue 16's serving-overhead profile was taken under: `--concurrency` streams of
`/v1/completions` (greedy, `ignore_eos`), each `--max-tokens` long, optionally with presence,
frequency and repetition penalties. Prints output tok/s and the machine's load, so a profiler
(py-spy) attached to the server's processes sees a steady state.

    .venv/bin/axon serve --port 8123 &
    .venv/bin/python benchmarks/hotpath.py --base-url http://127.0.0.1:8123 --penalties
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx

_PROMPT = "Write a long story about a lighthouse keeper who finds a strange map. " * 8


def request_body(args: argparse.Namespace, index: int) -> dict:
    """The streamed request `index` sends (prompts differ so no prefix is shared wholesale)."""
    body = {
        "model": args.model,
        "prompt": f"{index}: {_PROMPT}",
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.penalties:
        body |= {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1}
    return body


async def one_stream(client: httpx.AsyncClient, args: argparse.Namespace, index: int) -> int:
    """Send one streamed request; return its completion tokens (from the usage chunk)."""
    tokens = 0
    url = args.base_url + "/v1/completions"
    async with client.stream("POST", url, json=request_body(args, index)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        if args.model is None:
            args.model = (await client.get(args.base_url + "/v1/models")).json()["data"][0]["id"]
        await one_stream(client, args, -1)  # warm-up
        counter = iter(range(args.num_requests))

        async def worker() -> int:
            return sum([await one_stream(client, args, i) for i in counter])

        cpu_before = [cpu_seconds(pid) for pid in args.pids]
        start = time.perf_counter()
        totals = await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start
        cpu_used = [cpu_seconds(pid) - used for pid, used in zip(args.pids, cpu_before)]
    load = os.getloadavg()
    tokens = sum(totals)
    per_token = " ".join(
        f"cpu_us_per_token[{p}]={s / tokens * 1e6:.0f}" for p, s in zip(args.pids, cpu_used)
    )
    print(
        f"penalties={args.penalties} concurrency={args.concurrency} requests={args.num_requests} "
        f"output_tokens={tokens} seconds={elapsed:.2f} output_tok_s={tokens / elapsed:.1f} "
        f"{per_token} load={load[0]:.2f},{load[1]:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--penalties", action="store_true")
    parser.add_argument(
        "--pids", type=int, nargs="*", default=[], help="report these processes' CPU per token"
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
