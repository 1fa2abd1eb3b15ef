"""`axon serve` configuration: defaults, then `axon.toml`, then `AXON_*` environment variables
(`__` nests: `AXON_ENGINE__MAX_NUM_SEQS=8`), then command-line flags.

The default port is 8000, vLLM's, so that OpenAI clients and scripts written for vLLM find axon
where they expect a server (neuron's 13131 is one `--port` away).
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from axon.server.schemas.node_protocol import EngineArgs, ModelSpec

logger = logging.getLogger(__name__)

ENV_PREFIX = "AXON_"
DEFAULT_CONFIG_FILE = "axon.toml"
HUGGINGFACE = "huggingface"


@dataclass(frozen=True)
class SourceConfig:
    """One model registry (`[sources.<scheme>]`): an HF-compatible endpoint, the env var that
    holds its bearer token, and its own cache dir. None means the huggingface_hub default."""

    endpoint: str | None = None
    auth_env: str | None = None
    cache_dir: str | None = None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # The node-management routes' own key (load, unload): the gateway holds it, users the
    # inference key (auth.py). None: those routes take api_key like every other.
    admin_api_key: str | None = None
    default_models: tuple[ModelSpec, ...] = ()
    engine: EngineArgs = field(default_factory=EngineArgs)  # defaults for every model
    max_waiting_requests: int = 256  # per model, beyond the running batch: then 429
    max_waiting_tokens: int = 1 << 20  # per model, prompt tokens waiting for a first token
    # How big one request may be (server/admission.py): its sequences (prompts x n) and the
    # worst case of its answer's entries (tokens x (1 + top_logprobs)); None: each model's
    # default, derived from its max_num_seqs and context. Beyond either: a 400, idle or busy.
    max_sequences_per_request: int | None = None
    max_output_entries_per_request: int | None = None
    shutdown_grace_s: float = 20.0
    default_source: str = HUGGINGFACE
    sources: Mapping[str, SourceConfig] = field(default_factory=dict)
    log_level: str = "info"
    # Liveness of the engine processes: a running engine silent this long is wedged (killed,
    # its requests fail with 503, the model recovers); a load may take this long.
    engine_step_timeout_s: float = 120.0
    engine_load_timeout_s: float = 1800.0
    # A faulted model's recovery: this many engine starts, the first at once, then after
    # recovery_backoff_s, doubling each time (at most RECOVERY_MAX_DELAY_S); then it is failed.
    recovery_attempts: int = 5
    recovery_backoff_s: float = 1.0
    # The HTTP edge: request bodies beyond this are a 413 (and up to four times as much again
    # is read and discarded after it, so that a client still uploading reads it); a client gets
    # this long to send its request line and headers, and this long between two pieces of its
    # body; connections beyond max_connections are answered 503.
    max_request_body_bytes: int = 32 << 20
    request_header_timeout_s: float = 10.0
    request_body_timeout_s: float = 30.0
    max_connections: int = 1024
    # Directories that `POST /models/load` may name local models and chat templates in; None:
    # the HF cache and axon's model cache (sources.allowed_local_roots).
    allowed_local_model_paths: tuple[str, ...] | None = None
    # Where a `POST /models/load` may name chat template files besides the model's own folder.
    chat_template_dir: str | None = None
    # Image URLs (multimodal/fetch.py): data: URIs always; http(s) only to these hosts ("*":
    # any), never to private, loopback or link-local addresses unless allowed; file:// only
    # under allowed_local_media_path. Each image is at most max_image_bytes and is fetched
    # within media_fetch_timeout_s.
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    allow_private_media_addresses: bool = False
    max_image_bytes: int = 20 << 20
    media_fetch_timeout_s: float = 10.0
    # Other names a served model answers to (`[model_aliases]`, alias -> served id), for clients
    # that insist on their own model name (Claude Code sends "claude-sonnet-4-5"); checked
    # against the startup models by check_model_aliases.
    model_aliases: Mapping[str, str] = field(default_factory=dict)
    # Models on demand (lifecycle/on_demand.py): the dirs whose models /v1/models lists and a
    # request may load (None: none here; `axon serve` fills in axon's model cache and the HF
    # cache), whether a request loads one, how many models may be loaded at once, how long an
    # unused model stays loaded, and how long a request waits for a load (then 503).
    models_dirs: tuple[str, ...] | None = None
    load_on_demand: bool = True
    max_loaded_models: int | None = None
    idle_unload_s: float | None = None
    on_demand_wait_s: float = 120.0

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"config: {name} {why}, got {getattr(self, name)!r}")

        check(0 <= self.port <= 65535, "port", "must be in [0, 65535]")
        check(self.api_key is None or len(self.api_key) > 0, "api_key", "must not be empty")
        admin = self.admin_api_key
        check(admin is None or len(admin) > 0, "admin_api_key", "must not be empty")
        check(admin is None or admin != self.api_key, "admin_api_key", "must differ from api_key")
        check(self.max_waiting_requests >= 0, "max_waiting_requests", "must be >= 0")
        check(self.max_waiting_tokens >= 1, "max_waiting_tokens", "must be >= 1")
        for name in ("max_sequences_per_request", "max_output_entries_per_request"):
            check(getattr(self, name) is None or getattr(self, name) >= 1, name, "must be >= 1")
        check(self.shutdown_grace_s >= 0, "shutdown_grace_s", "must be >= 0")
        check(self.recovery_attempts >= 1, "recovery_attempts", "must be >= 1")
        check(bool(self.default_source), "default_source", "must not be empty")
        for name in _POSITIVE_FIELDS:
            check(getattr(self, name) > 0, name, "must be > 0")
        paths = self.allowed_local_model_paths
        check(paths is None or all(paths), "allowed_local_model_paths", "must not hold ''")
        media_path = self.allowed_local_media_path
        check(
            media_path is None or Path(media_path).is_absolute(),
            "allowed_local_media_path",
            "must be an absolute path",
        )
        check(all(self.allowed_media_domains), "allowed_media_domains", "must not hold ''")
        check(all(self.models_dirs or ()), "models_dirs", "must not hold ''")
        limit = self.max_loaded_models
        check(limit is None or limit >= 1, "max_loaded_models", "must be >= 1")
        idle = self.idle_unload_s
        check(idle is None or idle > 0, "idle_unload_s", "must be > 0")
        aliases = self.model_aliases.items()
        check(all(a and t for a, t in aliases), "model_aliases", "must not hold ''")

    def engine_args(self, spec: ModelSpec) -> dict[str, Any]:
        """The engine arguments for `spec`: the server's defaults, overridden by the spec's own."""
        return {**self.engine.engine_args(), **spec.engine_args()}

    def check_model_aliases(self) -> None:
        """Raises ValueError naming an alias that names no startup model (`default_models`),
        or that is itself a model's id (which of the two a request meant would be a guess)."""
        served = sorted(spec.served_id for spec in self.default_models)
        for alias, target in self.model_aliases.items():
            if alias in served:
                raise ValueError(f"config: model alias {alias!r} is a served model's own id")
            if target not in served:
                raise ValueError(
                    f"config: model alias {alias!r} names {target!r}, which is no model served "
                    f"at startup (served: {served})"
                )

    def with_overrides(self, **overrides: Any) -> ServerConfig:
        """A copy with the given fields replaced; None values are ignored (an unset flag)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def parse_env_value(text: str) -> Any:
    """An environment value as TOML reads it (`8`, `true`, `[1, 2]`, `{a = 1}`), else the text."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def env_overrides(environ: Mapping[str, str], known: set[str]) -> dict[str, Any]:
    """The nested mapping that `AXON_*` variables spell, for the top-level keys in `known`.

    Other `AXON_*` variables (debug hooks of other layers, AXON_CONFIG) are left alone.
    """
    tree: dict[str, Any] = {}
    for name, text in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        if path[0] not in known or not all(path):
            continue
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{name}: {part!r} is set both as a value and as a table")
        node[path[-1]] = parse_env_value(text)
    return tree


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `over` laid on top; tables merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


