"""lm-evaluation-harness against `axon serve`: its real `local-completions` model, in process,
on two tasks defined here (local jsonl files, nothing downloaded): a `generate_until` task and a
multiple-choice task scored by loglikelihood (echo + logprobs on /v1/completions). lm-eval is
given a base URL and the model's name, nothing else: its default tokenizer back-end finds
/tokenizer_info and /tokenize on axon and uses them (its `remote` back-end; the Hugging Face one
would look the served name up on the Hub, which is offline here).

Every number lm-eval reports is checked against axon's own answer to the same request through the
`openai` client: the loglikelihood of each choice, and the greedy text of each question."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from lazy_modules import lazy
from tests.clients.conftest import MODEL_ID, Recorder, _handler

lm_eval = lazy("lm_eval")

QUESTIONS = [
    {"question": "Q: What is the capital of France?\nA:", "answer": "Paris"},
    {"question": "Q: 2 + 2 =\nA:", "answer": "4"},
]
CHOICES = [
    {"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "label": 0},
    {"question": "Water is", "choices": ["wet", "dry"], "label": 0},
]
GEN_TOKENS = 6
METRIC = {"aggregation": "mean", "higher_is_better": True}
TASKS = {  # name -> (rows, the task's config; YAML, written as JSON)
    "axon_generate": (
        QUESTIONS,
        {
            "output_type": "generate_until",
            "doc_to_text": "{{question}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": GEN_TOKENS, "do_sample": False},
            "metric_list": [{"metric": "exact_match", **METRIC}],
        },
    ),
    "axon_choice": (
        CHOICES,
        {
            "output_type": "multiple_choice",
            "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc", **METRIC}],
        },
    ),
}


def _write_tasks(directory: Path) -> None:
    for name, (rows, config) in TASKS.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        local = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
        }
        (directory / f"{name}.yaml").write_text(json.dumps({**local, **config}, indent=1))


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory: pytest.TempPathFactory, module_recorder):
    """lm-eval's run of both tasks through a recording proxy: (its results, the proxy)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = tmp_path_factory.mktemp("lm_eval_tasks")
    _write_tasks(tasks)
    # lm-eval sends `Bearer $OPENAI_API_KEY`; the proxy's httpx refuses the empty value.
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in offline.items():
            patch.setenv(key, value)
        results = simple_evaluate(
            model="local-completions",
            model_args={
                "model": MODEL_ID,
                "base_url": module_recorder.url + "/v1/completions",
                "max_retries": 1,
            },
            tasks=list(TASKS),
            task_manager=TaskManager(include_path=str(tasks)),
            log_samples=True,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )
    return results, module_recorder


@pytest.fixture(scope="module")
def module_recorder(qwen3_server):
    """conftest's recording proxy, for the whole module: lm-eval runs once."""
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    recording = Recorder(f"http://127.0.0.1:{proxy.server_port}", qwen3_server.base_url)
    proxy.RequestHandlerClass = _handler(recording)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield recording
    proxy.shutdown()
    proxy.server_close()


def test_both_tasks_report_results(evaluation):
    results, _ = evaluation
    assert set(results["results"]) == set(TASKS)
    assert results["results"]["axon_choice"]["acc,none"] in (0.0, 0.5, 1.0)
    assert results["results"]["axon_generate"]["exact_match,none"] in (0.0, 0.5, 1.0)


def test_every_request_reached_axon(evaluation):
    """One /v1/completions per question and per choice (batch size 1), all answered 200, and the
    tokenizer calls went to axon's own routes."""
    _, recorder = evaluation
    posts = recorder.posts("/v1/completions")
    assert len(posts) == len(QUESTIONS) + sum(len(row["choices"]) for row in CHOICES)
    assert all(post.status == 200 for post in posts), [p.answer for p in posts]
    paths = {e.path.split("?")[0] for e in recorder.exchanges}
    assert {"/tokenizer_info", "/tokenize"} <= paths


def _tokens(server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    answer = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def test_loglikelihoods_are_axons(evaluation, qwen3_server):
    """Each choice's loglikelihood is finite, negative, and the sum of the logprobs axon gives
    the continuation's tokens when asked through the openai client (echo, no new tokens)."""
    from openai import OpenAI

    results, _ = evaluation
    samples = results["samples"]["axon_choice"]
    assert len(samples) == len(CHOICES)
    with OpenAI(base_url=qwen3_server.openai_url, api_key="unused", max_retries=0) as client:
        for sample in samples:
            for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
                loglikelihood = response[0][0]
                assert math.isfinite(loglikelihood) and loglikelihood < 0
                head, tail = _tokens(qwen3_server, context), _tokens(qwen3_server, continuation)
                answer = client.completions.create(
                    model=MODEL_ID, prompt=head + tail, echo=True, logprobs=0, max_tokens=0
                )
                logprobs = answer.choices[0].logprobs.token_logprobs
                expected = sum(logprobs[len(head) : len(head) + len(tail)])
                assert loglikelihood == pytest.approx(expected, abs=1e-4)


def test_generations_are_axons_greedy_text(evaluation, qwen3_server):
    from openai import OpenAI

    results, _ = evaluation
    samples = results["samples"]["axon_generate"]
    assert len(samples) == len(QUESTIONS)
    with OpenAI(base_url=qwen3_server.openai_url, api_key="unused", max_retries=0) as client:
        for sample in samples:
            ((prompt, _),) = sample["arguments"]
            answer = client.completions.create(
                model=MODEL_ID, prompt=prompt, max_tokens=GEN_TOKENS, temperature=0, stop=["\n"]
            )
            assert sample["resps"] == [[answer.choices[0].text]]
