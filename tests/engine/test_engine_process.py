"""The engine process (device worker): requests, commands, abort, fault -> drain-only, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from axon import LLM, SamplingParams
from axon.config import EngineConfig
from axon.engine.client import EngineClient, EngineError
from axon.engine.faults import InjectedDeviceFault, is_device_fault
from tests.model.tiny_models import get_tiny_model, random_prompts

ENGINE_ARGS = dict(dtype="float32", block_size=16, max_model_len=256, kv_cache_memory=4 << 20)


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return get_tiny_model("qwen3", tiny_model_root)


def run(coro):
    return asyncio.run(coro)


async def _collect(client: EngineClient, request_id: str, prompt: list[int], params) -> dict:
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    async for update in client.generate(request_id, prompt, params):
        if update.token_id is not None:
            tokens.setdefault(update.index, []).append(update.token_id)
        if update.finish_reason:
            reasons[update.index] = update.finish_reason
    return {"tokens": tokens, "reasons": reasons}


def test_generation_matches_the_in_process_engine(tiny):
    prompts = random_prompts((5, 17, 33), seed=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(tiny.path), **ENGINE_ARGS).generate(
            [{"prompt_token_ids": p} for p in prompts], params
        )
    ]

    async def main():
        client = await EngineClient.start(EngineConfig.from_kwargs(str(tiny.path), **ENGINE_ARGS))
        try:
            results = await asyncio.gather(
                *(_collect(client, f"r{i}", p, params) for i, p in enumerate(prompts))
            )
            memory = await client.call("memory")
            stats = await client.call("stats")
        finally:
            await client.shutdown()
        return results, memory, stats, client

    results, memory, stats, client = run(main())
    assert [r["tokens"][0] for r in results] == expected
    assert all(r["reasons"][0] == "length" for r in results)
    assert tuple(memory) == (0, 0)  # CPU: no device memory to report, as neuron does
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert not client.process.is_alive() and client.process.exitcode == 0


def test_abort_frees_blocks_within_a_step(tiny):
    async def main():
        client = await EngineClient.start(EngineConfig.from_kwargs(str(tiny.path), **ENGINE_ARGS))
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            stream = client.generate("long", random_prompts((40,), seed=1)[0], params)
            await stream.__anext__()
            busy = await client.call("stats")
            await stream.aclose()  # the client went away
            idle = await client.call("stats")
        finally:
            await client.shutdown()
        return busy, idle

    busy, idle = run(main())
    assert busy["num_running"] == 1 and busy["num_free_blocks"] < busy["num_blocks"]
    assert idle["num_running"] == 0 and idle["num_free_blocks"] == idle["num_blocks"]


def test_device_fault_poisons_the_engine_and_it_drains(tiny):
    async def main():
        client = await EngineClient.start(EngineConfig.from_kwargs(str(tiny.path), **ENGINE_ARGS))
        poisoned = []
        client.on_poisoned = poisoned.append
        try:
            await client.call("inject_fault")
            with pytest.raises(EngineError, match="illegal memory access"):
                await _collect(client, "a", [5, 6, 7], SamplingParams(max_tokens=4))
            with pytest.raises(EngineError, match="poisoned"):
                await client.call("stats")
            with pytest.raises(EngineError, match="poisoned"):
                await _collect(client, "b", [5, 6, 7], SamplingParams(max_tokens=4))
        finally:
            await client.shutdown()  # shutdown is honoured even when poisoned
        return poisoned, client

    poisoned, client = run(main())
    assert len(poisoned) == 1 and "illegal memory access" in poisoned[0]
    assert client.poisoned is not None and client.process.exitcode == 0


def test_load_failure_is_reported(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')

    async def main():
        await EngineClient.start(EngineConfig.from_kwargs(str(tmp_path), dtype="float32"))

    with pytest.raises(RuntimeError, match="mamba"):
        run(main())


def test_fault_classification():
    assert is_device_fault(InjectedDeviceFault())
    assert is_device_fault(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_device_fault(ValueError("prompt too long"))
    assert not is_device_fault(RuntimeError("shape mismatch in matmul"))
    assert not is_device_fault(RuntimeError("The size of tensor a (3) must match the size of b"))
    try:
        try:
            raise RuntimeError("tokenize failed")
        except RuntimeError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert not is_device_fault(outer)  # the cause chain is read, as neuron does