_STR_FIELDS = {
    "host",
    "api_key",
    "admin_api_key",
    "default_source",
    "log_level",
    "allowed_local_media_path",
    "chat_template_dir",
}
_FLOAT_FIELDS = {
    "shutdown_grace_s",
    "engine_step_timeout_s",
    "engine_load_timeout_s",
    "request_header_timeout_s",
    "request_body_timeout_s",
    "media_fetch_timeout_s",
    "recovery_backoff_s",
    "idle_unload_s",
    "on_demand_wait_s",
}
_INT_FIELDS = {
    "port",
    "max_waiting_requests",
    "max_waiting_tokens",
    "max_sequences_per_request",
    "max_output_entries_per_request",
    "max_request_body_bytes",
    "max_connections",
    "max_image_bytes",
    "recovery_attempts",
    "max_loaded_models",
}
_POSITIVE_FIELDS = sorted(
    _FLOAT_FIELDS - {"shutdown_grace_s", "idle_unload_s"}
    | {"max_request_body_bytes", "max_connections", "max_image_bytes"}
)


def _coerce(name: str, value: Any) -> Any:
    """A TOML/env value in the field's type; sections become their typed objects."""
    if name == "default_models":
        items = [value] if isinstance(value, Mapping) else value
        if not isinstance(items, list):
            raise ValueError(f"config: default_models must be a list of tables, got {value!r}")
        return tuple(ModelSpec.model_validate(item) for item in items)
    if name == "engine":
        return EngineArgs.model_validate(value)
    if name == "sources":
        return {scheme: _source(scheme, table) for scheme, table in value.items()}
    if name == "model_aliases":
        return _aliases(value)
    if name in ("allowed_local_model_paths", "allowed_media_domains", "models_dirs"):
        return _strings(name, value)
    if name in ("allow_private_media_addresses", "load_on_demand"):
        if not isinstance(value, bool):
            raise ValueError(f"config: {name} must be true or false, got {value!r}")
        return value
    if name in _STR_FIELDS:
        return str(value)
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"config: {name} must be a number, got {value!r}")
        return float(value)
    integer = isinstance(value, int) and not isinstance(value, bool)
    if name in _INT_FIELDS and not integer:
        raise ValueError(f"config: {name} must be an integer, got {value!r}")
    return value


