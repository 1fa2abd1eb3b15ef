"""The engine process (device worker): requests, commands, abort, fault -> drain-only, shutdown."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from axon import LLM, SamplingParams
from axon.config import EngineConfig
from axon.engine.client import EngineClient, EngineError, EngineLoadTimeout, Liveness
from axon.engine.faults import InjectedDeviceFault, is_device_fault
from tests.model.tiny_models import get_tiny_model, random_prompts

ENGINE_ARGS = dict(dtype="float32", block_size=16, max_model_len=256, kv_cache_memory=4 << 20)


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return get_tiny_model("qwen3", tiny_model_root)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def loop():
    """The event loop of the module's shared engine (a client lives on one loop). Between
    tests it does not run: the engine's heartbeats wait in the pipe, well inside the default
    step deadline (120 s) that the client checks when the loop runs again."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def on(loop, coro):
    """Runs `coro` on `loop` (the shared engine's) and returns its result."""
    return loop.run_until_complete(coro)


@pytest.fixture(scope="module")
def shared(tiny, loop):
    """(client, load progress reports) of one engine for the tests that leave it as they found
    it (no fault, no kill, no stop): an engine start is ~3 CPU-s. Its clean exit is checked
    when the module is done with it."""
    reports: list[tuple[int, int]] = []
    config = EngineConfig.from_kwargs(str(tiny.path), **ENGINE_ARGS)
    client = on(loop, EngineClient.start(config, on_progress=lambda *r: reports.append(r)))
    yield client, reports
    # Let the loop read the heartbeats that came while it did not run, or shutdown would take
    # the engine for a silent one and kill it.
    on(loop, asyncio.sleep(2 * client.liveness.heartbeat_s))
    on(loop, client.shutdown())
    assert not client.process.is_alive() and client.process.exitcode == 0


async def _collect(client: EngineClient, request_id: str, prompt: list[int], params) -> dict:
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    async for update in client.generate(request_id, prompt, params):
        if update.token_id is not None:
            tokens.setdefault(update.index, []).append(update.token_id)
        if update.finish_reason:
            reasons[update.index] = update.finish_reason
    return {"tokens": tokens, "reasons": reasons}


def test_generation_matches_the_in_process_engine(tiny, shared, loop):
    client, reports = shared
    prompts = random_prompts((5, 17, 33), seed=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(str(tiny.path), **ENGINE_ARGS).generate(
            [{"prompt_token_ids": p} for p in prompts], params
        )
    ]

    async def main():
        results = await asyncio.gather(
            *(_collect(client, f"r{i}", p, params) for i, p in enumerate(prompts))
        )
        return results, await client.call("memory"), await client.call("stats")

    results, memory, stats = on(loop, main())
    # The engine reported its weight loading, ending at the checkpoint's size.
    total = sum(f.stat().st_size for f in tiny.path.glob("*.safetensors"))
    assert reports and reports[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in zip(reports, reports[1:]))
    assert [r["tokens"][0] for r in results] == expected
    assert all(r["reasons"][0] == "length" for r in results)
    assert tuple(memory) == (0, 0)  # CPU: no device memory to report, as neuron does
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_abort_frees_blocks_within_a_step(shared, loop):
    client, _ = shared

    async def main():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = client.generate("long", random_prompts((40,), seed=1)[0], params)
        await stream.__anext__()
        busy = await client.call("stats")
        await stream.aclose()  # the client went away
        idle = await client.call("stats")
        return busy, idle

    busy, idle = on(loop, main())
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


def test_a_failed_add_fails_its_request_whatever_the_exception(shared, loop):
    """An `add` the engine cannot take ends its request with an error: before, only a ValueError
    did, and any other exception left the request waiting forever."""
    client, _ = shared

    async def main():
        params = SamplingParams(max_tokens=4)
        object.__setattr__(params, "n", "1")  # range("1") in the engine: a TypeError
        with pytest.raises(EngineError, match="TypeError"):
            await asyncio.wait_for(_collect(client, "bad", [5, 6, 7], params), 30)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        return await _collect(client, "good", [5, 6, 7], params)

    assert len(on(loop, main())["tokens"][0]) == 3


def test_a_failed_step_fails_only_its_own_requests(tiny):
    """With one sequence per step, a plain error in the step fails the running request; the
    waiting one was not in that step and still completes."""
    args = {**ENGINE_ARGS, "max_num_seqs": 1}

    async def main():
        client = await EngineClient.start(EngineConfig.from_kwargs(str(tiny.path), **args))
        try:
            params = SamplingParams(max_tokens=40, ignore_eos=True)
            running = client.generate("running", [5, 6, 7], params)
            await running.__anext__()  # it is in the batch now
            waiting = asyncio.ensure_future(_collect(client, "waiting", [8, 9], params))
            await client.call("inject_step_error")
            with pytest.raises(EngineError, match="injected step error"):
                async for _ in running:
                    pass
            survivor = await asyncio.wait_for(waiting, 60)
            stats = await client.call("stats")
        finally:
            await client.shutdown()
        return survivor, stats, client

    survivor, stats, client = run(main())
    assert len(survivor["tokens"][0]) == 40 and survivor["reasons"][0] == "length"
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert client.poisoned is None  # a plain error does not poison


