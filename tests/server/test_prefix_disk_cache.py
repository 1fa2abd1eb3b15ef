"""`axon serve --prefix-cache-dir` (with a host-memory tier in front): a server started again on
the same directory answers a prompt an earlier run saw from the disk tier, and says so in the
usage's cached tokens and on /metrics."""

from __future__ import annotations

import time
from pathlib import Path

from openai import OpenAI

from axon.server.schemas.node_protocol import EngineArgs

from .conftest import _serve_args, _wait_until_serving, spawn_serve, stop_server

SYSTEM = " ".join(f"w{20 + i % 200}" for i in range(300))  # a long, fixed system prompt


def _ask(server) -> tuple[str, int]:
    """The tiny model's greedy answer to the fixed chat, and its cached prompt tokens."""
    with OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=60) as c:
        reply = c.chat.completions.create(
            model="tiny-qwen3",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}],
            max_tokens=8,
            temperature=0,
        )
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].message.content, (details.cached_tokens if details else 0) or 0


def _serve(model_dir: Path, cache_dir: Path):
    tiers = ["--prefix-cache-dir", str(cache_dir), "--prefix-cache-host-size", "16M"]
    server = spawn_serve([*_serve_args(model_dir), *tiers])
    try:
        _wait_until_serving(server)
    except BaseException:
        stop_server(server)
        raise
    return server


def _wait_for_files(cache_dir: Path, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(list(cache_dir.glob("*/*.kv"))) < count:  # written off the step loop
        assert time.monotonic() < deadline, "no prefix blocks written"
        time.sleep(0.1)


def test_a_restarted_server_serves_the_prefix_from_disk(tiny_chat_model, tmp_path):
    cache_dir = tmp_path / "prefix-cache"
    first = _serve(tiny_chat_model, cache_dir)
    try:
        answer, cached = _ask(first)
        assert cached == 0
        _wait_for_files(cache_dir, 300 // 16)
    finally:
        stop_server(first)

    second = _serve(tiny_chat_model, cache_dir)
    try:
        again, cached = _ask(second)
        hits = {
            tier: second.metric_line("axon:external_prefix_cache_hits_total", tier=tier)
            for tier in ("host", "disk")
        }
    finally:
        stop_server(second)
    assert again == answer
    assert cached >= 300 // 16 * 16
    assert hits == {"host": 0, "disk": cached}  # memory is new with the process


def test_a_load_over_http_may_not_choose_the_directory(tmp_path):
    """Where the engine writes and removes files is the operator's: a `POST /models/load`
    naming another directory is a 400 on the field; the server's own one is accepted."""
    from .test_node_api import AUTH, KEY, Harness, run

    own = str(tmp_path / "own")

    async def scenario():
        harness = Harness(api_key=KEY, engine=EngineArgs(prefix_cache_dir=own))
        async with harness.client() as http:
            body = {"model_id": "org/a", "prefix_cache_dir": "/etc/cron.d"}
            refused = await http.post("/models/load", json=body, headers=AUTH)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "prefix_cache_dir"
            body["prefix_cache_dir"] = own
            assert (await http.post("/models/load", json=body, headers=AUTH)).status_code == 200
            started = harness.started[-1].engine_args
            assert started["prefix_cache_dir"] == own

    run(scenario())
