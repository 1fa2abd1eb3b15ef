"""`axon serve`'s command line: its flags (the settings table's, the server's own, multi-node),
and the ServerConfig they make with the config file and environment, the demo models filled in
when no model is named."""

from __future__ import annotations

import argparse
import sys

from axon.demo import CHAT_DEMO_MODEL_ID, demo_models
from axon.server.config import ServerConfig, load_config
from axon.server.lifecycle.multinode import add_multinode_args
from axon.server.schemas.node_protocol import EngineArgs, ModelSpec
from axon.settings import ENGINE, SERVE, SETTINGS, SPEC, add_flags, select
from axon.settings import parse_mm_limits as parse_mm_limits  # --limit-mm-per-prompt's grammar

_ENGINE_FLAGS = tuple(EngineArgs.model_fields)
_MODEL_SETTINGS = select(SERVE, SPEC)  # the flags that go with MODEL: its load spec's settings
_SERVED_NAME = SETTINGS["served_model_name"]  # a flag of its own: it takes aliases too


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `axon serve` flags; `config_from_namespace` reads them."""
    parser.add_argument("model", nargs="?", help="model to load at startup: path or org/name")
    parser.add_argument("-c", "--config", help="TOML config file (default: ./axon.toml if any)")
    parser.add_argument("--host", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("-p", "--port", type=int, help="port to bind (default: 8000; 0: any)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or AXON_API_KEY)")
    parser.add_argument(
        "--admin-api-key",
        help="the key /models/load and /models/unload require instead (or AXON_ADMIN_API_KEY): "
        "the gateway's; inference routes do not take it",
    )
    add_flags(parser, [setting for setting in _MODEL_SETTINGS if setting is not _SERVED_NAME])
    _add_served_names(parser)
    add_multinode_args(parser)
    parser.add_argument("--shutdown-grace", type=float, help="seconds for in-flight requests")
    parser.add_argument(
        "--allowed-local-model-path",
        action="append",
        metavar="DIR",
        help="a directory POST /models/load may name local models in (repeatable; default: "
        "the HF cache and axon's model cache; the working directory only when named)",
    )
    parser.add_argument(
        "--chat-template-dir",
        metavar="DIR",
        help="a directory POST /models/load may name chat template files in, besides the "
        "model's own folder",
    )
    _add_media_args(parser)
    _add_on_demand_args(parser)
    parser.add_argument("--log-level", help="debug, info (default), warning, error")
    parser.add_argument(
        "--no-demo",
        action="store_true",
        help="with no MODEL and no default_models, start empty instead of serving the demo models",
    )
    group = parser.add_argument_group("engine defaults (every model; a load spec overrides them)")
    add_flags(group, select(SERVE, ENGINE))


def _add_served_names(parser: argparse.ArgumentParser) -> None:
    def name(text: str) -> str:
        try:
            return _SERVED_NAME.convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument(
        "--served-model-name",
        nargs="+",
        type=name,
        metavar="NAME",
        help="the id MODEL is served under (/v1/models shows it); further names are aliases "
        "requests may use too, as vLLM's (and [model_aliases] in the config file)",
    )


def _add_media_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        metavar="HOST",
        help="hosts whose http(s) image URLs may be fetched ('*': any public host; default: "
        "none, data: URIs only)",
    )
    parser.add_argument(
        "--allowed-local-media-path", metavar="DIR", help="file:// image URLs may read under DIR"
    )


def _add_on_demand_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models on demand")
    group.add_argument(
        "--models-dir",
        action="append",
        metavar="DIR",
        help="a directory whose models (.gguf files, safetensors folders, an HF cache) "
        "/v1/models lists and a request loads on demand (repeatable; default: axon's model "
        "cache and the HF cache)",
    )
    group.add_argument(
        "--no-load-on-demand",
        action="store_true",
        default=None,
        help="a request naming a model that is not loaded is a 404, never a load",
    )
    group.add_argument(
        "--max-loaded-models", type=int, metavar="N", help="unload idle models beyond N"
    )
    group.add_argument(
        "--idle-unload-s", type=float, metavar="S", help="unload a model unused for S seconds"
    )
    group.add_argument(
        "--on-demand-wait-s",
        type=float,
        metavar="S",
        help="how long a request waits for its model's load (then 503; default 120)",
    )


def config_from_namespace(ns: argparse.Namespace, environ=None) -> ServerConfig:
    """The config file and environment, with the flags that were given laid on top.

    Raises ValueError (with the value named) for bad flags or config.
    """
    config = load_config(ns.config, environ)
    flags = {name: getattr(ns, name, None) for name in _ENGINE_FLAGS}
    engine = EngineArgs.model_validate(
        {**config.engine.model_dump(exclude_none=True), **_set(flags)}
    )
    models = config.default_models
    chat_template = getattr(ns, "chat_template", None)
    if chat_template is not None and not ns.model:
        raise ValueError("--chat-template applies to MODEL: name the model to load with it")
    aliases = dict(config.model_aliases)
    if ns.model:
        given = {setting.field: getattr(ns, setting.name) for setting in _MODEL_SETTINGS}
        names = given.pop(_SERVED_NAME.field) or [None]
        first = ModelSpec(model_id=ns.model, served_model_name=names[0], **given)
        models = (first, *(spec for spec in models if spec.served_id != first.served_id))
        aliases.update({alias: first.served_id for alias in names[1:]})
    return config.with_overrides(
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        admin_api_key=getattr(ns, "admin_api_key", None),
        shutdown_grace_s=ns.shutdown_grace,
        log_level=ns.log_level,
        allowed_local_model_paths=_tuple_or_none(getattr(ns, "allowed_local_model_path", None)),
        allowed_media_domains=_tuple_or_none(getattr(ns, "allowed_media_domains", None)),
        allowed_local_media_path=getattr(ns, "allowed_local_media_path", None),
        chat_template_dir=getattr(ns, "chat_template_dir", None),
        models_dirs=_tuple_or_none(getattr(ns, "models_dir", None)),
        load_on_demand=False if getattr(ns, "no_load_on_demand", None) else None,
        max_loaded_models=getattr(ns, "max_loaded_models", None),
        idle_unload_s=getattr(ns, "idle_unload_s", None),
        on_demand_wait_s=getattr(ns, "on_demand_wait_s", None),
        engine=engine,
        default_models=models,
        model_aliases=aliases,
    )


def with_demo_default(config: ServerConfig, ns: argparse.Namespace) -> ServerConfig:
    """`config`, serving the embedded demo models (axon/demo.py: the chat model
    smollm2-135m-instruct first, then the base model gemma-3-270m) when neither MODEL nor
    default_models names one and --no-demo is not given."""
    if ns.model or config.default_models or getattr(ns, "no_demo", False):
        return config
    specs = []
    for model_id, path in demo_models():
        print(f"axon: no model given: serving {model_id} ({path})", file=sys.stderr, flush=True)
        specs.append(
            ModelSpec(
                model_id=str(path), served_model_name=model_id, **_demo_args(config, model_id)
            )
        )
    return config.with_overrides(default_models=tuple(specs))


def _demo_args(config: ServerConfig, model_id: str) -> dict:
    """The chat demo's exact float32 activations unless the operator chose a precision: at
    135M parameters its greedy answers sit on near-ties (to "What is the capital of France?" the
    top two first tokens are 0.09 apart), which int8 activations, within their usual error,
    flip into a wrong answer; the first thing a new user asks must not be that."""
    if model_id == CHAT_DEMO_MODEL_ID and config.engine.activation_precision is None:
        return {"activation_precision": "float32"}
    return {}


def _tuple_or_none(values: list | None) -> tuple | None:
    return tuple(values) if values else None


def _set(values: dict) -> dict:
    return {key: value for key, value in values.items() if value is not None}
