"""The HTTP edge, before any route runs: the request's key checked from its headers before its
body is read, request-body size and time limits, a deadline for a request's headers, and a cap
on open connections, so slow, oversized or unauthenticated clients cannot hold the server's
memory or sockets. Every refusal is a response in OpenAI's error envelope.

A request answered before its body is in (401, 413) keeps its connection: uvicorn reads and
discards the rest of the body, as nginx's lingering close does, so a client still uploading
reads the answer rather than a reset. That discarding is bounded: `linger_bytes`, and the header
deadline, which runs from the first discarded piece."""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def error_response(
    status: int, message: str, code: str, headers: dict | None = None, close: bool = True
) -> tuple:
    """(ASGI start message, body bytes) of an OpenAI error envelope; `close`: then the
    connection closes (else the rest of the body is discarded, see the module's note)."""
    error_type = "invalid_request_error" if status < 500 else "service_unavailable"
    error = {"message": message, "type": error_type, "code": code, "param": None}
    body = json.dumps({"error": error}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if close:
        raw.append((b"connection", b"close"))
    return {"type": "http.response.start", "status": status, "headers": raw}, body


class BodyLimits:
    """ASGI middleware: reads the whole request body before the app sees the request, refusing
    one over `max_bytes` (413, by Content-Length before reading any of it, else as soon as it
    passes the limit) or one that takes longer than `timeout_s` to arrive (408). The app then
    reads it from memory; later `receive` calls (disconnect watches) go to the client.

    `refused_by_headers(scope)`, when given, says a request's route refuses it from its headers
    (its API key): the app then gets it with an empty body, answers it (401 in the route's own
    error shape), and the body is never read."""

    def __init__(self, app, max_bytes: int, timeout_s: float, refused_by_headers=None):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self.refused_by_headers = refused_by_headers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.refused_by_headers is not None and await self.refused_by_headers(scope):
            await self.app(scope, _empty_body(), send)
            return
        refusal = self._refuse_by_header(scope)
        if refusal is None:
            try:
                body = await asyncio.wait_for(self._read(receive), self.timeout_s)
            except TimeoutError:
                refusal = (408, f"request body not received within {self.timeout_s:g}s")
            except _TooLarge:
                refusal = (413, self._too_large())
            except _Disconnected:
                return
        if refusal is not None:
            status, message = refusal
            code = "request_timeout" if status == 408 else "request_too_large"
            # A 408's client is stalled: closed. Any other's may still be uploading: it keeps
            # the connection while the rest is discarded, and so reads the answer.
            start, payload = error_response(status, message, code, close=status == 408)
            await send(start)
            await send({"type": "http.response.body", "body": payload})
            return
        await self.app(scope, _replay(body, receive), send)

    def _refuse_by_header(self, scope) -> tuple[int, str] | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    return (400, "invalid Content-Length header")
                if length > self.max_bytes:
                    return (413, self._too_large())
        return None

    def _too_large(self) -> str:
        return f"request body exceeds the server's limit of {self.max_bytes} bytes"

    async def _read(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


def _empty_body():
    delivered = False

    async def empty():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.disconnect"}  # nothing reads on: the route refused the request

    return empty


def _replay(body: bytes, receive):
    delivered = False

    async def replay():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def guarded_protocol(
    header_timeout_s: float, max_connections: int, linger_bytes: int
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's line and headers (a client
    that opens a connection, or starts a request, and stalls is disconnected), a cap on open
    connections (the one over it gets a 503 and is closed), and a bound on the body it discards
    after answering a request early (`linger_bytes`, see the module's note)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _discarded = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse_connection()
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            lingering = self._lingering()
            super().data_received(data)
            if lingering:
                self._discarded += len(data)
                if self._discarded > linger_bytes and not self.transport.is_closing():
                    self.transport.close()
                    return
            else:
                self._discarded = 0
            if self._between_requests():
                self._arm_header_timer()  # after an early answer: the discarding's deadline
            else:
                self._disarm_header_timer()

        def _lingering(self) -> bool:
            """Answered, with the rest of the request's body still to come (and discarded)."""
            answered = self.cycle is not None and self.cycle.response_complete
            return answered and self.conn.their_state is h11.SEND_BODY

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()  # nothing of a request arrived in time

        def _refuse_connection(self) -> None:
            start, body = error_response(
                503,
                "too many open connections; retry shortly",
                "too_many_connections",
                {"Retry-After": "1"},
            )
            head = b"HTTP/1.1 503 Service Unavailable\r\n"
            head += b"".join(k + b": " + v + b"\r\n" for k, v in start["headers"])
            self.transport.write(head + b"\r\n" + body)
            self.transport.close()
            logger.warning("connection refused: %d open (max_connections)", len(self.connections))

    return GuardedH11Protocol
