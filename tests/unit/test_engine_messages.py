"""The engine pipe's messages (axon.engine.messages): every type crosses a real pipe and comes
back equal, decoding needs neither torch nor the sampler, and the declared commands are the
engine's."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import subprocess
import sys

import pytest

from axon.engine import messages
from axon.engine.messages import (
    Abort,
    AddRequest,
    Call,
    Failed,
    Heartbeat,
    LoadFailed,
    LoadProgress,
    MalformedMessage,
    Poisoned,
    Ready,
    Reply,
    StopSample,
    Updates,
    WireLogprobs,
    decode,
    encode,
)
from axon.engine.pipe_reader import PipeReader
from axon.outputs import TokenUpdate
from axon.sampling_params import SamplingParams


def every_message() -> list:
    """One message of each type, the fields as the engine and the client fill them."""
    logprobs = WireLogprobs(7, -0.25, 2, [(3, -0.1), (7, -0.25)])
    updates = [
        TokenUpdate("a" * 32, 0, 5, num_cached_tokens=16),
        TokenUpdate("b" * 32, 1, 7, logprobs, "stop", 2, 0),
        TokenUpdate("c", 0, None, finish_reason="length", embedding=[0.5, -1.0]),
    ]
    images = {"pixel_values": [[0.0, 1.0]], "grid_thw": [(1, 2, 2)]}
    return [
        AddRequest("r1", [1, 2, 3], SamplingParams(n=2, logprobs=5, stop=["x"])),
        AddRequest("r2", [4], SamplingParams(), images),
        Abort(["r1", "r2"]),
        StopSample("r1", 1),
        Call(3, "stats"),
        Call(4, "forward_logits", ([[1, 2]],)),
        LoadProgress(10, 100),
        Ready({"max_model_len": 128, "vision": None}),
        LoadFailed("OSError: no weights"),
        Updates(updates),
        Updates([]),
        Failed(["r1"], "ValueError: bad"),
        Reply(3, True, {"num_running": 1}),
        Reply(4, False, "unknown command 'x'"),
        Poisoned("InjectedDeviceFault: injected"),
        Heartbeat(),
    ]


def test_every_message_type_is_covered():
    types = {type(message) for message in every_message()}
    assert types == set(messages._TYPES) | {Updates}


@pytest.mark.parametrize("message", every_message(), ids=lambda m: type(m).__name__)
def test_every_message_crosses_the_pipe_and_comes_back_equal(message):
    ours, theirs = mp.Pipe()
    reader = PipeReader(ours)
    try:
        theirs.send_bytes(encode(message))
        assert reader.read() == [message]
        ours.send_bytes(encode(message))  # the engine's end reads with recv_bytes
        assert decode(theirs.recv_bytes()) == message
    finally:
        reader.close()
        ours.close()
        theirs.close()


def test_sampler_logprobs_come_back_as_wire_logprobs():
    from axon.sampling import TokenLogprobs

    logprobs = TokenLogprobs(token_id=7, logprob=-0.25, rank=2, top=[(3, -0.1), (7, -0.25)])
    (update,) = decode(encode(Updates([TokenUpdate("r", 0, 7, logprobs)]))).updates
    assert type(update) is TokenUpdate and type(update.logprobs) is WireLogprobs
    assert update.logprobs == (7, -0.25, 2, [(3, -0.1), (7, -0.25)])


def test_what_is_no_message_is_refused():
    with pytest.raises(TypeError):
        encode(("reply", 1, True, None))
    for wire in [("reply", 1), (99,), (), {"a": 1}, (messages._TAG[Reply], 1)]:
        with pytest.raises(MalformedMessage):
            decode(pickle.dumps(wire))


def test_decoding_imports_neither_torch_nor_the_sampler():
    """The HTTP process decodes every message the engine sends without importing torch (the
    server's event loop would stall for seconds, and its memory grow by libtorch)."""
    from axon.sampling import TokenLogprobs

    sampled = TokenLogprobs(token_id=7, logprob=-0.25, rank=2, top=[(3, -0.1)])
    frames = [encode(message) for message in every_message()]
    frames.append(encode(Updates([TokenUpdate("r", 0, 7, sampled)])))
    script = (
        "import pickle, sys\n"
        "from axon.engine.messages import decode\n"
        "decoded = [decode(data) for data in pickle.loads(sys.stdin.buffer.read())]\n"
        "print(len(decoded), sorted(m for m in sys.modules"
        " if m.split('.')[0] == 'torch' or m.split('.')[:2] == ['axon', 'sampling']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        input=pickle.dumps(frames),
        capture_output=True,
        check=True,
    )
    assert result.stdout.decode().split() == [str(len(frames)), "[]"], result.stderr.decode()


def test_the_declared_commands_are_the_engines():
    from axon.engine.engine_proc import EngineLoop

    handlers = {name.removeprefix("_cmd_") for name in dir(EngineLoop) if name.startswith("_cmd_")}
    assert set(messages.COMMANDS) == handlers | {"shutdown"}


def test_prompt_logprobs_cross_as_plain_rows():
    prompt = [None, (5, -1.5, 2, [(7, -0.5), (5, -1.5)])]
    (update,) = decode(encode(Updates([TokenUpdate("r", 0, 7, prompt_logprobs=prompt)]))).updates
    assert update.prompt_logprobs == prompt and update.logprobs is None