def _strings(name: str, value: Any) -> tuple[str, ...]:
    """A list from TOML (a list) or an environment variable (a TOML list, or one item)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ValueError(f"config: {name} must be a list of strings, got {value!r}")
    return tuple(items)


def _aliases(table: Any) -> dict[str, str]:
    """`[model_aliases]`: a table of alias = "served id" strings."""
    if not isinstance(table, Mapping) or not all(
        isinstance(alias, str) and isinstance(target, str) for alias, target in table.items()
    ):
        raise ValueError(f"config: model_aliases must map names to served ids, got {table!r}")
    return dict(table)


def _source(scheme: str, table: Any) -> SourceConfig:
    known = {f.name for f in fields(SourceConfig)}
    if not isinstance(table, Mapping) or set(table) - known:
        raise ValueError(f"config: [sources.{scheme}] takes only {sorted(known)}, got {table!r}")
    return SourceConfig(**{k: str(v) for k, v in table.items()})


def config_from_mapping(data: Mapping[str, Any]) -> ServerConfig:
    """A ServerConfig from a TOML-shaped mapping; an unknown key or a bad value is a ValueError."""
    known = {f.name for f in fields(ServerConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"config: unknown keys {unknown}; known: {sorted(known)}")
    try:
        return ServerConfig(**{name: _coerce(name, value) for name, value in data.items()})
    except ValidationError as exc:
        raise ValueError(f"config: {exc}") from None


def load_config(
    path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """The server config from the TOML file at `path` (else $AXON_CONFIG, else ./axon.toml when
    it exists) with `AXON_*` overrides from `environ` (default: the process environment)."""
    environ = os.environ if environ is None else environ
    data = _read_toml(path or environ.get(f"{ENV_PREFIX}CONFIG"))
    known = {f.name for f in fields(ServerConfig)}
    return config_from_mapping(deep_merge(data, env_overrides(environ, known)))


def _read_toml(path: str | os.PathLike | None) -> dict[str, Any]:
    if path is None:
        if not Path(DEFAULT_CONFIG_FILE).is_file():
            return {}
        path = DEFAULT_CONFIG_FILE
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"config file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {str(path)!r}: {exc}") from None
    logger.info("config read from %s", path)
    return data
