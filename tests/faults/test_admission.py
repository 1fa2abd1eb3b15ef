"""One request must not take a model down (issue 32 points 1, 2): a request's size is checked
before any work, idle or busy, on every generating route (server/admission.py), and a request
of thousands of sequences whose client goes away leaves the engine at once, without a
traceback in the log.

Two real servers: one with the default sequence cap (the model's max_num_seqs 8 makes it
OpenAI's 128) and a small output-entries cap, so each route can reach it cheaply; one whose
operator raised the sequence cap, so that a single request can hold 128,000 sequences, with a
short step deadline: an engine that spends longer than that removing them is killed, which is
what happened before aborts were removed in one pass.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.faults.fleet import launch, stop_fleet
from tests.server.test_embeddings import write_embedder

SEQUENCE_CAP = 128  # the default for max_num_seqs 8: 4 x 8, at least OpenAI's largest n
ENTRIES_CAP = 1000
EMBED_CAP = 2048  # an embedding model's default: OpenAI's most inputs
BIG_CAP = 300_000
STEP_DEADLINE_S = 10
LIVENESS_S = 60  # generous: how long a drain may take before it counts as never


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory):
    model_dir = write_embedder(tmp_path_factory.mktemp("admission") / "tiny", "lasttoken", True)
    env = {"AXON_MAX_OUTPUT_ENTRIES_PER_REQUEST": str(ENTRIES_CAP)}
    models = {"tiny": {"task": "generate", "max_num_seqs": 8}, "tiny-e": {"task": "embed"}}
    running = launch(model_dir, models, env)
    yield running
    stop_fleet(running)


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory):
    model_dir = write_embedder(tmp_path_factory.mktemp("drain") / "tiny", "lasttoken", True)
    env = {
        "AXON_MAX_SEQUENCES_PER_REQUEST": str(BIG_CAP),
        "AXON_ENGINE_STEP_TIMEOUT_S": str(STEP_DEADLINE_S),
    }
    running = launch(model_dir, {"tiny": {"task": "generate", "max_num_seqs": 8}}, env)
    yield running
    stop_fleet(running)


def _post(fleet, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(fleet.base_url + path, json=body, timeout=timeout)


def _assert_openai_400(response: httpx.Response, cap: str, *numbers: int) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == cap and cap in error["message"], error
    for number in numbers:
        assert str(number) in error["message"], (number, error)


def _while_polling_health(fleet, work):
    """`work()`'s result, with /health polled meanwhile: every poll must answer 200."""
    done, statuses = threading.Event(), []

    def poll() -> None:
        while not done.is_set():
            statuses.append(httpx.get(fleet.base_url + "/health", timeout=10).status_code)
            time.sleep(0.05)

    with ThreadPoolExecutor(1) as pool:
        poller = pool.submit(poll)
        try:
            result = work()
        finally:
            done.set()
        poller.result()
    assert statuses and set(statuses) == {200}, statuses
    return result


ISSUE_BODY = {"model": "tiny", "prompt": ["a"] * 20000, "n": 128, "max_tokens": 1}


def test_the_issues_request_is_refused_before_any_work_idle_and_busy(capped):
    response = _while_polling_health(capped, lambda: _post(capped, "/v1/completions", ISSUE_BODY))
    _assert_openai_400(response, "max_sequences_per_request", 2_560_000, SEQUENCE_CAP)
    assert response.json()["error"]["param"] == "prompt"
    busy = {"model": "tiny", "prompt": "w10", "max_tokens": 900, "ignore_eos": True}
    url = capped.base_url + "/v1/completions"
    with httpx.stream("POST", url, json={**busy, "stream": True}, timeout=60) as stream:
        assert stream.status_code == 200
        next(stream.iter_lines())  # the model is busy with it now
        response = _post(capped, "/v1/completions", ISSUE_BODY)
    _assert_openai_400(response, "max_sequences_per_request", 2_560_000)


