"""`axon bench serve`'s pieces without a server: vLLM's metric definitions on hand-made
timestamps, the SSE chunk rule, the sweep flags, and the prompt sources."""

from __future__ import annotations

import json
import math
import random
import sys

import httpx
import numpy as np
import pytest

from axon.bench.client import BenchPrompt, RequestConfig, is_output_chunk, request_body
from axon.bench.metrics import RequestResult, level_metrics, percentile
from axon.bench.prompts import (
    ServerTokenizer,
    WordCounter,
    dataset_prompts,
    random_prompts,
    read_dataset,
)
from axon.bench.serve import sweep_levels
from axon.cli import build_parser


def streamed(prompt_len: int, chunk_times: list[float], output_tokens: int) -> RequestResult:
    """A successful request whose output chunks arrived at `chunk_times` (s after the send)."""
    result = RequestResult(prompt_len=prompt_len)
    for elapsed in chunk_times:
        result.record_chunk(elapsed)
    result.output_tokens = output_tokens
    result.success = True
    return result


def test_one_request_ttft_itl_e2e_tpot():
    result = streamed(10, [0.1, 0.15, 0.25, 0.30], output_tokens=4)
    assert result.ttft == pytest.approx(0.1)
    assert result.latency == pytest.approx(0.3)
    assert result.itl == pytest.approx([0.05, 0.10, 0.05])
    assert result.tpot == pytest.approx((0.3 - 0.1) / 3)
    # a chunk carrying several tokens: TPOT divides by the usage's token count, not the chunks
    assert streamed(10, [0.2, 0.6], output_tokens=5).tpot == pytest.approx(0.4 / 4)
    assert streamed(10, [0.5], output_tokens=1).tpot is None  # no TPOT for one token


def test_level_metrics_match_hand_computed_values():
    results = [
        streamed(10, [0.1, 0.15, 0.25, 0.30], output_tokens=4),
        streamed(20, [0.2, 0.6], output_tokens=5),
        streamed(30, [0.5], output_tokens=1),
        RequestResult(prompt_len=40, error="HTTP 500"),  # failed: counted in none of the sums
    ]
    m = level_metrics(results, duration_s=2.0)
    assert (m["num_prompts"], m["completed"], m["failed"]) == (4, 3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 10)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["total_token_throughput"] == pytest.approx(35.0)
    # TTFT [100, 200, 500] ms: p90 at rank 1.8 = 200 + 0.8 * 300, p99 at 1.98
    expected = {"mean": 800 / 3, "median": 200, "p50": 200, "p90": 440, "p99": 494}
    expected["std"] = math.sqrt(
        ((100 - 800 / 3) ** 2 + (200 - 800 / 3) ** 2 + (500 - 800 / 3) ** 2) / 3
    )
    for stat, value in expected.items():
        assert m[f"{stat}_ttft_ms"] == pytest.approx(value), stat
    # TPOT [66.67, 100] ms (the one-token request has none)
    assert m["mean_tpot_ms"] == pytest.approx((200 / 3 + 100) / 2)
    assert m["p90_tpot_ms"] == pytest.approx(200 / 3 + 0.9 * (100 - 200 / 3))
    # ITL pooled over requests: [50, 100, 50, 400] ms
    assert m["mean_itl_ms"] == pytest.approx(150)
    assert m["median_itl_ms"] == pytest.approx(75)
    assert m["p90_itl_ms"] == pytest.approx(100 + 0.7 * 300)
    assert m["p99_itl_ms"] == pytest.approx(100 + 0.97 * 300)
    # E2E [300, 600, 500] ms
    assert m["mean_e2el_ms"] == pytest.approx(1400 / 3)
    assert m["p50_e2el_ms"] == pytest.approx(500)
    assert m["p99_e2el_ms"] == pytest.approx(598)


def test_metrics_of_no_tokens_are_null_and_custom_percentiles_are_keys():
    m = level_metrics([streamed(5, [0.5], output_tokens=1)], 1.0, percentiles=(99.9,))
    assert m["mean_tpot_ms"] is None and m["p99.9_tpot_ms"] is None
    assert m["mean_itl_ms"] is None
    assert m["p99.9_ttft_ms"] == pytest.approx(500)
    assert "p99_ttft_ms" not in m


def test_percentile_is_numpys_linear_interpolation():
    rng = random.Random(3)
    values = [rng.random() for _ in range(37)]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_output_chunks():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    token = {"choices": [{"index": 0, "delta": {"content": "w17"}}]}
    thought = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 3}}
    assert [is_output_chunk(c, "chat") for c in (role, token, thought, finish, usage)] == [
        False,
        True,
        True,
        False,
        False,
    ]
    # a model without a tokenizer streams empty text: still one token per chunk
    assert is_output_chunk({"choices": [{"text": "", "finish_reason": None}]}, "completions")
    assert not is_output_chunk(usage, "completions")


def test_request_bodies_control_the_output_length():
    prompt = BenchPrompt("hello world", 2, 7)
    chat = request_body(RequestConfig("http://x", "chat", "m"), prompt)
    assert chat["messages"] == [{"role": "user", "content": "hello world"}]
    assert (chat["max_tokens"], chat["ignore_eos"], chat["stream"]) == (7, True, True)
    assert chat["stream_options"] == {"include_usage": True}
    plain = request_body(RequestConfig("http://x", "completions", "m", ignore_eos=False), prompt)
    assert plain["prompt"] == "hello world" and "ignore_eos" not in plain


