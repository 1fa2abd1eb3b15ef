"""One request's TokenUpdates in the HTTP process, as EngineClient.generate hands them out."""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING

from axon.outputs import TokenUpdate

if TYPE_CHECKING:
    from axon.engine.client import EngineClient


class Inbox:
    """One request's TokenUpdates (or the EngineError that ends them) waiting to be read: an
    unbounded queue with at most one reader, so a put is a deque append plus waking that
    reader's future, and a get of an item already there does not suspend."""

    __slots__ = ("loop", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self):
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class RequestStream:
    """The TokenUpdates of one submitted request, as an async iterator that aborts the request
    in the engine when closed before every sample finished."""

    def __init__(self, client: EngineClient, request_id: str, updates: Inbox, n: int):
        self.client, self.request_id, self.updates, self.n = client, request_id, updates, n
        self.finished: set[int] = set()
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenUpdate:
        if self.closed or len(self.finished) == self.n:
            await self.aclose()
            raise StopAsyncIteration
        try:
            item = await self.updates.get()
        except BaseException:  # cancelled while waiting: the client went away
            await self.aclose()
            raise
        if isinstance(item, Exception):
            await self.aclose()
            raise item
        if item.finish_reason is not None:
            self.finished.add(item.index)
        return item

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.client._close_stream(self.request_id, len(self.finished) == self.n)
