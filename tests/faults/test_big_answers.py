"""A big answer is built off the event loop (issue 32 point 3): while a real `axon serve` produces
a chat answer with top_logprobs: 20 (~12 MB of JSON), whole or streamed, `/health` answers about
as fast as when the server is idle. Its latency is probed open-loop (a probe every few ms, each
timed from when it was due), so a stall delays every probe due in it, and compared with an idle
baseline taken the same way in the same test.

The answer is n: 8 x 1000 tokens rather than the issue's n: 128 x 300 (55 MB): on the tiny CPU
model the engine outruns the HTTP process, whose per-step work for 128 sequences' logprobs (and
the GC passes over them) would then be measured instead of the answer's encoding, which took
3 s of the loop here before (FastAPI's encoder, then json.dumps)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.faults.fleet import launch, stop_fleet
from tests.server.conftest import write_tiny_qwen3

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from health_under_load import percentile, probe_health  # noqa: E402 - the benchmark's prober

N, MAX_TOKENS, TOP = 8, 1000, 20
# The bound's floor: the encoding stalled the loop for 4-6 s, then full GC passes over the
# answer's per-token Logprob objects up to 0.25 s on a quiet machine; what remains (p99 ~0.1 s
# whole, ~0.02 s streamed, quiet) is scheduling gaps, a few times that on a busy 2-core test
# machine (the other test worker hammering the second core). 1 s keeps the suite steady there
# and still fails on the stalls this test exists for.
FLOOR_S = 1.0
BIG = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hello"}],
    "n": N,
    "max_tokens": MAX_TOKENS,
    "ignore_eos": True,
    "logprobs": True,
    "top_logprobs": TOP,
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    model_dir = write_tiny_qwen3(tmp_path_factory.mktemp("big") / "tiny")
    running = launch(model_dir, {"tiny": {"max_num_seqs": N}}, {})
    small = {**BIG, "n": 2, "max_tokens": 8}  # warm: the idle baseline is of a warm server
    httpx.post(running.base_url + "/v1/chat/completions", json=small, timeout=60)
    time.sleep(1.0)
    yield running
    stop_fleet(running)


def _big_answer(base_url: str, stream: bool, into: list[bytes], done: threading.Event) -> None:
    """The big request; its body's bytes are kept, not parsed, so that the test process (whose
    prober shares the GIL) does no big work while probing."""
    try:
        body = {**BIG, "stream": stream}
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=600) as r:
            assert r.status_code == 200, r.read()
            into.extend(r.iter_bytes())
    finally:
        done.set()


def _choices_of(data: bytes, stream: bool) -> dict[int, list[dict]]:
    """The logprobs content of every choice, from the whole answer or its chunks."""
    content: dict[int, list[dict]] = {}
    if not stream:
        answer = json.loads(data)
        for choice in answer["choices"]:
            content[choice["index"]] = choice["logprobs"]["content"]
        return content
    for line in data.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[len("data: ") :])["choices"]:
            if choice.get("logprobs"):
                content.setdefault(choice["index"], []).extend(choice["logprobs"]["content"])
    return content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_health_stays_fast_while_a_big_answer_is_produced(fleet, stream):
    def for_s(seconds: float):
        deadline = time.monotonic() + seconds
        return lambda: time.monotonic() < deadline

    asyncio.run(probe_health(fleet.base_url, for_s(0.5)))  # the prober's first use: warm-up
    idle = asyncio.run(probe_health(fleet.base_url, for_s(2.0)))
    data: list[bytes] = []
    done = threading.Event()
    thread = threading.Thread(target=_big_answer, args=(fleet.base_url, stream, data, done))
    thread.start()
    busy = asyncio.run(probe_health(fleet.base_url, lambda: not done.is_set()))
    thread.join()
    content = _choices_of(b"".join(data), stream)
    assert sorted(content) == list(range(N))
    assert all(len(entries) == MAX_TOKENS for entries in content.values())
    entry = content[0][0]
    assert len(entry["top_logprobs"]) == TOP and isinstance(entry["logprob"], float)
    idle_p99, busy_p99 = percentile(idle, 0.99), percentile(busy, 0.99)
    bound = max(10 * idle_p99, FLOOR_S)
    assert busy_p99 < bound, (len(b"".join(data)), idle_p99, busy_p99, max(busy))
