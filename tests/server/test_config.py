"""`axon serve` configuration: defaults, TOML, `AXON_*` overrides with `__` nesting, flags."""

from __future__ import annotations

import pytest

from axon.cli import build_parser
from axon.server.config import (
    ServerConfig,
    SourceConfig,
    config_from_mapping,
    env_overrides,
    load_config,
    parse_env_value,
)
from axon.server.schemas.node_protocol import EngineArgs, ModelSpec
from axon.server.serve_args import config_from_namespace

TOML = """
host = "0.0.0.0"
port = 9100
api_key = "from-file"
shutdown_grace_s = 5
max_waiting_requests = 32

[engine]
max_num_seqs = 4
kv_cache_memory = "64M"

[[default_models]]
model_id = "Qwen/Qwen3-0.6B"
max_model_len = 2048

[[default_models]]
model_id = "unsloth/Qwen3-0.6B-GGUF"
quant = "Q4_K_M"
served_model_name = "qwen-gguf"

[sources.mirror]
endpoint = "http://mirror.local"
auth_env = "MIRROR_TOKEN"
"""


@pytest.fixture
def toml_file(tmp_path):
    path = tmp_path / "axon.toml"
    path.write_text(TOML)
    return path


def test_defaults():
    config = load_config(None, environ={})
    assert (config.host, config.port, config.api_key) == ("127.0.0.1", 8000, None)
    assert config.default_models == () and config.shutdown_grace_s == 20.0
    assert config.max_waiting_requests == 256 and config.default_source == "huggingface"


def test_toml(toml_file):
    config = load_config(toml_file, environ={})
    assert (config.host, config.port, config.api_key) == ("0.0.0.0", 9100, "from-file")
    assert config.shutdown_grace_s == 5.0 and isinstance(config.shutdown_grace_s, float)
    assert config.engine == EngineArgs(max_num_seqs=4, kv_cache_memory=64 * 2**20)
    first, second = config.default_models
    assert first.model_id == "Qwen/Qwen3-0.6B" and first.max_model_len == 2048
    assert second.served_id == "qwen-gguf" and second.quant == "Q4_K_M"
    assert config.sources["mirror"] == SourceConfig("http://mirror.local", "MIRROR_TOKEN")


def test_env_overrides_toml(toml_file):
    env = {
        "AXON_PORT": "9000",
        "AXON_API_KEY": "12345",  # digits, still a string key
        "AXON_ENGINE__MAX_NUM_SEQS": "8",
        "AXON_ENGINE__ENABLE_PREFIX_CACHING": "false",
        "AXON_SOURCES__MIRROR__CACHE_DIR": "/tmp/mirror-cache",
        "AXON_DEBUG_POISON": "some-model",  # another layer's variable: ignored here
        "OTHER": "x",
    }
    config = load_config(toml_file, environ=env)
    assert config.port == 9000 and config.api_key == "12345"
    assert config.engine.max_num_seqs == 8 and config.engine.enable_prefix_caching is False
    assert config.engine.kv_cache_memory == 64 * 2**20  # the file's value survives the merge
    assert config.sources["mirror"].cache_dir == "/tmp/mirror-cache"
    assert config.sources["mirror"].endpoint == "http://mirror.local"


def test_env_default_models_as_toml_literal():
    env = {"AXON_DEFAULT_MODELS": '[{model_id = "a/b"}, {model_id = "/models/c"}]'}
    config = load_config(None, environ=env)
    assert [spec.model_id for spec in config.default_models] == ["a/b", "/models/c"]


def test_config_file_from_env(toml_file):
    assert load_config(None, environ={"AXON_CONFIG": str(toml_file)}).port == 9100


def test_parse_env_value():
    assert parse_env_value("8") == 8 and parse_env_value("true") is True
    assert parse_env_value("1.5") == 1.5 and parse_env_value("[1, 2]") == [1, 2]
    assert parse_env_value("plain text") == "plain text"
    assert parse_env_value("http://x:1") == "http://x:1"


