"""The machinery every generating route shares: admitting a request (`Generation.start`, all of
a request's prompts or none with `start_all`), aborting it when the client goes away
(`or_disconnect`, `EventStream`), merging several prompts' streams, and the metrics hooks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from starlette.responses import StreamingResponse

from axon.engine.output_processor import RequestState
from axon.server.errors import EngineDead
from axon.server.metrics import RequestObserver


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
        """`start` for a prepared chat request (chat_pipeline.PreparedChat)."""
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
    """Admits every prompt, or none: the request's size (admission.py) and the model's
    capacity are checked once for all of them, and a later rejection closes the ones already
    admitted."""
    model.size_caps.check_params([len(ids) for _, ids in prompts], params)
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
    # A cancelled gather is not `cancelled()`: it holds the CancelledError as its exception.
    if not task.cancelled() and not isinstance(task.exception(), asyncio.CancelledError):
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


# ---- the request's model -------------------------------------------------------------------


def served_model(request: Request, model_id: str):
    """The loaded model `model_id`; raises ModelNotFound (404) or ModelUnavailable (503)."""
    return request.app.state.axon.registry.get(model_id)


async def request_model(request: Request, model_id: str):
    """The model `model_id` names, loaded on demand when a models dir holds it, and held until
    the request ends (lifecycle/on_demand.py); raises ModelNotFound (404) or ModelUnavailable
    (503, Retry-After)."""
    registry = request.app.state.axon.registry
    ensure = getattr(registry, "ensure", None)  # a stand-in registry (tests) may have none
    return registry.get(model_id) if ensure is None else await ensure(model_id)


def vocab_size(model) -> int | None:
    """The model's vocabulary size as its engine reports it (else the tokenizer's)."""
    info = getattr(getattr(model, "client", None), "info", None) or {}
    size = getattr(model, "vocab_size", None) or info.get("vocab_size")
    return size or (len(model.tokenizer) if model.tokenizer is not None else None)
