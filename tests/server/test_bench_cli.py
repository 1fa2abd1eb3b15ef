"""`axon bench serve` against the session's real `axon serve` (the tiny Qwen3 of conftest.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from PIL import Image

from axon.bench.client import BenchPrompt, RequestConfig, run_level
from axon.cli import main
from tests.server.conftest import MODEL_ID

INPUT_LEN, OUTPUT_LEN = 16, 8


def test_bench_serve_sweep_writes_json_and_png(server, tmp_path, capsys):
    result_json, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "serve", "--base-url", server.base_url, "--num-prompts", "4"]
    argv += ["--concurrency", "1,2", "--random-input-len", str(INPUT_LEN)]
    argv += ["--random-output-len", str(OUTPUT_LEN), "--disable-tqdm"]
    assert main([*argv, "--result-json", str(result_json), "--plot", str(plot)]) == 0

    result = json.loads(result_json.read_text())
    assert result["model_id"] == MODEL_ID  # the only model /v1/models lists
    assert result["endpoint"] == "completions"
    assert result["prompt_lengths_counted_by"] == "server"  # axon has /tokenize
    assert [level["max_concurrency"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert (level["completed"], level["failed"], level["errors"]) == (4, 0, [])
        assert level["request_rate"] == "inf"
        # token-id prompts of exactly INPUT_LEN; ignore_eos makes every answer OUTPUT_LEN long
        assert level["total_input_tokens"] == 4 * INPUT_LEN
        assert level["total_output_tokens"] == 4 * OUTPUT_LEN
        assert level["output_throughput"] * level["duration"] == pytest.approx(4 * OUTPUT_LEN)
        for metric in ("ttft", "tpot", "itl", "e2el"):
            stats = [level[f"{stat}_{metric}_ms"] for stat in ("p50", "p90", "p99")]
            assert 0 < stats[0] <= stats[1] <= stats[2], metric
            assert level[f"mean_{metric}_ms"] > 0
        assert level["mean_ttft_ms"] < level["mean_e2el_ms"]
    with Image.open(plot) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 400
    out = capsys.readouterr().out
    assert "Serving Benchmark Result: concurrency 2" in out
    assert "| concurrency 1 | 4/4 |" in out


def test_chat_stream_counts_token_chunks_not_the_role_chunk(server):
    """axon sends the role chunk before the prompt is computed: it is not the first token."""
    config = RequestConfig(server.base_url, "chat", MODEL_ID)
    prompts = [BenchPrompt("tell me a story", 3, OUTPUT_LEN)] * 2
    duration, results = asyncio.run(run_level(config, {}, prompts, max_concurrency=2))
    for result in results:
        assert result.success, result.error
        assert result.chunks == result.output_tokens == OUTPUT_LEN  # one chunk per token
        assert len(result.itl) == OUTPUT_LEN - 1
        assert result.prompt_len > 3  # the server's usage: the chat template's tokens too
        assert 0 < result.ttft < result.latency <= duration
