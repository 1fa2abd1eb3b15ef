"""A real `axon serve` on a loopback port, serving a tiny random Qwen3 written here.

The checkpoint has a word-level tokenizer with ChatML's special tokens and a ChatML template, so
chat requests render and every generated token detokenizes to a word (`w17`). One server runs
for the whole session; its queue is small enough that the overload test can fill it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tiny_configs import SERVE_MAX_MODEL_LEN as MAX_MODEL_LEN
from tiny_configs import SERVE_QWEN3
from tiny_configs import SERVE_VOCAB_SIZE as VOCAB_SIZE

MODEL_ID = "tiny-qwen3"
MAX_NUM_SEQS = 2
MAX_WAITING_REQUESTS = 1  # so the 4th concurrent request is refused
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = ("<unk>", "system", "user", "assistant", "hello", "world", "tell", "me", "a", "story")
GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0, "top_k": 50}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SRC = Path(__file__).resolve().parents[2] / "src"


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer over specials + a few words + `w<i>` up to VOCAB_SIZE."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIALS, *WORDS))}
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))


def write_tiny_qwen3(path: Path) -> Path:
    """A 2-layer random Qwen3 with the tokenizer above and a generation_config.json."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**SERVE_QWEN3)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    write_tokenizer(path)
    return path


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log: list[str]

    @property
    def openai_url(self) -> str:
        return self.base_url + "/v1"

    def metric(self, name: str, **labels: str) -> float:
        """The value of the tiny model's sample `name` (with `labels`) on /metrics; 0 if absent."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        wanted = {"model_name": MODEL_ID, **labels}
        for line in text.splitlines():
            match = re.fullmatch(r"([^{\s]+)(?:\{(.*)\})? (\S+)", line)
            if line.startswith("#") or match is None or match.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if found == wanted:
                return float(match.group(3))
        return 0.0

    def metric_line(self, name: str, **labels: str) -> float:
        """As `metric`, but a sample that is not on /metrics fails the test."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        assert f"{name}{{" in text, f"{name} is not on /metrics"
        return self.metric(name, **labels)


def _serve_args(model_dir: Path) -> list[str]:
    return [str(model_dir), "--served-model-name", MODEL_ID, *_ENGINE_ARGS]


_ENGINE_ARGS = ["--port", "0", "--max-model-len", str(MAX_MODEL_LEN)]
_ENGINE_ARGS += ["--max-num-seqs", str(MAX_NUM_SEQS), "--kv-cache-memory", "16M"]
_ENGINE_ARGS += ["--dtype", "float32", "--log-level", "warning"]


def _server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_SRC), env.get("PYTHONPATH")]))
    env["AXON_MAX_WAITING_REQUESTS"] = str(MAX_WAITING_REQUESTS)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("AXON_API_KEY", None)
    # No models dirs unless a test names some: the machine's caches would add models to
    # /v1/models that a test does not expect (models on demand).
    env.setdefault("AXON_MODELS_DIRS", "[]")
    env.update(extra or {})
    return env


def _read_log(process: subprocess.Popen, log: list[str], port_found: threading.Event) -> None:
    for line in process.stderr or process.stdout:
        log.append(line)
        if "listening on http://" in line:
            port_found.set()


def _wait_until_serving(
    server: Server, deadline_s: float = 120.0, model_id: str = MODEL_ID
) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert server.process.poll() is None, "axon serve exited:\n" + "".join(server.log)
        assert "failed" not in "".join(server.log), "the load failed:\n" + "".join(server.log)
        try:
            models = httpx.get(server.openai_url + "/models", timeout=5).json()
            if any(m["id"] == model_id for m in models.get("data", [])):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the model did not load in time:\n" + "".join(server.log))


def start_server(model_dir: Path, env: dict[str, str] | None = None) -> Server:
    # Tests load more copies of the model over HTTP: its directory is an allowed local path.
    env = {"AXON_ALLOWED_LOCAL_MODEL_PATHS": str(model_dir), **(env or {})}
    server = spawn_serve(_serve_args(model_dir), env)
    try:
        _wait_until_serving(server)
    except BaseException:
        stop_server(server)  # never leave a server behind when the load fails
        raise
    return server


def start_multi_server(models: dict[str, Path]) -> Server:
    """One `axon serve` (the engine settings of start_server) serving each checkpoint of
    `models` under its key, one engine process each: cheaper than a server per checkpoint."""
    tables = ", ".join(
        f"{{model_id = {json.dumps(str(path))}, served_model_name = {json.dumps(name)}}}"
        for name, path in models.items()
    )
    server = spawn_serve(["--no-demo", *_ENGINE_ARGS], {"AXON_DEFAULT_MODELS": f"[{tables}]"})
    try:
        for name in models:
            _wait_until_serving(server, model_id=name)
    except BaseException:
        stop_server(server)
        raise
    return server


def spawn_serve(
    args: list[str],
    env: dict[str, str] | None = None,
    kind=None,
    cwd: Path | None = None,
    stdout_too: bool = False,
) -> Server:
    """`axon serve ARGS` (in `cwd`) in its own session; returns (as `kind`, default Server) once
    it says where it listens. Its log is its stderr, and its stdout too (uvicorn's access log)
    with `stdout_too`."""
    process = subprocess.Popen(
        [sys.executable, "-m", "axon", "serve", *args],
        env=_server_env(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if stdout_too else subprocess.DEVNULL,
        stderr=subprocess.STDOUT if stdout_too else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    log: list[str] = []
    port_found = threading.Event()
    threading.Thread(target=_read_log, args=(process, log, port_found), daemon=True).start()
    if not port_found.wait(120):
        process.kill()
        raise AssertionError("axon serve never said where it listens:\n" + "".join(log))
    url = re.search(r"listening on (http://\S+)", "".join(log)).group(1)
    return (kind or Server)(process, url.replace("0.0.0.0", "127.0.0.1"), log)


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(10)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_chat_qwen3"))


@pytest.fixture(scope="session")
def server(tiny_chat_model: Path):
    running = start_server(tiny_chat_model)
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def thinking_server(tmp_path_factory: pytest.TempPathFactory):
    """tests/parsers' byte-level model, its template opening `<think>` when thinking is on (as
    Qwen3's thinking-only releases do), served: what it writes is reasoning."""
    # lazy: tests/parsers/conftest.py imports this module
    from tests.parsers.conftest import CHAT_TEMPLATE, byte_tokenizer, write_byte_model

    no_think = "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    assert no_think in CHAT_TEMPLATE
    path = write_byte_model(tmp_path_factory.mktemp("thinking_byte_qwen3"))
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE.replace(no_think, no_think + "{% else %}<think>")
    tokenizer.save_pretrained(path)
    running = start_server(path)
    yield running
    stop_server(running)


@pytest.fixture()
def client(server: Server):
    """The official OpenAI client on the test server (no retries: a 429 must surface)."""
    from openai import OpenAI

    with OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture()
def http(server: Server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c
