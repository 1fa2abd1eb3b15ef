"""The HTTP process's side of the engine pipe: the asyncio loop reads it without ever blocking,
even when the engine stops in the middle of a message (issue 16 point 6)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import struct
import threading
import time
import types

import pytest

from axon.engine.client import EngineClient, EngineError, Liveness
from axon.engine.engine_proc import wire_update
from axon.engine.pipe_reader import PipeReader
from axon.outputs import TokenUpdate
from axon.sampling_params import SamplingParams


def frame(message, long_header: bool = False) -> bytes:
    """`message` as multiprocessing.Connection.send writes it (the long header is what it
    writes for a payload over 2 GiB)."""
    payload = pickle.dumps(message)
    if long_header:
        return struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload
    return struct.pack("!i", len(payload)) + payload


@pytest.fixture
def pipe():
    ours, theirs = mp.Pipe()
    reader = PipeReader(ours)
    yield reader, theirs
    reader.close()
    ours.close()
    theirs.close()


def test_a_message_is_returned_only_once_whole(pipe):
    reader, theirs = pipe
    data = frame(("reply", 7, True, "x" * 1000)) + frame(("heartbeat",))
    for cut in (2, 4, 600):  # inside the header, right after it, inside the payload
        os.write(theirs.fileno(), data[:cut])
        assert reader.read() == []  # returns at once: nothing is complete yet
        os.write(theirs.fileno(), data[cut:])
        assert reader.read() == [("reply", 7, True, "x" * 1000), ("heartbeat",)]
        assert not reader.buffer


def test_what_connection_send_writes_is_read_back(pipe):
    reader, theirs = pipe
    big = ("reply", 1, True, bytes(range(256)) * 2000)  # several reads of CHUNK bytes
    sender = threading.Thread(target=lambda: [theirs.send(big), theirs.send(("heartbeat",))])
    sender.start()
    received, deadline = [], time.monotonic() + 10
    while len(received) < 2 and time.monotonic() < deadline:
        received += reader.read()
    sender.join()
    assert received == [big, ("heartbeat",)]


def test_the_long_header_and_the_end_of_the_pipe(pipe):
    reader, theirs = pipe
    data = frame(("heartbeat",), long_header=True)
    os.write(theirs.fileno(), data[:8])
    assert reader.read() == []
    os.write(theirs.fileno(), data[8:])
    assert reader.read() == [("heartbeat",)]
    theirs.close()
    assert reader.read() == [] and reader.eof


def test_updates_cross_the_pipe_as_tuples_and_come_back_equal(pipe):
    reader, theirs = pipe
    update = TokenUpdate("r", 1, 42, finish_reason="length", num_cached_tokens=3)
    theirs.send(("updates", [wire_update(update)]))
    ((kind, [fields]),) = reader.read()
    assert kind == "updates" and isinstance(fields, tuple)
    assert TokenUpdate(*fields) == update


def test_logprobs_cross_the_pipe_without_the_sampler_class():
    """The HTTP process is torch-free: unpickling a TokenLogprobs would import the sampler."""
    from axon.engine.pipe_reader import WireLogprobs
    from axon.sampling import TokenLogprobs

    logprobs = TokenLogprobs(token_id=42, logprob=-0.5, rank=1, top=[(42, -0.5), (7, -1.5)])
    wire = wire_update(TokenUpdate("r", 0, 42, logprobs=logprobs))
    assert b"axon.sampling" not in pickle.dumps(wire)
    assert WireLogprobs(*wire[3]) == (42, -0.5, 1, [(42, -0.5), (7, -1.5)])


def _stalled_engine_scenario() -> dict:
    """An "engine" (a real child process and a real pipe) that writes half of a step's update
    and then stops: the loop must keep running meanwhile, deliver the update once the rest
    arrives, and declare the engine wedged when it then stays silent."""
    seen: dict = {}

    async def main() -> None:
        ours, theirs = mp.Pipe()
        process = mp.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
        process.start()
        liveness = Liveness(step_timeout_s=1.0)
        config = types.SimpleNamespace(model="stalled")
        client = EngineClient(config, process, ours, {}, liveness)
        try:
            stream = client.generate("r", [1, 2], SamplingParams(max_tokens=4))
            update = TokenUpdate("r", 0, 5)
            data = frame(("updates", [wire_update(update)]))
            os.write(theirs.fileno(), data[: len(data) // 2])
            ticks = 0
            for _ in range(5):  # the loop runs on while the message is half there
                await asyncio.sleep(0.02)
                ticks += 1
            seen["ticks"] = ticks
            os.write(theirs.fileno(), data[len(data) // 2 :])
            seen["first"] = await asyncio.wait_for(anext(stream), 5)
            os.write(theirs.fileno(), data[:3])  # and now it stops for good
            try:
                await asyncio.wait_for(anext(stream), 10)
            except EngineError as exc:
                seen["error"] = str(exc)
        finally:
            await client.shutdown(timeout=1)
            theirs.close()
        seen["exitcode"] = process.exitcode

    asyncio.run(main())
    return seen


def test_an_engine_stopped_mid_message_never_blocks_the_loop():
    outcome: dict = {}
    worker = threading.Thread(target=lambda: outcome.update(_stalled_engine_scenario()))
    worker.daemon = True  # a loop blocked in a read would hang here: the join below fails
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the event loop blocked on a half-written message"
    assert outcome["ticks"] == 5
    assert outcome["first"] == TokenUpdate("r", 0, 5)
    assert "step deadline" in outcome["error"]
    assert outcome["exitcode"] is not None  # the wedged "engine" was killed
