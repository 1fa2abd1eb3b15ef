"""The HTTP edge, before any route runs: request-body size and time limits, applied while the
body is read (and it is read only once the route's key check has passed), a deadline for a
request's headers, and a cap on open connections, so slow, oversized or unauthenticated clients
cannot hold the server's memory or sockets. Every refusal is a response in OpenAI's error
envelope.

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

from axon.server.errors import AxonHTTPError
from axon.server.generation import ClientDisconnected

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


class RequestTooLarge(AxonHTTPError):
    status_code = 413
    code = "request_too_large"


class RequestTimeout(AxonHTTPError):
    status_code = 408
    code = "request_timeout"


class BodyLimits:
    """ASGI middleware: limits on the request body, applied while the route reads it, so that a
    route that refuses a request from its headers (its API key: a dependency, which runs before
    the handler reads the body) answers without reading any of it. A body over `max_bytes` is a
    413, by Content-Length before the app sees the request, else as soon as the read passes the
    limit; one that takes longer than `timeout_s` to arrive is a 408 (and its connection is
    closed: the client is stalled)."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refuse_by_header(scope)
        if refusal is not None:
            status, message = refusal
            start, payload = error_response(status, message, "request_too_large", close=False)
            await send(start)
            await send({"type": "http.response.body", "body": payload})
            return
        body = _LimitedBody(receive, self.max_bytes, self.timeout_s)
        await self.app(scope, body.receive, send)

    def _refuse_by_header(self, scope) -> tuple[int, str] | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    return (400, "invalid Content-Length header")
                if length > self.max_bytes:
                    return (413, too_large(self.max_bytes))
        return None


def too_large(max_bytes: int) -> str:
    return f"request body exceeds the server's limit of {max_bytes} bytes"


class _LimitedBody:
    """The request's `receive` with the body's limits: RequestTooLarge once the body read so far
    passes `max_bytes`, RequestTimeout once it has taken longer than `timeout_s` (from the
    request's start), ClientDisconnected if the client leaves mid-body. After the body, later
    calls (disconnect watches) go to the client as they are."""

    def __init__(self, receive, max_bytes: int, timeout_s: float):
        self._receive, self.max_bytes, self.timeout_s = receive, max_bytes, timeout_s
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        self._size, self._complete = 0, False

    async def receive(self) -> dict:
        if self._complete:
            return await self._receive()
        remaining = self._deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(remaining, 0.0))
        except TimeoutError:
            message = f"request body not received within {self.timeout_s:g}s"
            raise RequestTimeout(message, headers={"Connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        self._size += len(message.get("body", b""))
        if self._size > self.max_bytes:
            raise RequestTooLarge(too_large(self.max_bytes))
        self._complete = not message.get("more_body", False)
        return message


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers (a client
    that opens a connection, or starts a request, and stalls is disconnected), a cap on open
    connections (the one over it gets a 503 and is closed), and a bound on the body it discards
    after answering a request early (`linger_bytes`, see the module's note). The limits are
    class attributes, set by `guarded_protocol`."""

    header_timeout_s: float
    max_connections: int
    linger_bytes: int
    _header_timer: asyncio.TimerHandle | None = None
    _discarded = 0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse_connection()
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        lingering = self._lingering()
        super().data_received(data)
        if lingering:
            self._discarded += len(data)
            if self._discarded > self.linger_bytes and not self.transport.is_closing():
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
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

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


def guarded_protocol(
    header_timeout_s: float, max_connections: int, linger_bytes: int
) -> type[GuardedH11Protocol]:
    """GuardedH11Protocol with these limits, for uvicorn's `http=` (which takes a class)."""
    limits = dict(
        header_timeout_s=header_timeout_s,
        max_connections=max_connections,
        linger_bytes=linger_bytes,
    )
    return type("GuardedH11Protocol", (GuardedH11Protocol,), limits)
