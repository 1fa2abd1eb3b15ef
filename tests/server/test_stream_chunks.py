"""The streaming fast paths equal what they replace: pre-serialized completion chunks and the
single-generation merge."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from axon.sampling_params import SamplingParams
from axon.server.generation import merge
from axon.server.routes.openai_completions import _CompletionContext
from axon.server.schemas.protocol import CompletionRequest, sse

TEXTS = ["", " sea", 'a "quoted"\\ back\nslash', "naïve 日本語 🙂", "\u2028\x00\t</script>"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finished", [False, True])
def test_a_chunk_is_byte_for_byte_the_full_serialization(text: str, finished: bool) -> None:
    body = CompletionRequest(model="m", prompt="p")
    context = _CompletionContext(body, SimpleNamespace(id='m "x" ü'), SamplingParams(n=2))
    sample = SimpleNamespace(index=1, finish_reason="length", stop_reason=None)
    for _ in range(2):  # the head is cached after the first chunk
        choice = context.choice(3, sample, text, None, finished)
        chunk = context.chunk(choice)
        assert chunk == sse(context.body_of([choice]))
        assert json.loads(chunk.removeprefix("data: "))["choices"][0]["text"] == text


def test_a_chunk_with_logprobs_keeps_them() -> None:
    context = _CompletionContext(
        CompletionRequest(model="m", prompt="p"), SimpleNamespace(id="m"), SamplingParams()
    )
    sample = SimpleNamespace(index=0, finish_reason=None, stop_reason=None)
    logprobs = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": None, "text_offset": [0]}
    choice = context.choice(0, sample, "a", logprobs, False)
    assert (
        json.loads(context.chunk(choice).removeprefix("data: "))["choices"][0]["logprobs"]
        == logprobs
    )


class FakeGeneration:
    """Yields its states; records being closed (what aborts the engine request)."""

    def __init__(self, states: list[str]) -> None:
        self.states, self.closed = states, False

    async def __aiter__(self):
        try:
            for state in self.states:
                yield state
        finally:
            self.closed = True


def test_merge_of_one_generation_yields_all_and_closes_it_when_left_early() -> None:
    async def run() -> tuple[list, list, bool]:
        whole = FakeGeneration(["a", "b", "c"])
        everything = [item async for item in merge([whole])]
        left = FakeGeneration(["a", "b", "c"])
        progress = merge([left])
        first = await anext(progress)
        await progress.aclose()
        return everything, [first], left.closed

    everything, first, closed = asyncio.run(run())
    assert everything == [(0, "a"), (0, "b"), (0, "c")]
    assert first == [(0, "a")] and closed
