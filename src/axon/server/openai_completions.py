"""`POST /v1/completions`, and the machinery every generating route shares: admitting a request
(`Generation.start`), aborting it when the client goes away (`or_disconnect`, `EventStream`),
merging several prompts' streams, SSE framing, and the metrics hooks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable

from fastapi import APIRouter, Request
from starlette.responses import StreamingResponse

from axon.engine.output_processor import RequestState
from axon.server.errors import BadRequest, EngineDead
from axon.server.metrics import RequestObserver
from axon.server.offload import off_loop
from axon.server.protocol import (
    CompletionRequest,
    SampleCursor,
    completion_logprobs,
    error_event,
    finish_reason,
    now,
    parse_request,
    random_id,
    sse,
    usage,
)
from axon.server.sampling import build_sampling_params, check_prompt_ids

logger = logging.getLogger(__name__)
router = APIRouter()


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


# ---- one admitted request -----------------------------------------------------------------


class Generation:
    """One admitted request. Iterating yields its RequestState as it changes; closing it (or
    leaving the iteration) aborts the request in the engine."""

    def __init__(self, stream: AsyncIterator[RequestState], first: RequestState, observer):
        self.stream, self.state, self.observer = stream, first, observer
        observer.update(first)

    @classmethod
    async def start(
        cls,
        model,
        prompt_ids: list[int],
        params,
        prompt: str | None,
        started_at,
        checked=False,
        images: dict | None = None,
    ):
        """Admits the request: raises the engine's admission errors (context length, overload,
        unavailable) before any response is sent. `checked`: the caller has checked the
        model's capacity for it (and its siblings) already. `images`: the engine's image
        inputs for a prompt with expanded placeholders."""
        stream = model.generate(
            prompt_ids, params, prompt=prompt, capacity_checked=checked, images=images
        )
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            raise EngineDead(f"model {model.id!r} ended the request without output") from None
        except BaseException:
            await stream.aclose()
            raise
        return cls(stream, first, RequestObserver(model.id, started_at))

    @classmethod
    async def of_chat(cls, model, prepared, started_at):
        """`start` for a prepared chat request (openai_chat.PreparedChat)."""
        return await cls.start(
            model,
            prepared.prompt_ids,
            prepared.params,
            prepared.text,
            started_at,
            images=prepared.images,
        )

    async def __aiter__(self) -> AsyncIterator[RequestState]:
        try:
            yield self.state
            while not self.state.finished:
                self.state = await anext(self.stream)
                self.observer.update(self.state)
                yield self.state
        except StopAsyncIteration:
            return
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self.observer is not None:
            observer, self.observer = self.observer, None
            await self.stream.aclose()
            observer.finish(self.state)

    async def collect(self) -> RequestState:
        """Runs the request to the end; returns its final state."""
        async for _ in self:
            pass
        return self.state


async def start_all(model, prompts: list[tuple[str | None, list[int]]], params, started_at):
    """Admits every prompt, or none: the model's capacity is checked once for all of them,
    and a later rejection closes the ones already admitted."""
    model.check_capacity(len(prompts) * params.n, sum(len(ids) for _, ids in prompts))
    generations: list[Generation] = []
    try:
        for text, ids in prompts:
            start = Generation.start(model, ids, params, text, started_at, checked=True)
            generations.append(await start)
    except BaseException:
        for generation in generations:
            await generation.aclose()
        raise
    return generations


def close_all(generations: list[Generation]):
    """A coroutine function that closes every one of `generations`."""

    async def close() -> None:
        for generation in generations:
            await generation.aclose()

    return close


async def merge(generations: list[Generation]) -> AsyncIterator[tuple[int, RequestState]]:
    """(prompt index, state) from all generations as they progress, one engine update at a
    time: a generation does not advance until its last state has been consumed, so that state
    is never mutated under the consumer. Closing the iterator aborts them all."""
    if len(generations) == 1:  # the common case needs no task, queue and event per token
        async with contextlib.aclosing(aiter(generations[0])) as states:
            async for state in states:
                yield 0, state
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for state in generation:
                consumed = asyncio.Event()
                await queue.put((index, state, None, consumed))
                await consumed.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, None, exc, None))
        await queue.put((index, None, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, state, error, consumed = await queue.get()
            if error is not None:
                raise error
            if state is None:
                remaining -= 1
                continue
            yield index, state
            consumed.set()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for generation in generations:
            await generation.aclose()


# ---- the client going away ----------------------------------------------------------------


async def _until_disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def or_disconnect(request: Request, work: Awaitable):
    """`await work`, unless the client disconnects first: then `work` is cancelled (which aborts
    its engine requests) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.done() and not task.cancelled():
        return task.result()  # even if the client is gone too: the caller owns what it made
    raise ClientDisconnected()