def test_each_route_refuses_beyond_a_cap_in_its_own_shape(capped):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
    too_wide = {**chat, "max_tokens": 143, "logprobs": True, "top_logprobs": 6}  # 1001 entries
    _assert_openai_400(
        _post(capped, "/v1/chat/completions", too_wide), "max_output_entries_per_request", 1001
    )
    answer = {"model": "tiny", "input": "hi", "max_output_tokens": 1001}
    response = _post(capped, "/v1/responses", answer)
    _assert_openai_400(response, "max_output_entries_per_request", ENTRIES_CAP)
    response = _post(capped, "/v1/messages", {**chat, "max_tokens": 1001})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert "max_output_entries_per_request" in body["error"]["message"], body
    inputs = [[5, 6]] * (EMBED_CAP + 1)
    response = _post(capped, "/v1/embeddings", {"model": "tiny-e", "input": inputs})
    _assert_openai_400(response, "max_sequences_per_request", EMBED_CAP + 1, EMBED_CAP)


def test_a_request_just_under_each_cap_is_served(capped):
    prompts = ["w10 w11"] * (SEQUENCE_CAP - 1)
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 1}
    response = _post(capped, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == SEQUENCE_CAP - 1
    under = {"model": "tiny", "prompt": "w10", "max_tokens": 111, "logprobs": 8}  # 999 entries
    assert _post(capped, "/v1/completions", under).status_code == 200
    # An unset max_tokens counts as the rest of the context: refused after tokenizing.
    unset = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
    response = _post(capped, "/v1/chat/completions", unset)
    _assert_openai_400(response, "max_output_entries_per_request")
    response = _post(capped, "/v1/embeddings", {"model": "tiny-e", "input": [[5, 6]] * 64})
    assert response.status_code == 200, response.text


# ---- a request of thousands of sequences whose client goes away ------------------------------

PROMPTS, N = 2000, 128  # 256,000 sequences
NAMES = ("running", "waiting")


def _gauge(text: str, name: str) -> float | None:
    match = re.search(rf'^{re.escape(name)}\{{model_name="tiny"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


def _wait_drained(fleet) -> None:
    """Polls the engine's own counts until nothing runs or waits (a scrape that got no
    answer from the engine has no gauges, and does not count)."""
    deadline, seen = time.monotonic() + LIVENESS_S, []
    while time.monotonic() < deadline:
        text = httpx.get(fleet.base_url + "/metrics", timeout=30).text
        counts = tuple(_gauge(text, f"axon:num_requests_{which}") for which in NAMES)
        seen.append(counts)
        if counts == (0.0, 0.0):
            return
        time.sleep(0.2)
    raise AssertionError(f"the engine never drained: {seen[-5:]}")


def _assert_unharmed(fleet, pid: int, log_from: int) -> None:
    _wait_drained(fleet)
    assert fleet.engine_pid("tiny") == pid and fleet.status("tiny") == "loaded"
    assert fleet.complete("tiny").status_code == 200
    log = "".join(fleet.log[log_from:])
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "deadline" not in log, log


def _big_body(**extra) -> dict:
    return {"model": "tiny", "prompt": ["w10 w11"] * PROMPTS, "n": N, "max_tokens": 8, **extra}


def test_a_streamed_request_of_many_sequences_leaves_the_engine_when_its_client_goes(roomy):
    pid, log_from = roomy.engine_pid("tiny"), len(roomy.log)
    url = roomy.base_url + "/v1/completions"
    with httpx.stream("POST", url, json=_big_body(stream=True), timeout=120) as stream:
        assert stream.status_code == 200
        for count, _ in enumerate(stream.iter_lines()):
            if count > 20:
                break
    _assert_unharmed(roomy, pid, log_from)


def test_a_whole_request_of_many_sequences_leaves_the_engine_when_its_client_goes(roomy):
    pid, log_from = roomy.engine_pid("tiny"), len(roomy.log)
    with pytest.raises(httpx.ReadTimeout):
        _post(roomy, "/v1/completions", _big_body(), timeout=5)
    _assert_unharmed(roomy, pid, log_from)