def parse(*argv: str):
    return build_parser().parse_args(["bench", "serve", *argv])


def test_sweep_flags():
    assert sweep_levels(parse()) == [(1, math.inf), (4, math.inf), (16, math.inf)]
    assert sweep_levels(parse("--concurrency", "2,8")) == [(2, math.inf), (8, math.inf)]
    assert sweep_levels(parse("--request-rate", "0.5,inf")) == [(None, 0.5), (None, math.inf)]
    capped = parse("--request-rate", "1,2", "--concurrency", "4")
    assert sweep_levels(capped) == [(4, 1.0), (4, 2.0)]
    with pytest.raises(ValueError, match="not both"):
        sweep_levels(parse("--request-rate", "1,2", "--concurrency", "4,8"))
    for bad in (["--concurrency", "0"], ["--concurrency", "a"], ["--metric-percentiles", "101"]):
        with pytest.raises(SystemExit):
            parse(*bad)


def test_random_prompts_without_a_tokenizer_are_words():
    prompts = random_prompts(WordCounter(), 3, input_len=12, output_len=5, seed=1)
    assert [len(p.prompt.split()) for p in prompts] == [12, 12, 12]
    assert [(p.prompt_len, p.output_len) for p in prompts] == [(12, 5)] * 3
    assert len({p.prompt for p in prompts}) == 3  # no shared prompt for the prefix cache
    assert prompts == random_prompts(WordCounter(), 3, 12, 5, seed=1)


def test_dataset_files(tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "one two three", "output_len": 9}\n\n{"prompt": "four"}\n')
    assert read_dataset(jsonl) == [("one two three", 9), ("four", None)]
    prompts = dataset_prompts(WordCounter(), jsonl, num_prompts=5, output_len=None, seed=0)
    assert sorted({(p.prompt, p.prompt_len, p.output_len) for p in prompts}) == [
        ("four", 1, 128),
        ("one two three", 3, 9),
    ]
    assert len(prompts) == 5  # the file repeats to fill num_prompts
    sharegpt = tmp_path / "sharegpt.json"
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": "hi there"},
                {"from": "gpt", "value": "a b c d"},
            ]
        },
        {"conversations": [{"from": "gpt", "value": "no question"}]},  # skipped
    ]
    sharegpt.write_text(json.dumps(conversations))
    [only] = dataset_prompts(WordCounter(), sharegpt, 1)
    assert (only.prompt, only.prompt_len, only.output_len) == ("hi there", 2, 4)
    [fixed] = dataset_prompts(WordCounter(), sharegpt, 1, output_len=3)
    assert fixed.output_len == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_dataset(bad)


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    from axon.bench.plot import require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if missing
    with pytest.raises(ValueError, match=r"pip install 'axon\[bench\]'"):
        require_matplotlib()


def llama_server_routes(request: httpx.Request) -> httpx.Response:
    """llama-server's /tokenize and /detokenize: `content` in, `tokens` out (and back); a body
    without `content` tokenizes to nothing rather than failing."""
    body = json.loads(request.content)
    if request.url.path == "/tokenize":
        words = body.get("content", "").split()
        return httpx.Response(200, json={"tokens": [len(word) for word in words]})
    if request.url.path == "/detokenize":
        return httpx.Response(200, json={"content": " ".join("x" * t for t in body["tokens"])})
    return httpx.Response(404)


def test_server_tokenizer_speaks_llama_servers_shape_and_cuts_exact_lengths():
    transport = httpx.MockTransport(llama_server_routes)
    with httpx.Client(transport=transport, base_url="http://peer") as client:
        tokenizer = ServerTokenizer.probe(client, "m")
        assert tokenizer is not None and tokenizer.encode("ab c") == [2, 1]
        [prompt] = random_prompts(tokenizer, 1, input_len=5, output_len=3, send_token_ids=True)
        assert len(prompt.prompt) == prompt.prompt_len == 5  # token ids, cut to the length
    missing = httpx.MockTransport(lambda request: httpx.Response(404))
    with httpx.Client(transport=missing, base_url="http://peer") as client:
        assert ServerTokenizer.probe(client, "m") is None  # then prompts are counted in words


def test_draft_counts_from_axons_usage_and_llama_servers_timings():
    from axon.bench.client import _read_timings, _read_usage

    axon = RequestResult(prompt_len=3)
    details = {"accepted_prediction_tokens": 7, "rejected_prediction_tokens": 3}
    assert _read_usage(axon, {"completion_tokens": 12, "completion_tokens_details": details}) == 12
    assert (axon.draft_tokens, axon.accepted_tokens) == (10, 7)
    llama = RequestResult(prompt_len=3)
    _read_timings(llama, {"predicted_n": 12, "draft_n": 8, "draft_n_accepted": 5})
    assert (llama.draft_tokens, llama.accepted_tokens) == (8, 5)
    plain = RequestResult(prompt_len=3)
    _read_usage(plain, {"completion_tokens": 4})
    _read_timings(plain, {"predicted_n": 4})
    assert (plain.draft_tokens, plain.accepted_tokens) == (0, 0)
    for result in (axon, llama, plain):
        result.record_chunk(0.1)
        result.success = True
    m = level_metrics([axon, llama, plain], 1.0)
    assert (m["total_draft_tokens"], m["total_accepted_tokens"]) == (18, 12)
