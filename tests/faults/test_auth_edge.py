"""Keys and bodies at the HTTP edge (issue 32 points 4 and 5), against a real `axon serve`: a
request without a valid key is answered 401 from its headers, its body never read (the server's
memory stays flat under 16 unauthenticated 30 MB uploads); a body over the limit is answered 413
while the client is still sending, and the client reads that answer, not a reset; with
`--admin-api-key` the node-management routes take only the admin key."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import spawn_serve, stop_server

USER_KEY = "user-key"
ADMIN_KEY = "admin-key"
MAX_BODY = 32 << 20  # the default limit
UPLOAD = 30 << 20  # under the limit: only the key refuses it
PIECE = 256 << 10


@pytest.fixture(scope="module")
def server():
    env = {"AXON_API_KEY": USER_KEY, "AXON_ADMIN_API_KEY": ADMIN_KEY}
    env["AXON_REQUEST_BODY_TIMEOUT_S"] = "60"  # a stalled body is not what answers here
    running = spawn_serve(["--port", "0", "--no-demo", "--log-level", "warning"], env)
    yield running
    stop_server(running)


def _address(server) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _head(path: str, length: int, headers: dict[str, str] | None = None, chunked=False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _answer(sock: socket.socket) -> bytes:
    """The response head and as much of its body as arrives within the socket's timeout."""
    data = b""
    while b"\r\n\r\n" not in data or not re.search(rb"\{.*\}", data, re.S):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def test_an_unauthenticated_request_is_answered_from_its_headers(server):
    cases = [
        ("/v1/chat/completions", {}, b'"code":"invalid_api_key"'),
        ("/v1/completions", {"Authorization": "Bearer wrong"}, b'"code":"invalid_api_key"'),
        ("/v1/messages", {"x-api-key": "wrong"}, b'"type":"authentication_error"'),
        ("/v1/chat/completions", {"Authorization": f"Bearer {ADMIN_KEY}"}, b"invalid_api_key"),
        ("/models/load", {"Authorization": f"Bearer {USER_KEY}"}, b'"admin_key_required"'),
    ]
    for path, headers, marker in cases:
        with socket.create_connection(_address(server), timeout=5) as sock:
            sock.sendall(_head(path, UPLOAD, headers))  # and not one byte of the 30 MB
            answer = _answer(sock)  # times out (no answer) while the server waits for the body
        status = 403 if path == "/models/load" else 401
        assert answer.startswith(f"HTTP/1.1 {status}".encode()), (path, answer[:300])
        assert marker in answer, (path, answer[:300])


def test_unauthenticated_uploads_leave_the_servers_memory_flat(server):
    before = _rss_bytes(server.process.pid)
    peak, statuses, sending = [before], [], threading.Event()
    body = b" " * PIECE

    def upload() -> None:
        with socket.create_connection(_address(server), timeout=30) as sock:
            sock.sendall(_head("/v1/chat/completions", UPLOAD))
            for _ in range(UPLOAD // PIECE):
                sock.sendall(body)
            statuses.append(_answer(sock)[:12])

    def watch() -> None:
        while sending.is_set():
            peak.append(_rss_bytes(server.process.pid))
            time.sleep(0.02)

    sending.set()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    uploads = [threading.Thread(target=upload) for _ in range(16)]
    for thread in uploads:
        thread.start()
    for thread in uploads:
        thread.join(120)
    sending.clear()
    watcher.join()
    assert statuses == [b"HTTP/1.1 401"] * 16, statuses
    # 16 x 30 MB read into memory would be ~5x the idle process; unread, it stays where it was.
    assert max(peak) < before * 1.25, (before, max(peak))


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_client_still_sending_an_oversized_body_reads_the_413(server, chunked):
    size = MAX_BODY + (8 << 20)
    headers = {"Authorization": f"Bearer {USER_KEY}"}
    with socket.create_connection(_address(server), timeout=30) as sock:
        sock.sendall(_head("/v1/completions", size, headers, chunked))
        for _ in range(size // PIECE):  # slowly: the server answers long before the end
            piece = b" " * PIECE
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            time.sleep(0.002)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
        answer = _answer(sock)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"request_too_large" in answer


def test_node_management_takes_only_the_admin_key(server):
    def call(method: str, path: str, key: str | None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.request(method, server.base_url + path, headers=headers, timeout=30, **kwargs)

    unload = {"json": {"model_id": "no-such-model"}}
    load = {"json": {"model_id": "/no/such/model", "served_model_name": "x"}}
    for path, body in (("/models/unload", unload), ("/models/load", load)):
        assert call("POST", path, None, **body).status_code == 401
        refused = call("POST", path, USER_KEY, **body)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "admin_key_required"
        assert call("POST", path, ADMIN_KEY, **body).status_code not in (401, 403)
    for key in (USER_KEY, ADMIN_KEY):  # the node's read-only routes: either key
        assert call("GET", "/models", key).status_code == 200
    assert call("GET", "/models", None).status_code == 401
    assert call("GET", "/v1/models", ADMIN_KEY).status_code == 401  # inference: not the admin's
    assert call("GET", "/v1/models", USER_KEY).status_code == 200
    assert call("GET", "/health", None).status_code == 200


def test_with_only_an_api_key_node_management_takes_it(tmp_path: Path):
    from axon.server.app import create_app
    from axon.server.config import ServerConfig, config_from_mapping, load_config
    from axon.server.lifecycle.registry import ModelRegistry
    from axon.server.state import AppState

    config = ServerConfig(api_key="k")
    app = create_app(AppState(config=config, registry=ModelRegistry(config)))
    transport = httpx.ASGITransport(app=app)

    async def unload(key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            body = {"model_id": "no-such-model"}
            return (await http.post("/models/unload", json=body, headers=headers)).status_code

    assert asyncio.run(unload(None)) == 401
    assert asyncio.run(unload("k")) == 404  # through the key check, to the missing model
    (tmp_path / "axon.toml").write_text('api_key = "k"\n')
    environ = {"AXON_ADMIN_API_KEY": "a"}
    assert load_config(tmp_path / "axon.toml", environ).admin_api_key == "a"
    assert config_from_mapping({"admin_api_key": "a"}).admin_api_key == "a"
    with pytest.raises(ValueError, match="admin_api_key"):
        ServerConfig(api_key="same", admin_api_key="same")
