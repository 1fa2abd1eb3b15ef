"""The HTTP process's handle on one engine process (the model's device worker). The messages
they exchange, and what each means, are declared in axon.engine.messages.

The asyncio loop reads the engine's pipe itself, without blocking: it takes whatever bytes are
there and decodes a message only once it is whole (`PipeReader`), so an engine stopped in the
middle of a message never holds up the loop, and a step's updates cost the HTTP process one
wake-up (a reader thread cost a second thread's wake-up, a GIL hand-over and a self-pipe write
per token, all on the engine's core at concurrency 1). A writer thread sends (encoding
included), so a large message never blocks the event loop on a full pipe. Requests stream
TokenUpdates through per-request queues, commands await per-call futures.

Liveness: the loop watches the process sentinel too, so a killed engine is noticed at once, and
keeps a deadline: an engine that sends nothing (no update, no heartbeat) for `step_timeout_s` is
wedged (a step that never returns, a stopped process), and is killed. Either way every
in-flight request and call fails with EngineError and `on_poisoned` fires, which makes the
registry recover the model.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from axon.engine.exit_status import describe_exit
from axon.engine.messages import (
    Abort,
    AddRequest,
    Call,
    Failed,
    LoadFailed,
    LoadProgress,
    Message,
    Poisoned,
    Ready,
    Reply,
    StopSample,
    Updates,
    decode,
    encode,
)
from axon.engine.pipe_reader import PipeReader
from axon.engine.request_stream import Inbox, RequestStream
from axon.engine.spawn import SpawnedEngine, kill_group
from axon.sampling_params import SamplingParams

if TYPE_CHECKING:  # this module stays light: `axon serve` spawns an engine before torch loads
    from axon.config import EngineConfig

logger = logging.getLogger(__name__)

EXIT_CODE_WAIT_S = 1.0
EXIT_CODE_POLL_S = 0.005


class EngineError(RuntimeError):
    """The engine failed a request or a command (poisoned, dead, or a step error)."""


class EngineRefused(EngineError):
    """The engine would not take a request as sent (its parameters, not the engine, are at
    fault): the server answers it as a bad request."""


class EngineLoadTimeout(RuntimeError):
    """The engine did not finish loading within its deadline (it was killed)."""


@dataclass(frozen=True)
class Liveness:
    """Deadlines of one engine process. `step_timeout_s`: longest silence of a running engine
    (one step, or one command); `load_timeout_s`: spawn to weights resident."""

    step_timeout_s: float = 120.0
    load_timeout_s: float = 1800.0

    @property
    def heartbeat_s(self) -> float:
        """How often an idle engine speaks: often enough that one missed beat is not a fault."""
        return min(1.0, self.step_timeout_s / 4)

    def __post_init__(self) -> None:
        if not self.step_timeout_s > 0 or not self.load_timeout_s > 0:
            raise ValueError(f"engine deadlines must be > 0, got {self}")


class EngineClient:
    def __init__(self, config: EngineConfig, process, conn, info: dict, liveness: Liveness):
        self.config = config
        self.process = process
        self.conn = conn
        self.info = info
        self.liveness = liveness
        self.loop = asyncio.get_running_loop()
        self.poisoned: str | None = None
        self.dead = False
        self.closing = False  # shutdown asked for: the engine's exit is expected
        self.on_poisoned: Callable[[str], None] | None = None
        self.last_heard = time.monotonic()
        self._streams: dict[str, Inbox] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._aborts: list[str] = []  # request ids to abort, sent at the end of the loop turn
        self._call_ids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="engine-writer", daemon=True)
        self._writer.start()
        self._pipe = PipeReader(conn)
        self._watching = True
        self.loop.add_reader(self._pipe.fileno(), self._on_readable)
        self.loop.add_reader(process.sentinel, self._on_exit)
        self._deadline = self.loop.call_later(liveness.heartbeat_s / 2, self._check_deadline)

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        log_level: int = logging.INFO,
        liveness: Liveness | None = None,
        env: dict[str, str] | None = None,
        on_progress=None,
        spawned: SpawnedEngine | None = None,
    ) -> EngineClient:
        """Spawn the engine process and wait until its weights are loaded; `on_progress(loaded,
        total)` hears the bytes of weights loaded meanwhile. `spawned`: an engine already
        spawned (`SpawnedEngine.spawn`, before the server stack was imported) that is taken
        over when it was spawned for the same config, liveness and env, else killed. Raises
        RuntimeError with the engine's message when loading fails, EngineLoadTimeout past the
        deadline. A cancelled start (an unload while loading) kills the process group."""
        liveness = liveness or Liveness()
        if spawned is not None and spawned.adopt(config, liveness, env):
            logger.info("engine[%d] was spawned ahead for this model: taken over", spawned.pid)
        elif spawned is not None:
            logger.info("engine[%d] was spawned ahead for other settings: replaced", spawned.pid)
            spawned.discard()
            spawned = None
        if spawned is None:
            spawned = SpawnedEngine.spawn(config, liveness, env, log_level)
        spawned.taken = True
        process, parent = spawned.process, spawned.conn
        try:
            message = await _first_message(parent, process, liveness.load_timeout_s, on_progress)
        except BaseException:
            kill_group(process)
            await asyncio.to_thread(process.join, 5)
            parent.close()
            raise
        if isinstance(message, LoadFailed):
            await asyncio.to_thread(process.join, 10)
            parent.close()
            raise RuntimeError(message.error)
        return cls(config, process, parent, message.info, liveness)

    @property
    def responsive(self) -> bool:
        """Whether the engine was heard from lately: an idle one sends a heartbeat every
        `heartbeat_s`, so one silent for two beats (and a second) is stopped or wedged."""
        return time.monotonic() - self.last_heard < 2 * self.liveness.heartbeat_s + 1

    # ---- messages from the engine -----------------------------------------------------------

    def _on_readable(self, max_bytes: int | None = None) -> None:
        try:
            messages = self._pipe.read(max_bytes)
        except Exception as exc:  # noqa: BLE001 - an unreadable message: trust it no more
            self._lost(f"unreadable message from the engine: {exc!r}", kill=True)
            return
        if messages:
            self.last_heard = time.monotonic()
        for message in messages:
            self._dispatch(message)
        if self._pipe.eof and self._watching:  # the sentinel says why (or the deadline)
            self.loop.remove_reader(self._pipe.fileno())

    def _on_exit(self) -> None:
        """The process exited: what it wrote before (a `failed` for its requests) still
        counts, then everything still waiting on it fails, with how it ended."""
        if self._watching:
            self._on_readable(max_bytes=0)  # all of it, however long
        self._stop_watching()
        self._await_exit_code(time.monotonic() + EXIT_CODE_WAIT_S)

    def _await_exit_code(self, deadline: float) -> None:
        # The sentinel closes as the process exits, a moment before the kernel has its exit
        # status to give; poll briefly (off the loop's back) rather than report "None".
        self.process.join(0)
        if self.process.exitcode is None and time.monotonic() < deadline:
            self.loop.call_later(EXIT_CODE_POLL_S, self._await_exit_code, deadline)
            return
        self._lost(f"engine process died ({describe_exit(self.process.exitcode)})")

    def _check_deadline(self) -> None:
        silent_s = time.monotonic() - self.last_heard
        if silent_s <= self.liveness.step_timeout_s:
            self._deadline = self.loop.call_later(
                self.liveness.heartbeat_s / 2, self._check_deadline
            )
            return
        self._lost(
            f"engine missed its step deadline ({self.liveness.step_timeout_s:g}s "
            "without progress or heartbeat); it was killed",
            kill=True,
        )

    def _stop_watching(self) -> None:
        if self._watching:
            self._watching = False
            self._deadline.cancel()
            self.loop.remove_reader(self._pipe.fileno())
            self.loop.remove_reader(self.process.sentinel)

    def _lost(self, reason: str, kill: bool = False) -> None:
        self._stop_watching()
        if kill:
            self.kill()
        self._on_dead(reason)

    def _dispatch(self, message: Message) -> None:
        match message:
            case Updates():
                for update in message.updates:
                    stream = self._streams.get(update.request_id)
                    if stream is not None:
                        stream.put_nowait(update)
            case Failed():
                for request_id in message.request_ids:
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        error = EngineRefused if message.refused else EngineError
                        stream.put_nowait(error(message.error))
            case Reply():
                future = self._calls.pop(message.call_id, None)
                if future is not None and not future.done():
                    if message.ok:
                        future.set_result(message.payload)
                    else:
                        future.set_exception(EngineError(message.payload))
            case Poisoned():
                self._on_poisoned(message.error)

    def _on_poisoned(self, reason: str) -> None:
        self.poisoned = reason
        if self.on_poisoned is not None:
            self.on_poisoned(reason)

    def _on_dead(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = True
        self._outbox.put(None)  # stops the writer
        error = EngineError(reason)
        for stream in self._streams.values():
            stream.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        if self.closing:
            return
        logger.error("engine of %s: %s", self.config.model, reason)
        if self.poisoned is None:
            self._on_poisoned(reason)

    # ---- messages to the engine -------------------------------------------------------------

    def _write_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(encode(message))
            except (OSError, ValueError):
                return  # the engine is gone; the reader reports it
            except Exception:  # an unpicklable message is a bug here, not an engine fault
                logger.exception("cannot send %s to the engine", type(message).__name__)

    def _send(self, message: Message) -> None:
        if self.dead:
            raise EngineError("engine process is not running")
        if self._aborts and not isinstance(message, Abort):
            self._send_aborts()  # what was closed before this message reaches the engine first
        self._outbox.put(message)

    # ---- requests and commands --------------------------------------------------------------

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: dict | None = None,
    ) -> RequestStream:
        """Submit a request now; iterate the result for its TokenUpdates until all `n` samples
        finish. Closing it early (aclose, or leaving an `async for`) aborts the request.
        `images`: {"pixel_values", "grid_thw"} for a prompt with expanded image placeholders."""
        stream = Inbox(self.loop)
        self._streams[request_id] = stream
        try:
            self._send(AddRequest(request_id, prompt_token_ids, params, images))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return RequestStream(self, request_id, stream, params.n)

    def _close_stream(self, request_id: str, finished: bool) -> None:
        self._streams.pop(request_id, None)
        if not finished and not self.dead:
            if not self._aborts:
                self.loop.call_soon(self._send_aborts)
            self._aborts.append(request_id)

    def _send_aborts(self) -> None:
        """Sends the aborts of this loop turn as one message: a request of many prompts that
        goes away closes them all in one turn, and the engine removes them in one pass."""
        aborts, self._aborts = self._aborts, []
        if aborts and not self.dead:
            self._send(Abort(aborts))

    def stop_sample(self, request_id: str, index: int) -> None:
        """Finish one sample now (a stop string matched in the frontend)."""
        if not self.dead:
            self._send(StopSample(request_id, index))

    async def call(self, command: str, *args, timeout: float = 60.0):
        """Run one engine command (messages.COMMANDS) and return its reply's payload; raises
        EngineError or TimeoutError."""
        call_id = next(self._call_ids)
        future = self.loop.create_future()
        self._calls[call_id] = future
        try:
            self._send(Call(call_id, command, args))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def shutdown(self, timeout: float = 20.0) -> None:
        """Ask the engine to exit (it frees everything it owns); kill its group if it won't.
        A dead or silent (wedged) engine is killed at once; a poisoned one still exits itself."""
        self.closing = True
        if not self.dead and self.responsive and self.process.is_alive():
            try:
                await self.call("shutdown", timeout=timeout)
            except (EngineError, TimeoutError, OSError) as exc:
                logger.warning("engine did not shut down cleanly: %s", exc)
            await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():
            self.kill()
            await asyncio.to_thread(self.process.join, 5)
        if self._watching and not self.process.is_alive():
            self._on_exit()
        self._stop_watching()
        self._outbox.put(None)
        self._pipe.close()
        self.conn.close()

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (every TP rank with it)."""
        kill_group(self.process)


async def _first_message(conn, process, timeout_s: float, on_progress=None) -> Ready | LoadFailed:
    """The engine's first message after its LoadProgress ones, waited for in short slices so
    that a cancellation is seen promptly. Raises RuntimeError when the process dies first (or
    says something else), EngineLoadTimeout past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = await asyncio.to_thread(
            mp.connection.wait, [conn, process.sentinel], min(0.5, timeout_s)
        )
        if conn in ready:
            try:
                message = decode(conn.recv_bytes())
            except EOFError:
                ready = [process.sentinel]
            else:
                match message:
                    case Ready() | LoadFailed():
                        return message
                    case LoadProgress() if on_progress is not None:
                        on_progress(message.loaded_bytes, message.total_bytes)
                    case LoadProgress():
                        pass
                    case _:
                        raise RuntimeError(f"the engine sent {message!r} while loading")
        if process.sentinel in ready:
            await asyncio.to_thread(process.join, 5)
            raise RuntimeError(f"engine process {describe_exit(process.exitcode)}")
        if time.monotonic() > deadline:
            raise EngineLoadTimeout(f"the engine did not load within {timeout_s:g}s; it was killed")
