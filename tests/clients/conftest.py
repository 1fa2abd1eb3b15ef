"""One `axon serve` for the client-library tests: the tiny byte-level Qwen3 carrying Qwen3's real
chat template (llama.cpp's corpus), behind a recording proxy so each test sees exactly what its
library sent and what axon answered.

Random weights write valid calls only where the grammar forces them: every tool here has a closed
schema (`additionalProperties: false`) and the first step forces it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.parsers.conftest import MODEL_ID, byte_model_with_corpus_template
from tests.server.conftest import start_server, stop_server

__all__ = ["MODEL_ID"]
TEMPLATE = "Qwen-Qwen3-0.6B.jinja"
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
RESULT = "sunny, 21 degrees"  # what every test's tool returns; it must reach the second prompt


@dataclass
class Exchange:
    method: str
    path: str
    body: bytes
    status: int
    answer: bytes


@dataclass
class Recorder:
    """The proxy in front of axon: `url` is what a library is pointed at."""

    url: str
    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)

    def posts(self, path_suffix: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path.endswith(path_suffix)]


def _handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Forward(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            with httpx.Client(timeout=300) as client:
                reply = client.request(
                    self.command, recorder.upstream + self.path, content=body, headers=headers
                )
            recorder.exchanges.append(
                Exchange(self.command, self.path, body, reply.status_code, reply.content)
            )
            self.send_response(reply.status_code)
            for key, value in reply.headers.items():
                if key.lower() not in _HOP:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(reply.content)))
            self.end_headers()
            self.wfile.write(reply.content)

        do_GET = do_POST = _forward

        def log_message(self, *args) -> None:  # the test output stays quiet
            pass

    return Forward


# Headers the proxy rewrites itself (httpx decodes the body, so its encoding is gone too).
_HOP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


@pytest.fixture(scope="session")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory):
    model = byte_model_with_corpus_template(tmp_path_factory.mktemp("tiny_qwen3_clients"), TEMPLATE)
    running = start_server(model)
    yield running
    stop_server(running)


@pytest.fixture()
def recorder(qwen3_server):
    """A fresh recording proxy per test in front of the session's server."""
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    recording = Recorder(f"http://127.0.0.1:{proxy.server_port}", qwen3_server.base_url)
    proxy.RequestHandlerClass = _handler(recording)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield recording
    proxy.shutdown()
    proxy.server_close()


def rendered_prompt(server, request: dict) -> tuple[str, int]:
    """The prompt text axon renders for a recorded chat request, and its token count."""
    keys = ("model", "messages", "tools", "chat_template_kwargs")
    body = {key: request[key] for key in keys if request.get(key) is not None}
    tokens = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, timeout=60)
    assert text.status_code == 200, text.text
    return text.json()["prompt"], len(ids)


def assert_chat_tool_loop(recorder: Recorder, server) -> list[dict]:
    """What every OpenAI-compatible library's loop must show on /v1/chat/completions: a first
    step answered with a valid call, then a 200 whose prompt carries the tool's result (the
    rendered prompt holds RESULT and has the token count the answer's usage reports)."""
    import json

    import jsonschema

    posts = recorder.posts("/chat/completions")
    assert len(posts) >= 2, [e.path for e in recorder.exchanges]
    for post in posts:
        assert post.status == 200, (post.body, post.answer)
    requests = [json.loads(post.body) for post in posts]
    (call,) = json.loads(posts[0].answer)["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY_SCHEMA)
    second = requests[1]
    tool_turns = [m for m in second["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_turns] == [call["id"]]
    prompt, count = rendered_prompt(server, second)
    assert RESULT in prompt
    assert count == json.loads(posts[1].answer)["usage"]["prompt_tokens"]
    return requests