def test_a_killed_engine_is_noticed_and_its_requests_fail(tiny):
    async def main():
        client = await EngineClient.start(EngineConfig.from_kwargs(str(tiny.path), **ENGINE_ARGS))
        poisoned = []
        client.on_poisoned = poisoned.append
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            stream = client.generate("long", [5, 6, 7], params)
            await stream.__anext__()
            os.kill(client.process.pid, signal.SIGKILL)
            with pytest.raises(EngineError, match="died"):
                await asyncio.wait_for(_drain(stream), 10)
            with pytest.raises(EngineError, match="not running"):
                client.generate("later", [5, 6], params)
        finally:
            await client.shutdown()
        return poisoned

    poisoned = run(main())
    assert len(poisoned) == 1 and "died" in poisoned[0]


def test_a_stopped_engine_misses_its_deadline_and_is_killed(tiny):
    liveness = Liveness(step_timeout_s=2.0)

    async def main():
        config = EngineConfig.from_kwargs(str(tiny.path), **ENGINE_ARGS)
        client = await EngineClient.start(config, liveness=liveness)
        poisoned = []
        client.on_poisoned = poisoned.append
        try:
            stream = client.generate(
                "long", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True)
            )
            await stream.__anext__()
            os.kill(client.process.pid, signal.SIGSTOP)
            with pytest.raises(EngineError, match="step deadline"):
                await asyncio.wait_for(_drain(stream), 30)
        finally:
            await client.shutdown()
        return poisoned, client

    poisoned, client = run(main())
    assert len(poisoned) == 1 and "step deadline" in poisoned[0]
    assert client.process.exitcode == -signal.SIGKILL


async def _drain(stream) -> None:
    async for _ in stream:
        pass


_ORPHAN_SCRIPT = """
import asyncio, sys
from axon.config import EngineConfig
from axon.engine.client import EngineClient

async def main():
    config = EngineConfig.from_kwargs(sys.argv[1], dtype="float32", kv_cache_memory=4 << 20)
    client = await EngineClient.start(config)
    print(client.process.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_engines_die_with_the_http_process(tiny):
    """kill -9 of the process that owns an engine leaves no orphan holding the device, even
    an engine that is wedged (here: stopped) at the time."""
    import subprocess
    import sys
    import time

    owner = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT, str(tiny.path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        engine_pid = int(owner.stdout.readline())
        assert _running(engine_pid)
        # Stopped, it cannot notice its pipe closing: only the parent-death signal reaches it.
        os.kill(engine_pid, signal.SIGSTOP)
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 10
        while _running(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(engine_pid), "the engine outlived its owner"
    finally:
        owner.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_load_past_its_deadline_is_killed(tiny):
    liveness = Liveness(load_timeout_s=0.5)  # spawning alone takes longer

    async def main():
        config = EngineConfig.from_kwargs(str(tiny.path), **ENGINE_ARGS)
        with pytest.raises(EngineLoadTimeout, match="did not load within 0.5s"):
            await EngineClient.start(config, liveness=liveness)

    before = _engine_children()  # the module's shared engine may be one
    run(main())
    assert _engine_children() == before


def test_a_cancelled_start_kills_the_half_started_engine(tiny):
    """An unload while the model loads cancels the start: no engine may be left behind."""

    async def main():
        config = EngineConfig.from_kwargs(str(tiny.path), **ENGINE_ARGS)
        start = asyncio.ensure_future(EngineClient.start(config))
        await asyncio.sleep(0.5)
        assert _engine_children() - before
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start

    before = _engine_children()  # the module's shared engine may be one
    run(main())
    assert _engine_children() == before


def test_shutdown_kills_a_silent_engine_without_waiting_for_it(tiny):
    """An engine that stopped answering (here: SIGSTOP) is killed by shutdown at once, not
    asked to exit and waited for until the deadline."""
    import time

    async def main():
        config = EngineConfig.from_kwargs(str(tiny.path), **ENGINE_ARGS)
        client = await EngineClient.start(config, liveness=Liveness(step_timeout_s=600))
        os.kill(client.process.pid, signal.SIGSTOP)
        await asyncio.sleep(2 * client.liveness.heartbeat_s + 1.5)
        started = time.monotonic()
        await client.shutdown(timeout=60)
        return time.monotonic() - started, client

    elapsed, client = run(main())
    assert client.process.exitcode == -signal.SIGKILL and elapsed < 10


def _engine_children() -> set[int]:
    """This process's live engine children (multiprocessing spawn)."""
    import multiprocessing

    return {child.pid for child in multiprocessing.active_children()}
