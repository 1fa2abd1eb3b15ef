"""The HTTP edge, before any route runs: request-body size and time limits, a deadline for a
request's headers, and a cap on open connections, so slow or oversized clients cannot hold the
server's memory or sockets. Every refusal is a response in OpenAI's error envelope."""

from __future__ import annotations

import asyncio
import json
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def error_response(status: int, message: str, code: str, headers: dict | None = None) -> tuple:
    """(ASGI start message, body bytes) of an OpenAI error envelope."""
    error_type = "invalid_request_error" if status < 500 else "service_unavailable"
    error = {"message": message, "type": error_type, "code": code, "param": None}
    body = json.dumps({"error": error}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    raw.append((b"connection", b"close"))
    return {"type": "http.response.start", "status": status, "headers": raw}, body


class BodyLimits:
    """ASGI middleware: reads the whole request body before the app sees the request, refusing
    one over `max_bytes` (413, by Content-Length before reading any of it) or one that takes
    longer than `timeout_s` to arrive (408). The app then reads it from memory; later `receive`
    calls (disconnect watches) go to the client."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
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
            start, payload = error_response(status, message, code)
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


def _replay(body: bytes, receive):
    delivered = False

    async def replay():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's line and headers (a client
    that opens a connection, or starts a request, and stalls is disconnected) and a cap on open
    connections (the one over it gets a 503 and is closed)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse_connection()
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._between_requests():
                self._arm_header_timer()
            else:
                self._disarm_header_timer()

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