def test_env_overrides_shape():
    tree = env_overrides({"AXON_A__B__C": "1", "AXON_A__D": "x", "AXON_Z": "1"}, known={"a"})
    assert tree == {"a": {"b": {"c": 1}, "d": "x"}}


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"prot": 1}, "unknown keys ['prot']"),
        ({"port": 70000}, "port must be in"),
        ({"port": "high"}, "port must be an integer"),
        ({"engine": {"max_num_seqs": 0}}, "max_num_seqs"),
        ({"engine": {"max_seqs": 1}}, "max_seqs"),
        ({"default_models": [{"quant": "Q4"}]}, "model_id"),
        ({"sources": {"m": {"url": "x"}}}, "[sources.m]"),
        ({"shutdown_grace_s": -1}, "shutdown_grace_s"),
    ],
)
def test_bad_config_names_the_value(data, needle):
    with pytest.raises(ValueError, match=None) as info:
        config_from_mapping(data)
    assert needle in str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="missing.toml"):
        load_config(tmp_path / "missing.toml", environ={})
    broken = tmp_path / "broken.toml"
    broken.write_text("port = = 1")
    with pytest.raises(ValueError, match="broken.toml"):
        load_config(broken, environ={})


def test_engine_args_merge():
    config = ServerConfig(engine=EngineArgs(max_num_seqs=4, block_size=8))
    spec = ModelSpec(model_id="m", max_num_seqs=2, dtype="float32")
    assert config.engine_args(spec) == {"max_num_seqs": 2, "block_size": 8, "dtype": "float32"}


def test_serve_flags_override_everything(toml_file, monkeypatch):
    monkeypatch.setenv("AXON_PORT", "9000")
    argv = ["serve", "/models/x", "-c", str(toml_file), "--port", "7000"]
    argv += ["--api-key", "flag", "--max-num-seqs", "2", "--served-model-name", "x"]
    ns = build_parser().parse_args(argv)
    config = config_from_namespace(ns)
    assert config.port == 7000 and config.api_key == "flag" and config.host == "0.0.0.0"
    assert config.engine.max_num_seqs == 2 and config.engine.kv_cache_memory == 64 * 2**20
    assert [spec.served_id for spec in config.default_models] == [
        "x",
        "Qwen/Qwen3-0.6B",
        "qwen-gguf",
    ]


def test_serve_without_model_or_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./axon.toml here
    for name in ("AXON_PORT", "AXON_API_KEY", "AXON_CONFIG", "AXON_DEFAULT_MODELS"):
        monkeypatch.delenv(name, raising=False)
    config = config_from_namespace(build_parser().parse_args(["serve"]))
    assert config.default_models == () and config.port == 8000


def test_allowed_local_model_paths(tmp_path):
    assert load_config(None, environ={}).allowed_local_model_paths is None  # the defaults
    toml = tmp_path / "axon.toml"
    toml.write_text('allowed_local_model_paths = ["/srv/models", "~/models"]\n')
    assert load_config(toml, environ={}).allowed_local_model_paths == ("/srv/models", "~/models")
    from_env = {"AXON_ALLOWED_LOCAL_MODEL_PATHS": "/data/models"}  # one path, or a TOML list
    assert load_config(None, environ=from_env).allowed_local_model_paths == ("/data/models",)
    from_env["AXON_ALLOWED_LOCAL_MODEL_PATHS"] = '["/a", "/b"]'
    assert load_config(None, environ=from_env).allowed_local_model_paths == ("/a", "/b")
    argv = ["serve", "-c", str(toml), "--allowed-local-model-path", "/x"]
    argv += ["--allowed-local-model-path", "/y"]
    config = config_from_namespace(build_parser().parse_args(argv), environ={})
    assert config.allowed_local_model_paths == ("/x", "/y")  # flags replace the file's list
    for bad in ("allowed_local_model_paths = 3", 'allowed_local_model_paths = [""]'):
        toml.write_text(bad + "\n")
        with pytest.raises(ValueError, match="allowed_local_model_paths"):
            load_config(toml, environ={})


def test_serve_passes_adaptive_threads_and_activation_precision(monkeypatch):
    monkeypatch.delenv("AXON_CONFIG", raising=False)
    argv = ["serve", "/models/x.gguf", "--no-adaptive-threads", "--activation-precision", "int8"]
    argv += ["--kv-cache-dtype", "float32"]
    config = config_from_namespace(build_parser().parse_args(argv), environ={})
    assert config.engine.adaptive_threads is False
    assert config.engine.activation_precision == "int8"
    assert config.engine.kv_cache_dtype == "float32"
    config = config_from_namespace(build_parser().parse_args(["serve", "/m.gguf"]), environ={})
    assert config.engine.adaptive_threads is None  # unset: the engine's default (on)
