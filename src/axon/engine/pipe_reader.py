"""The HTTP process's end of the engine pipe, read from the asyncio loop without ever blocking
it; each frame holds one message of axon.engine.messages."""

from __future__ import annotations

import multiprocessing.connection
import os
import socket
import struct

from axon.engine.messages import Message, decode


class PipeReader:
    """Reads a multiprocessing Connection's messages (socketpair end, its framing: a 4-byte
    big-endian length, or -1 and an 8-byte one, then the payload) without ever blocking: each
    `read` takes the bytes already there and returns the messages they complete; a message
    still arriving stays buffered. Reads with MSG_DONTWAIT on a duplicate of the socket, so the
    writer thread's sends on the same socket stay blocking."""

    CHUNK = 1 << 16
    MAX_READ = 1 << 22  # per call: a huge message does not hold the loop, it comes back for more

    def __init__(self, conn: multiprocessing.connection.Connection):
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))
        self.buffer = bytearray()
        self.eof = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self, max_bytes: int | None = None) -> list[Message]:
        """The messages completed by what has arrived (maybe none), reading at most about
        `max_bytes` (0: no limit; None: MAX_READ); sets `eof` once the other end closed.
        Raises what decoding a message raises."""
        limit = self.MAX_READ if max_bytes is None else max_bytes or float("inf")
        received = 0
        while not self.eof and received < limit:
            try:
                chunk = self.sock.recv(self.CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # reset by a dying peer: the same as its end closed
                chunk = b""
            self.eof = not chunk
            self.buffer += chunk
            received += len(chunk)
            if len(chunk) < self.CHUNK:
                break
        return self._messages()

    def _messages(self) -> list[Message]:
        messages, buffer, start = [], self.buffer, 0
        while len(buffer) - start >= 4:
            (size,) = struct.unpack_from("!i", buffer, start)
            header = 4
            if size == -1:
                if len(buffer) - start < 12:
                    break
                (size,) = struct.unpack_from("!Q", buffer, start + 4)
                header = 12
            if len(buffer) - start < header + size:
                break
            body = start + header
            messages.append(decode(buffer[body : body + size]))
            start = body + size
        if start:
            del buffer[:start]
        return messages

    def close(self) -> None:
        self.sock.close()
