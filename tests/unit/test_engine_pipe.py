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
from axon.engine.messages import Heartbeat, Reply, Updates, WireLogprobs, encode
from axon.engine.pipe_reader import PipeReader
from axon.outputs import TokenUpdate
from axon.sampling_params import SamplingParams


def frame(message, long_header: bool = False) -> bytes:
    """`message` as multiprocessing.Connection.send_bytes writes it (the long header is what it
    writes for a payload over 2 GiB)."""
    payload = encode(message)
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
    data = frame(Reply(7, True, "x" * 1000)) + frame(Heartbeat())
    for cut in (2, 4, 600):  # inside the header, right after it, inside the payload
        os.write(theirs.fileno(), data[:cut])
        assert reader.read() == []  # returns at once: nothing is complete yet
        os.write(theirs.fileno(), data[cut:])
        assert reader.read() == [Reply(7, True, "x" * 1000), Heartbeat()]
        assert not reader.buffer


def test_what_connection_send_bytes_writes_is_read_back(pipe):
    reader, theirs = pipe
    big = Reply(1, True, bytes(range(256)) * 2000)  # several reads of CHUNK bytes
    messages = [encode(big), encode(Heartbeat())]
    sender = threading.Thread(target=lambda: [theirs.send_bytes(data) for data in messages])
    sender.start()
    received, deadline = [], time.monotonic() + 10
    while len(received) < 2 and time.monotonic() < deadline:
        received += reader.read()
    sender.join()
    assert received == [big, Heartbeat()]


def test_the_long_header_and_the_end_of_the_pipe(pipe):
    reader, theirs = pipe
    data = frame(Heartbeat(), long_header=True)
    os.write(theirs.fileno(), data[:8])
    assert reader.read() == []
    os.write(theirs.fileno(), data[8:])
    assert reader.read() == [Heartbeat()]
    theirs.close()
    assert reader.read() == [] and reader.eof


def test_updates_cross_the_pipe_as_tuples_and_come_back_equal(pipe):
    reader, theirs = pipe
    update = TokenUpdate("r", 1, 42, finish_reason="length", num_cached_tokens=3)
    theirs.send_bytes(encode(Updates([update])))
    (message,) = reader.read()
    assert pickle.loads(encode(Updates([update]))) == [tuple(update)]  # no class on the wire
    assert message == Updates([update])


def test_logprobs_cross_the_pipe_without_the_sampler_class(pipe):
    """The HTTP process is torch-free: unpickling a TokenLogprobs would import the sampler."""
    from axon.sampling import TokenLogprobs

    reader, theirs = pipe
    logprobs = TokenLogprobs(token_id=42, logprob=-0.5, rank=1, top=[(42, -0.5), (7, -1.5)])
    data = encode(Updates([TokenUpdate("r", 0, 42, logprobs=logprobs)]))
    assert b"axon.sampling" not in data
    theirs.send_bytes(data)
    ((update,),) = [message.updates for message in reader.read()]
    assert type(update.logprobs) is WireLogprobs
    assert update.logprobs == (42, -0.5, 1, [(42, -0.5), (7, -1.5)])


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
            data = frame(Updates([update]))
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
