"""The HTTP process's handle on one engine process (the model's device worker).

A reader thread receives the engine's messages and hands them to the asyncio loop; requests
stream TokenUpdates through per-request queues, commands await per-call futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable

from axon.config import EngineConfig
from axon.engine.engine_proc import engine_process_main
from axon.outputs import TokenUpdate
from axon.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed a request or a command (poisoned, dead, or a step error)."""


class EngineClient:
    def __init__(self, config: EngineConfig, process, conn, info: dict):
        self.config = config
        self.process = process
        self.conn = conn
        self.info = info
        self.loop = asyncio.get_running_loop()
        self.poisoned: str | None = None
        self.dead = False
        self.on_poisoned: Callable[[str], None] | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, name="engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    async def start(cls, config: EngineConfig, log_level: int = logging.INFO) -> EngineClient:
        """Spawn the engine process and wait until its weights are loaded. Raises
        RuntimeError with the engine's message when loading fails."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=engine_process_main, args=(config, child, log_level), name="axon-engine"
        )
        process.start()
        child.close()
        try:
            message = await asyncio.to_thread(parent.recv)
        except EOFError:
            await asyncio.to_thread(process.join, 5)
            raise RuntimeError(f"engine process exited with code {process.exitcode}") from None
        if message[0] == "load_failed":
            await asyncio.to_thread(process.join, 10)
            raise RuntimeError(message[1])
        return cls(config, process, parent, message[1])

    # ---- messages from the engine -----------------------------------------------------------

    def _read_loop(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._call_soon(self._on_dead)
                return
            self._call_soon(self._dispatch, message)

    def _call_soon(self, callback, *args) -> None:
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(callback, *args)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "updates":
            for update in message[1]:
                queue = self._streams.get(update.request_id)
                if queue is not None:
                    queue.put_nowait(update)
        elif kind == "failed":
            for request_id in message[1]:
                queue = self._streams.get(request_id)
                if queue is not None:
                    queue.put_nowait(EngineError(message[2]))
        elif kind == "reply":
            _, call_id, ok, payload = message
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result(payload) if ok else future.set_exception(EngineError(payload))
        elif kind == "poisoned":
            self._on_poisoned(message[1])

    def _on_poisoned(self, reason: str) -> None:
        self.poisoned = reason
        if self.on_poisoned is not None:
            self.on_poisoned(reason)

    def _on_dead(self) -> None:
        if self.dead:
            return
        self.dead = True
        error = EngineError(f"engine process died (exit code {self.process.exitcode})")
        for queue in self._streams.values():
            queue.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        if self.poisoned is None:
            self._on_poisoned(str(error))

    # ---- requests and commands --------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        if self.dead:
            raise EngineError("engine process is not running")
        with self._send_lock:
            self.conn.send(message)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Submit a request now; iterate the result for its TokenUpdates until all `n` samples
        finish. Closing it early (aclose, or leaving an `async for`) aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        try:
            self._send(("add", None, request_id, list(prompt_token_ids), params))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return RequestStream(self, request_id, queue, params.n)

    def _close_stream(self, request_id: str, finished: bool) -> None:
        self._streams.pop(request_id, None)
        if not finished and not self.dead:
            self._send(("abort", None, [request_id]))

    def stop_sample(self, request_id: str, index: int) -> None:
        """Finish one sample now (a stop string matched in the frontend)."""
        if not self.dead:
            self._send(("stop_sample", None, request_id, index))

    async def call(self, kind: str, *args, timeout: float = 60.0):
        """Run one engine command and return its reply; raises EngineError or TimeoutError."""
        call_id = next(self._call_ids)
        future = self.loop.create_future()
        self._calls[call_id] = future
        try:
            self._send((kind, call_id, *args))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def shutdown(self, timeout: float = 20.0) -> None:
        """Ask the engine to exit (it frees everything it owns); kill its group if it won't."""
        if not self.dead and self.process.is_alive():
            try:
                await self.call("shutdown", timeout=timeout)
            except (EngineError, TimeoutError, OSError) as exc:
                logger.warning("engine did not shut down cleanly: %s", exc)
        await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():
            self.kill()
            await asyncio.to_thread(self.process.join, 5)
        self.conn.close()

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (every TP rank with it)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)


class RequestStream:
    """The TokenUpdates of one submitted request, as an async iterator that aborts the request
    in the engine when closed before every sample finished."""

    def __init__(self, client: EngineClient, request_id: str, queue: asyncio.Queue, n: int):
        self.client, self.request_id, self.queue, self.n = client, request_id, queue, n
        self.finished: set[int] = set()
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenUpdate:
        if self.closed or len(self.finished) == self.n:
            await self.aclose()
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
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
