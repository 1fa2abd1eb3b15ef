"""Tensor parallelism over two "nodes" on one machine (loopback TCP rendezvous, gloo): node 1 is
a real `axon serve --headless` process, node 0 an LLM with nnodes=2; TP=2, one rank per node,
computes what TP=1 does, and node 1 exits when node 0 shuts down; the same through `axon serve`."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest
import torch

from axon import LLM, SamplingParams
from axon.cli import build_parser
from axon.config import EngineConfig
from axon.distributed.parallel_state import ALLREDUCE_ENV, tp_allreduce_path
from axon.distributed.workers import STEP_TIMEOUT_ENV, RankFailed
from axon.server.lifecycle.multinode import multinode_args
from tests.model.tiny_models import get_tiny_model, random_prompts
from tests.server.conftest import (
    MODEL_ID,
    _serve_args,
    _wait_until_serving,
    spawn_serve,
    stop_server,
    write_tiny_qwen3,
)

ENGINE_ARGS = dict(
    dtype="float32",
    block_size=4,
    max_model_len=128,
    kv_cache_memory=1 << 20,
    max_num_batched_tokens=16,  # chunks the longer prompts
)
PROMPT_LENGTHS = (9, 21, 30, 5)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return get_tiny_model("qwen3", tiny_model_root)  # 4 heads over 2 KV heads


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_chat_qwen3"))  # with a tokenizer


@pytest.fixture(scope="module")
def single(tiny):
    return LLM(str(tiny.path), **ENGINE_ARGS)


def start_two_nodes(model_dir, log) -> tuple[LLM, subprocess.Popen]:
    """Node 1 (`axon serve --headless`, logging to `log`) first, then node 0's LLM, which it
    waits for in the rendezvous."""
    port = free_port()
    command = [sys.executable, "-m", "axon", "serve", "--headless", "--node-rank", "1"]
    command += ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    command += ["--tensor-parallel-size", "2", str(model_dir)]
    with open(log, "w") as out:
        node1 = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    # Both "nodes" share this host: gloo is asked for, as ranks on two hosts would use.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ALLREDUCE_ENV, "gloo")
        try:
            llm = LLM(
                str(model_dir),
                tensor_parallel_size=2,
                nnodes=2,
                node_rank=0,
                master_addr="127.0.0.1",
                master_port=port,
                **ENGINE_ARGS,
            )
        except BaseException:
            node1.kill()
            print(log.read_text())
            raise
    return llm, node1


@pytest.fixture(scope="module")
def two_nodes(tiny, tmp_path_factory):
    """(node 0's LLM, node 1's process, node 1's log)."""
    log = tmp_path_factory.mktemp("node1") / "node1.log"
    llm, node1 = start_two_nodes(tiny.path, log)
    yield llm, node1, log
    llm.engine.close()
    if node1.poll() is None:
        node1.kill()
        node1.wait()


def test_ranks_span_the_nodes(two_nodes):
    llm, node1, _ = two_nodes
    workers = llm.engine.runner.workers
    assert workers.processes == [] and workers.control is not None  # rank 1 is node 1's
    assert tp_allreduce_path() == "gloo"
    assert llm.engine.runner.model.model.layers[0].self_attn.num_heads == 2
    assert node1.poll() is None


def test_logits_equal_single_rank(two_nodes, single):
    llm, _, _ = two_nodes
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    expected = single.engine.forward_logits(prompts)
    got = llm.engine.forward_logits(prompts)
    for want, have in zip(expected, got):
        assert want.shape == have.shape == (single.engine.runner.vocab_size,)
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5)


def test_greedy_tokens_equal_single_rank(two_nodes, single):
    llm, _, _ = two_nodes
    prompts = [{"prompt_token_ids": p} for p in random_prompts(PROMPT_LENGTHS, seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert all(len(tokens) == 12 for tokens in got)


def test_node1_exits_when_node0_shuts_down(two_nodes):
    llm, node1, log = two_nodes
    llm.engine.close()
    assert node1.wait(timeout=30) == 0, log.read_text()
    assert "rank 0 shut the ranks down" in log.read_text()


def test_a_dead_node_fails_the_next_step(tiny, tmp_path, monkeypatch):
    """kill -9 of node 1: rank 0's next step raises a process-group fault (which poisons a
    served model) instead of waiting for it."""
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "10")
    llm, node1 = start_two_nodes(tiny.path, tmp_path / "node1.log")
    try:
        node1.kill()
        node1.wait()
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        with pytest.raises(RankFailed, match="process group"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)
    finally:
        llm.engine.close()


def test_axon_serve_across_two_nodes(tiny_chat_model):
    """`axon serve` as node 0 (HTTP, rank 0) and `axon serve --headless` as node 1: MODEL
    answers greedy requests as a TP=1 copy loaded beside it does; node 1 exits with the server."""
    port, model = free_port(), str(tiny_chat_model)
    flags = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    flags += ["--tensor-parallel-size", "2"]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "axon", "serve", "--headless", "--node-rank", "1", *flags, model],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {"AXON_ALLOWED_LOCAL_MODEL_PATHS": model, ALLREDUCE_ENV: "gloo"}
    server = spawn_serve([*_serve_args(tiny_chat_model), *flags, "--node-rank", "0"], env)
    try:
        _wait_until_serving(server)
        spec = {"model_id": model, "served_model_name": "tiny-tp1"}
        assert httpx.post(server.base_url + "/models/load", json=spec, timeout=120).is_success
        body = {"prompt": "w10 w11 w12", "max_tokens": 8, "temperature": 0}
        texts = [
            httpx.post(
                server.openai_url + "/completions", json={**body, "model": name}, timeout=60
            ).json()["choices"][0]["text"]
            for name in (MODEL_ID, "tiny-tp1")
        ]
        assert texts[0] == texts[1] and texts[0]
    finally:
        stop_server(server)
        try:
            assert node1.wait(timeout=30) == 0
        finally:
            if node1.poll() is None:
                node1.kill()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"nnodes": 2, "tensor_parallel_size": 3}, "tensor_parallel_size must be a multiple"),
        ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2}, r"node_rank must be in \[0"),
        ({"nnodes": 0}, "nnodes must be >= 1"),
        ({"master_port": 70000}, "master_port must be in"),
    ],
)
def test_bad_multinode_config_names_the_value(flags, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **flags)


def test_serve_flags_for_other_nodes_need_headless(tiny):
    parse = build_parser().parse_args
    ns = parse(["serve", "--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2", "m"])
    with pytest.raises(ValueError, match="--node-rank 1 serves no HTTP: add --headless"):
        multinode_args(ns)
    with pytest.raises(ValueError, match="apply to MODEL"):
        multinode_args(parse(["serve", "--nnodes", "2"]))
    assert multinode_args(parse(["serve", "m"])) == {}
    # A node other than 0 holds no engine: LLM (an engine) refuses it by name.
    with pytest.raises(ValueError, match="node_rank 1 holds no engine"):
        LLM(str(tiny.path), tensor_parallel_size=2, nnodes=2, node_rank=1, **ENGINE_ARGS)
