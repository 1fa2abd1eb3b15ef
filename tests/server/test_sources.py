"""Model sources: id parsing, registry resolution, preflight and a real download, against a mock
HF-compatible registry on loopback (the endpoints huggingface_hub calls), never the internet."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from axon.server.config import ServerConfig, SourceConfig
from axon.server.errors import BadRequest, Unprocessable
from axon.server.lifecycle import local_paths
from axon.server.lifecycle.local_paths import (
    PathNotAllowed,
    check_model_files,
    list_checkpoint_files,
)
from axon.server.lifecycle.sources import (
    allowed_local_roots,
    is_repo_id,
    local_model_path,
    nearest_quant,
    parse_model_ref,
    plan_files,
    quant_label,
    resolve_model,
    resolve_source,
)
from axon.server.lifecycle.templates import read_chat_template
from axon.server.schemas.node_protocol import ModelSpec
from tests.model.tiny_models import get_tiny_model

GGUF_FILES = ["Qwen3-0.6B-Q4_K_M.gguf", "Qwen3-0.6B-Q8_0.gguf", "Qwen3-0.6B-F16.gguf"]


# ---- the mock registry -----------------------------------------------------------------------


class MockHub:
    """Repos in memory: {repo_id: {filename: bytes}}; one commit sha per repo."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, authorization

    def add(self, repo_id: str, files: dict[str, bytes]) -> None:
        self.repos[repo_id] = files

    def sha(self, repo_id: str) -> str:
        return hashlib.sha1(repo_id.encode()).hexdigest()

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next):
            auth = request.headers.get("authorization")
            self.requests.append((request.method, request.url.path, auth))
            return await call_next(request)

        app.add_api_route("/api/models/{org}/{name}", self._info, methods=["GET"])
        app.add_api_route("/api/models/{org}/{name}/revision/{rev}", self._info, methods=["GET"])
        app.add_api_route("/api/models/{org}/{name}/tree/{rev}", self._tree, methods=["GET"])
        app.add_api_route(
            "/{org}/{name}/resolve/{rev}/{path:path}", self._file, methods=["GET", "HEAD"]
        )
        return app

    def _missing(self, repo_id: str) -> Response:
        return JSONResponse(
            {"error": f"Repository {repo_id} not found"},
            status_code=404,
            headers={"X-Error-Code": "RepoNotFound"},
        )

    async def _info(self, org: str, name: str, rev: str = "main"):
        repo_id = f"{org}/{name}"
        if repo_id not in self.repos:
            return self._missing(repo_id)
        siblings = [{"rfilename": f} for f in sorted(self.repos[repo_id])]
        return {"id": repo_id, "sha": self.sha(repo_id), "private": False, "siblings": siblings}

    async def _tree(self, org: str, name: str, rev: str):
        repo_id = f"{org}/{name}"
        if repo_id not in self.repos:
            return self._missing(repo_id)
        return [
            {"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            for f, data in sorted(self.repos[repo_id].items())
        ]

    async def _file(self, request: Request, org: str, name: str, rev: str, path: str):
        repo_id = f"{org}/{name}"
        data = self.repos.get(repo_id, {}).get(path)
        if data is None:
            return Response(status_code=404, headers={"X-Error-Code": "EntryNotFound"})
        headers = {
            "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
            "X-Repo-Commit": self.sha(repo_id),
            "Content-Length": str(len(data)),
        }
        body = b"" if request.method == "HEAD" else data
        return Response(body, headers=headers, media_type="application/octet-stream")


@pytest.fixture(scope="module")
def hub():
    """A MockHub served by uvicorn on a loopback port; yields (hub, base_url)."""
    mock = MockHub()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(mock.app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "mock hub did not start"
        time.sleep(0.01)
    yield mock, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def hf_env(hub, tmp_path, monkeypatch):
    """The process environment pointed at the mock hub with an empty cache; returns the cache."""
    _, url = hub
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return cache


def _preflight(spec: ModelSpec) -> Unprocessable:
    with pytest.raises(Unprocessable) as info:
        resolve_model(spec, ServerConfig())
    return info.value


# ---- ids and sources --------------------------------------------------------------------------


def test_parse_model_ref():
    assert parse_model_ref("Qwen/Qwen3-0.6B") == parse_model_ref("huggingface:Qwen/Qwen3-0.6B")
    ref = parse_model_ref("mirror:Org/Name@v1.0")
    assert (ref.scheme, ref.repo_id, ref.revision) == ("mirror", "Org/Name", "v1.0")
    assert parse_model_ref("Org/Name", revision="dev").revision == "dev"
    assert parse_model_ref("Org/Name", default_scheme="mirror").scheme == "mirror"


@pytest.mark.parametrize(
    "bad",
    ["Qwen3-0.6B", "a/b/c", ":Org/Name", "Org/", "/Name", "s:Org/Na:me", "Org/Name@", "a/b:c/d"],
)
def test_parse_model_ref_rejects(bad):
    with pytest.raises(BadRequest):
        parse_model_ref(bad)


def test_parse_model_ref_revision_conflict():
    with pytest.raises(BadRequest, match="conflicts"):
        parse_model_ref("Org/Name@a", revision="b")


def test_local_paths(tmp_path):
    assert local_model_path(str(tmp_path)) == tmp_path.resolve()
    assert local_model_path("Org/Name") is None
    with pytest.raises(BadRequest, match="does not exist"):
        local_model_path(str(tmp_path / "missing"))
    # The operator's own odd ids are 400s too, not OSError (name too long) or RuntimeError.
    for odd in ("/" + "x" * 5000, "~no-such-user-axon/model", "/a\0b"):
        with pytest.raises(BadRequest):
            local_model_path(odd)


def _not_allowed_message(model_id: str, roots) -> str:
    with pytest.raises(PathNotAllowed) as info:
        local_model_path(model_id, roots)
    assert info.value.status_code == 400 and info.value.param == "model_id"
    return info.value.message.replace(repr(model_id), "ID")


def test_untrusted_paths_are_confined_to_the_roots(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "model").mkdir(parents=True)
    (outside / "model").mkdir(parents=True)
    (allowed / "escape").symlink_to(outside / "model")
    os.mkfifo(allowed / "fifo")
    roots = (allowed.resolve(),)
    assert local_model_path(str(allowed / "model"), roots) == (allowed / "model").resolve()
    (tmp_path / "via-link").symlink_to(allowed)  # a root spelled through a symlink
    for spelling in (tmp_path / "via-link", allowed):
        found = local_model_path(str(spelling / "model"), (tmp_path / "via-link",))
        assert found == (allowed / "model").resolve()
    assert local_model_path(str(allowed / "x" / ".." / "model"), roots) is not None
    # Outside, missing, escaping by symlink or `..`, or a FIFO: one and the same answer.
    refused = [outside / "model", outside / "missing", allowed / "missing", allowed / "escape"]
    refused += [allowed / ".." / "outside" / "model", allowed / "fifo"]
    messages = {_not_allowed_message(str(path), roots) for path in refused}
    messages |= {_not_allowed_message(bad, roots) for bad in ("/", "/proc/1/root", "~root")}
    assert len(messages) == 1 and str(allowed.resolve()) in messages.pop()
    assert local_model_path("Org/Name", roots) is None  # a repo id
    with pytest.raises(BadRequest, match="too long"):
        local_model_path("x" * 5000, roots)


def test_default_roots_and_repo_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AXON_CACHE_DIR", str(tmp_path / "axon"))
    roots = allowed_local_roots(ServerConfig(), {"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert roots == (tmp_path / "hub", tmp_path / "axon" / "models")  # not the working dir
    configured = ServerConfig(allowed_local_model_paths=("~/m", "rel"))
    assert allowed_local_roots(configured, {}) == (Path.home() / "m", tmp_path / "rel")
    assert is_repo_id("Org/Name") and is_repo_id("mirror:Org/Name@v1")
    assert not any(map(is_repo_id, ("/a/b", "./a/b", "~/a/b", "name", "a/b/c")))


def test_checkpoint_listing_is_bounded(tmp_path, monkeypatch):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "linked").symlink_to(tmp_path / "sub", target_is_directory=True)
    for name in ("model.safetensors", "sub/config.json", "sub/deeper/x.gguf"):
        (tmp_path / name).write_bytes(b"x")
    assert sorted(list_checkpoint_files(tmp_path, "m")) == ["model.safetensors", "sub/config.json"]
    monkeypatch.setattr(local_paths, "MAX_LISTED_ENTRIES", 3)
    with pytest.raises(BadRequest, match="more than 3 entries"):
        list_checkpoint_files(tmp_path, "m")


def test_422s_list_no_files_outside_the_roots(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in GGUF_FILES:
        (outside / name).write_bytes(b"x")
    config = ServerConfig(allowed_local_model_paths=(str(tmp_path / "allowed"),))
    with pytest.raises(PathNotAllowed) as info:
        resolve_model(ModelSpec(model_id=str(outside), quant="nope"), config)
    assert "gguf" not in info.value.message.lower() and "Q8_0" not in str(info.value.body())
    # The operator's own spec is trusted: the same path preflights (and lists its quants).
    with pytest.raises(Unprocessable, match="no .gguf file matches"):
        resolve_model(ModelSpec(model_id=str(outside), quant="nope"), config, trusted=True)


def _template(path, config, trusted=False, model_path=None):
    spec = ModelSpec(model_id="Org/Name", chat_template=str(path))
    return read_chat_template(spec, config, {}, trusted=trusted, model_path=model_path)


def test_chat_template_file_rules(tmp_path):
    config = ServerConfig(allowed_local_model_paths=(str(tmp_path),))
    model = tmp_path / "model"
    model.mkdir()
    (model / "t.jinja").write_text("{{ messages }}")
    for name in ("t.jinja", "./t.jinja", model / "t.jinja"):  # in the model's folder
        assert _template(name, config, model_path=model) == "{{ messages }}"
    assert _template("{{ messages }}", config) == "{{ messages }}"  # template text
    assert read_chat_template(ModelSpec(model_id="Org/Name"), config, {}) is None
    (tmp_path / "beside.jinja").write_text("{{ messages }}")
    for name in ("/etc/passwd", tmp_path / "beside.jinja", "../beside.jinja"):
        with pytest.raises(PathNotAllowed) as info:
            _template(name, config, model_path=model)  # outside the model's folder
        assert info.value.param == "chat_template"
    templates = ServerConfig(
        allowed_local_model_paths=(str(tmp_path),), chat_template_dir=str(tmp_path)
    )
    assert _template("beside.jinja", templates, model_path=model) == "{{ messages }}"
    (model / "big.jinja").write_text("x" * ((1 << 20) + 1))
    for big in ("big.jinja", "{{ x }}" * (1 << 18)):  # a file, or text
        with pytest.raises(BadRequest, match="1 MiB"):
            _template(big, config, model_path=model)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.jinja"
    outside.write_text("trusted")
    assert _template(outside, config, trusted=True) == "trusted"


def test_chat_template_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.jinja"
    os.mkfifo(fifo)
    results: list[Exception] = []

    def read(trusted: bool) -> None:
        try:
            _template(fifo, ServerConfig(allowed_local_model_paths=(str(tmp_path),)), trusted)
        except BadRequest as exc:
            results.append(exc)

    for trusted in (False, True):  # the path check refuses it, and so does the reader itself
        reader = threading.Thread(target=read, args=(trusted,), daemon=True)
        reader.start()
        reader.join(10)
        if reader.is_alive():  # release the blocked reader before failing
            with open(fifo, "w"):
                pass
        assert not reader.is_alive(), "reading a FIFO blocked"
    assert len(results) == 2 and "not a regular file" in results[1].message


def test_huggingface_source_follows_hf_env(tmp_path):
    env = {"HF_ENDPOINT": "http://mirror.local/", "HF_HOME": str(tmp_path), "HF_TOKEN": "t"}
    source = resolve_source("huggingface", ServerConfig(), env)
    assert source.endpoint == "http://mirror.local"
    assert source.cache_dir == str(tmp_path / "hub")
    assert source.token == "t"
    env["HF_HUB_CACHE"] = str(tmp_path / "explicit")
    assert resolve_source("huggingface", ServerConfig(), env).cache_dir == str(
        tmp_path / "explicit"
    )
    default = resolve_source("huggingface", ServerConfig(), {})
    assert default.endpoint == "https://huggingface.co" and default.token is None
    assert default.cache_dir.endswith("huggingface/hub")


def test_configured_source(tmp_path):
    mirror = SourceConfig(endpoint="http://m:1", auth_env="MIRROR_TOKEN", cache_dir=str(tmp_path))
    config = ServerConfig(sources={"mirror": mirror})
    source = resolve_source("mirror", config, {"MIRROR_TOKEN": "secret", "HF_TOKEN": "hf"})
    assert (source.endpoint, source.token, source.cache_dir) == (
        "http://m:1",
        "secret",
        str(tmp_path),
    )
    # Without its own token a mirror gets none, never the hub's.
    assert resolve_source("mirror", config, {"HF_TOKEN": "hf"}).token is False
    with pytest.raises(BadRequest, match="unknown model source 'other'"):
        resolve_source("other", config, {})


# ---- preflight classification (pure) ---------------------------------------------------------


def test_plan_dense():
    plan = plan_files("m", ["config.json", "model.safetensors", "model.gguf"], None)
    assert plan.gguf_file is None and "*.safetensors" in plan.allow_patterns


def test_plan_quant_picks_gguf_case_insensitively():
    plan = plan_files("m", ["config.json", *GGUF_FILES], "q8_0")
    assert plan.gguf_file == "Qwen3-0.6B-Q8_0.gguf"
    assert "Qwen3-0.6B-Q4_K_M.gguf" not in plan.allow_patterns


def test_plan_sharded_gguf_fetches_every_shard():
    files = [f"M-Q4_K_M-0000{i}-of-00002.gguf" for i in (1, 2)] + ["M-Q8_0.gguf"]
    plan = plan_files("m", files, "Q4_K_M")
    assert plan.gguf_file == files[0]
    assert set(files[:2]) <= set(plan.allow_patterns) and files[2] not in plan.allow_patterns


def test_quant_labels_and_nearest():
    assert quant_label("Qwen3-0.6B-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_label("model.Q5_K_S.gguf") == "Q5_K_S"
    assert nearest_quant("Q4_K_S", GGUF_FILES) == "Q4_K_M"


def test_plan_errors():
    with pytest.raises(Unprocessable) as info:
        plan_files("m", ["README.md", "pytorch_model.bin"], None)
    assert info.value.code == "empty_repo"
    # Tensor parallelism takes a GGUF-only repo's file (its split is checked once fetched).
    assert plan_files("m", GGUF_FILES[:1], None, tensor_parallel=2).gguf_file == GGUF_FILES[0]
    with pytest.raises(Unprocessable) as info:
        plan_files("m", GGUF_FILES, None)  # several quants and no choice made
    assert info.value.code == "quant_not_found"
    assert plan_files("m", GGUF_FILES[:1], None).gguf_file == GGUF_FILES[0]


# ---- against the mock registry ---------------------------------------------------------------


def test_download_tiny_checkpoint(hub, hf_env, tiny_model_root):
    mock, _ = hub
    checkpoint = get_tiny_model("qwen3", tiny_model_root).path
    files = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()}
    mock.add("tiny/qwen3", {**files, "pytorch_model.bin": b"not fetched"})
    path = resolve_model(ModelSpec(model_id="tiny/qwen3"), ServerConfig())
    assert path.parent == hf_env / "models--tiny--qwen3" / "snapshots"  # the hf-hub layout
    assert {p.name for p in path.iterdir()} == set(files)
    for name, data in files.items():
        assert (path / name).read_bytes() == data
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(path).model_type == "qwen3"
    # Cached: a second resolve fetches no file again.
    fetched = sum(1 for m, p, _ in mock.requests if m == "GET" and "/resolve/" in p)
    assert resolve_model(ModelSpec(model_id="tiny/qwen3"), ServerConfig()) == path
    assert sum(1 for m, p, _ in mock.requests if m == "GET" and "/resolve/" in p) == fetched


def test_download_gguf_quant(hub, hf_env):
    mock, _ = hub
    mock.add("org/q-gguf", {name: name.encode() for name in GGUF_FILES} | {"config.json": b"{}"})
    path = resolve_model(ModelSpec(model_id="org/q-gguf", quant="q4_k_m"), ServerConfig())
    assert path.name == "Qwen3-0.6B-Q4_K_M.gguf" and path.read_bytes() == path.name.encode()
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "Qwen3-0.6B-Q4_K_M.gguf",
        "config.json",
    ]


def test_repo_fetch_failed(hub, hf_env):
    error = _preflight(ModelSpec(model_id="nobody/missing"))
    assert error.status_code == 422 and error.code == "repo_fetch_failed"
    body = error.body()["error"]
    assert body["kind"] == "repo_fetch_failed" and body["model_id"] == "nobody/missing"
    assert body["status"] == 404
    assert not hf_env.exists() or not any(hf_env.rglob("*.json"))  # nothing was downloaded


def test_unreachable_registry_is_repo_fetch_failed(hf_env, monkeypatch):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert _preflight(ModelSpec(model_id="org/any")).code == "repo_fetch_failed"


def test_empty_repo(hub, hf_env):
    hub[0].add("org/empty", {"README.md": b"# nothing"})
    error = _preflight(ModelSpec(model_id="org/empty"))
    assert error.code == "empty_repo" and error.body()["error"]["kind"] == "empty_repo"


def test_quant_not_found_suggests_nearest(hub, hf_env):
    hub[0].add("org/quants", {name: b"x" for name in GGUF_FILES})
    error = _preflight(ModelSpec(model_id="org/quants", quant="Q4_K_S"))
    body = error.body()["error"]
    assert body["kind"] == "quant_not_found" and body["suggestion"] == "Q4_K_M"
    assert body["available"] == ["F16", "Q4_K_M", "Q8_0"]
    assert "did you mean 'Q4_K_M'" in body["message"]
    assert not any("org/quants/resolve/" in p for _, p, _ in hub[0].requests)


def test_scheme_source_with_token(hub, tmp_path, monkeypatch):
    mock, url = hub
    mock.add("priv/model", {"config.json": b"{}", "model.safetensors": b"weights"})
    monkeypatch.setenv("MIRROR_TOKEN", "s3cret")
    mirror = SourceConfig(endpoint=url, auth_env="MIRROR_TOKEN", cache_dir=str(tmp_path / "m"))
    config = ServerConfig(sources={"mirror": mirror})
    path = resolve_model(ModelSpec(model_id="mirror:priv/model"), config)
    assert path.is_relative_to(tmp_path / "m") and (path / "model.safetensors").is_file()
    auths = {auth for _, p, auth in mock.requests if "priv/model" in p}
    assert auths == {"Bearer s3cret"}


def test_local_directory_preflight(tmp_path):
    config = ServerConfig(allowed_local_model_paths=(str(tmp_path),))
    (tmp_path / "README.md").write_text("no weights")
    with pytest.raises(Unprocessable) as info:
        resolve_model(ModelSpec(model_id=str(tmp_path)), config)
    assert info.value.code == "empty_repo"
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(ModelSpec(model_id=str(tmp_path)), config) == tmp_path.resolve()


def test_offline_uses_the_cache(hub, hf_env, monkeypatch):
    hub[0].add("org/offline", {"config.json": b"{}", "model.safetensors": b"w"})
    online = resolve_model(ModelSpec(model_id="org/offline"), ServerConfig())
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # would fail if contacted
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(ModelSpec(model_id="org/offline"), ServerConfig()) == online


def test_hf_token_is_sent_to_the_hub(hub, hf_env, monkeypatch):
    mock, _ = hub
    mock.add("gated/model", {"config.json": b"{}", "model.safetensors": b"w"})
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    resolve_model(ModelSpec(model_id="gated/model"), ServerConfig())
    auths = {auth for _, p, auth in mock.requests if "gated/model" in p}
    assert auths == {"Bearer hf_test_token"}


def test_revision_is_passed_through(hub, hf_env):
    mock, _ = hub
    mock.add("org/revs", {"config.json": b"{}", "model.safetensors": b"w"})
    path = resolve_model(ModelSpec(model_id="org/revs@v2"), ServerConfig())
    assert any(p == "/api/models/org/revs/revision/v2" for _, p, _ in mock.requests)
    assert (hf_env / "models--org--revs" / "refs" / "v2").read_text() == path.name


def test_local_directory_quant_pick(tmp_path):
    config = ServerConfig(allowed_local_model_paths=(str(tmp_path),))
    for name in GGUF_FILES:
        (tmp_path / name).write_bytes(b"x")
    spec = ModelSpec(model_id=str(tmp_path), quant="q8_0")
    assert resolve_model(spec, config) == tmp_path.resolve() / "Qwen3-0.6B-Q8_0.gguf"
    with pytest.raises(Unprocessable) as info:  # inside the roots, the quants are listed
        resolve_model(ModelSpec(model_id=str(tmp_path), quant="Q4_K_S"), config)
    body = info.value.body()["error"]
    assert info.value.status_code == 422 and body["kind"] == "quant_not_found"
    assert body["available"] == ["F16", "Q4_K_M", "Q8_0"] and body["suggestion"] == "Q4_K_M"
    assert "did you mean 'Q4_K_M'" in body["message"]


def test_model_files_must_resolve_inside_the_roots(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "blobs").mkdir(parents=True)
    (outside / "dir").mkdir(parents=True)
    (outside / "secret").write_text("s")
    (allowed / "blobs" / "abc").write_text("{}")

    def model(name: str, **links: Path) -> Path:
        folder = allowed / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        for entry, target in links.items():
            (folder / entry.replace("__", "/").replace("_dot_", ".")).symlink_to(target)
        return folder

    roots = (allowed,)
    check_model_files(model("snapshot", config_dot_json=allowed / "blobs" / "abc"), roots, "m")
    for name, links in {
        "template": {"chat_template_dot_jinja": outside / "secret"},
        "missing": {"config_dot_json": outside / "missing"},  # existing or not: alike
        "linked-dir": {"sub": outside / "dir"},
    }.items():
        with pytest.raises(PathNotAllowed) as info:
            check_model_files(model(name, **links), roots, "m")
        assert info.value.param == "model_id" and str(outside) not in info.value.message
    indexed = model("indexed")
    index = {"weight_map": {"w": "../../outside/secret"}}
    (indexed / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PathNotAllowed):
        check_model_files(indexed, roots, "m")
    gguf_folder = model("gguf", tokenizer_dot_json=outside / "secret")
    (gguf_folder / "m.gguf").write_bytes(b"x")
    with pytest.raises(PathNotAllowed):  # a GGUF file's tokenizer files sit beside it
        check_model_files(gguf_folder / "m.gguf", roots, "m")