class EventStream(StreamingResponse):
    """An SSE response whose generator is closed the moment the client disconnects, even while
    it waits for the next token, so the engine request is aborted within a step."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close=None):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers=headers)
        self.on_close = on_close  # awaited last: frees what `content` holds if it never started

    async def __call__(self, scope, receive, send) -> None:
        sender = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_until_disconnected(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, watcher):
                task.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
            await self.body_iterator.aclose()
            if self.on_close is not None:
                await self.on_close()
        failure = sender.exception() if sender.done() and not sender.cancelled() else None
        if failure is not None and not isinstance(failure, OSError):  # OSError: client gone
            raise failure


def served_model(request: Request, model_id: str):
    """The loaded model `model_id`; raises ModelNotFound (404) or ModelUnavailable (503)."""
    return request.app.state.axon.registry.get(model_id)


# ---- /v1/completions ----------------------------------------------------------------------


def vocab_size(model) -> int | None:
    """The model's vocabulary size as its engine reports it (else the tokenizer's)."""
    info = getattr(getattr(model, "client", None), "info", None) or {}
    size = getattr(model, "vocab_size", None) or info.get("vocab_size")
    return size or (len(model.tokenizer) if model.tokenizer is not None else None)


def _prompts(body: CompletionRequest, model) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) of each prompt the request carries."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise BadRequest("prompt must not be empty", param="prompt")
    vocab = vocab_size(model)
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            ids = model.encode(item, add_special_tokens=body.add_special_tokens, param="prompt")
            prompts.append((item, check_prompt_ids(ids, "prompt")))
            continue
        if not item or any(t < 0 or (vocab and t >= vocab) for t in item):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        prompts.append((None, list(item)))
    return prompts


@router.post("/v1/completions")
async def create_completion(request: Request):
    started_at = time.monotonic()
    body = await off_loop(parse_request, await request.body(), CompletionRequest)
    if body.echo or body.suffix:
        raise BadRequest(
            "echo and suffix are not supported", param="echo" if body.echo else "suffix"
        )
    model = served_model(request, body.model)
    prompts, params = await off_loop(_prepare, body, model)
    generations = await or_disconnect(request, start_all(model, prompts, params, started_at))
    context = _CompletionContext(body, model, params)
    if body.stream:
        return EventStream(_completion_stream(generations, context), close_all(generations))
    states = await or_disconnect(request, asyncio.gather(*(g.collect() for g in generations)))
    return await off_loop(context.response, states)


def _prepare(body: CompletionRequest, model) -> tuple[list, object]:
    """The prompts' (text, token ids) and the sampling params: request-sized, off the loop."""
    prompts = _prompts(body, model)
    longest = max(len(ids) for _, ids in prompts)
    params = build_sampling_params(
        body,
        longest,
        model.max_model_len,
        model.generation_defaults,
        prompt_field="prompt",
        vocab_size=vocab_size(model),
    )
    return prompts, params


class _CompletionContext:
    """One completions request's constants and the builders of its choices."""

    def __init__(self, body: CompletionRequest, model, params):
        self.body, self.model, self.params = body, model, params
        self.id, self.created = random_id("cmpl-"), now()
        self._chunk_head: str | None = None  # a chunk's serialized start, up to its choice

    def decode(self, token_id: int) -> str:
        tokenizer = self.model.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

    def logprobs(self, sample, positions: range, text_offset: int) -> dict | None:
        if self.params.logprobs is None or sample.logprobs is None or not positions:
            return None
        ids = sample.token_ids[positions.start : positions.stop]
        entries = sample.logprobs[positions.start : positions.stop]
        return completion_logprobs(ids, entries, self.params.logprobs, self.decode, text_offset)

    def choice(self, prompt_index: int, sample, text: str, logprobs, finished: bool) -> dict:
        return {
            "index": prompt_index * self.params.n + sample.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(sample.finish_reason) if finished else None,
            "stop_reason": sample.stop_reason if finished else None,
        }

    def chunk(self, choice: dict) -> str:
        """Return the SSE event of one streamed choice: `sse(self.body_of([choice]))`, with the
        request's constant fields serialized once and only the text encoded for a plain token
        (no logprobs, not the last), which is most of them."""
        if choice["logprobs"] is not None or choice["finish_reason"] is not None:
            return sse(self.body_of([choice]))
        if self._chunk_head is None:
            head = sse(self.body_of([]))  # 'data: {..."choices":[]}\n\n'
            self._chunk_head = head[: -len("]}\n\n")]
        text = json.dumps(choice["text"], ensure_ascii=False)
        return (
            f'{self._chunk_head}{{"index":{choice["index"]},"text":{text},'
            '"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        )

    def body_of(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model.id,
            "choices": choices,
            **extra,
        }

    def usage(self, states: list[RequestState]) -> dict:
        prompt_tokens = sum(len(state.prompt_token_ids) for state in states)
        generated = sum(len(s.token_ids) for state in states for s in state.samples)
        cached = sum(state.samples[0].num_cached_tokens for state in states)
        return usage(prompt_tokens, generated, cached)

    def response(self, states: list[RequestState]) -> dict:
        choices = []
        for prompt_index, state in enumerate(states):
            for sample in state.samples:
                positions = range(len(sample.token_ids))
                logprobs = self.logprobs(sample, positions, 0)
                choices.append(self.choice(prompt_index, sample, sample.text, logprobs, True))
        return self.body_of(choices, usage=self.usage(states))


async def _completion_stream(generations: list[Generation], context: _CompletionContext):
    cursors = [[SampleCursor() for _ in range(context.params.n)] for _ in generations]
    states: dict[int, RequestState] = {}
    try:
        async with contextlib.aclosing(merge(generations)) as progress:
            async for prompt_index, state in progress:
                states[prompt_index] = state
                for sample, cursor in zip(state.samples, cursors[prompt_index]):
                    offset = cursor.text_offset
                    step = cursor.advance(sample)
                    if step is None:
                        continue
                    text, positions = step
                    logprobs = context.logprobs(sample, positions, offset)
                    if logprobs is not None:
                        cursor.text_offset += sum(len(t) for t in logprobs["tokens"])
                    choice = context.choice(prompt_index, sample, text, logprobs, cursor.done)
                    yield context.chunk(choice)
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which has started
        yield error_event(exc)
    else:
        if context.body.include_usage:
            yield sse(context.body_of([], usage=context.usage(list(states.values()))))
    yield sse("[DONE]")
