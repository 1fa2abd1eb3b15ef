"""Where a model's files come from: a local path, or a repo on an HF-compatible registry.

A model id is a local path, or `[scheme:]org/name[@revision]`. A bare `org/name` takes the
config's `default_source` (huggingface). Each scheme names a registry (`[sources.<scheme>]`) with
its own endpoint, token variable and cache dir, so a mirror and the canonical hub never collide
on disk. Before anything is downloaded, one file listing (preflight) checks that the repo can
serve the spec, with neuron's typed 422 errors. Downloads use `snapshot_download` into the
standard HF cache layout, with huggingface_hub's progress bars on stderr.
Local paths are confined to the allowed roots unless the spec is trusted (see local_paths).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from axon.cache_dir import cache_dir as axon_cache_dir
from axon.server.config import HUGGINGFACE, ServerConfig, SourceConfig
from axon.server.errors import BadRequest, Unprocessable
from axon.server.lifecycle.local_paths import (
    PATH_PREFIXES,
    check_model_files,
    list_checkpoint_files,
    local_model_path,
    shown,
)
from axon.server.schemas.node_protocol import ModelSpec

logger = logging.getLogger(__name__)

HF_DEFAULT_ENDPOINT = "https://huggingface.co"
# Everything a dense checkpoint needs besides its weights: config, tokenizer, chat template.
_META_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
_SHARD_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.I)
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class ModelRef:
    """A parsed repo id: `scheme:org/name@revision`."""

    scheme: str
    repo_id: str
    revision: str | None = None


@dataclass(frozen=True)
class Source:
    """A registry with everything resolved: endpoint, token (False: send none), cache dir."""

    scheme: str
    endpoint: str
    token: str | bool | None
    cache_dir: str


@dataclass(frozen=True)
class FilePlan:
    """What to fetch from a repo (glob patterns), and the GGUF file to load when `quant` is set."""

    allow_patterns: list[str]
    gguf_file: str | None = None


def parse_model_ref(
    model_id: str, default_scheme: str = HUGGINGFACE, revision: str | None = None
) -> ModelRef:
    """Parses `[scheme:]org/name[@revision]`; raises BadRequest naming what is wrong."""
    scheme, sep, rest = model_id.partition(":")
    if not sep:
        scheme, rest = default_scheme, model_id
    rest, at, ref_revision = rest.partition("@")
    org, slash, name = rest.partition("/")

    def bad(why: str) -> BadRequest:
        return BadRequest(f"model id {model_id!r}: {why}", param="model_id")

    if not scheme or "/" in scheme:
        raise bad("the scheme before ':' must be a non-empty name without '/'")
    if not slash or "/" in name or not org or not name:
        raise bad("expected a local path or org/name (exactly one '/')")
    if ":" in name or at and not ref_revision:
        raise bad("':' may not appear in the name, and '@' must be followed by a revision")
    if ref_revision and revision and ref_revision != revision:
        raise bad(f"revision @{ref_revision} conflicts with revision {revision!r}")
    return ModelRef(scheme, f"{org}/{name}", ref_revision or revision)


def allowed_local_roots(config: ServerConfig, environ: Mapping[str, str]) -> tuple[Path, ...]:
    """The directories a `POST /models/load` may name local files in (absolute, symlinks not yet
    resolved): the configured `allowed_local_model_paths`, else the HF cache and axon's model
    cache (where the demo model is assembled). The working directory is one only when the
    operator names it: a server started in a home directory must not serve files from it."""
    paths = config.allowed_local_model_paths
    if paths is None:
        paths = (hf_cache_dir(environ), str(axon_cache_dir() / "models"))
    return tuple(Path(os.path.abspath(os.path.expanduser(path))) for path in paths)


def model_file_roots(config: ServerConfig, environ: Mapping[str, str]) -> tuple[Path, ...]:
    """Where the files of a `POST /models/load`'s model may lead, symlinks followed: the allowed
    roots and the download cache of every source (an hf-hub snapshot links its files to blobs
    there)."""
    schemes = {HUGGINGFACE, *(s for s, c in config.sources.items() if c.endpoint)}
    caches = (resolve_source(scheme, config, environ).cache_dir for scheme in sorted(schemes))
    extra = tuple(Path(os.path.abspath(cache)) for cache in caches)
    return allowed_local_roots(config, environ) + extra


def is_repo_id(model_id: str) -> bool:
    """Whether `model_id` reads as `[scheme:]org/name[@revision]` rather than as a path."""
    if model_id.startswith(PATH_PREFIXES):
        return False
    try:
        parse_model_ref(model_id)
    except BadRequest:
        return False
    return True


def hf_cache_dir(environ: Mapping[str, str]) -> str:
    """huggingface_hub's cache: HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if environ.get("HF_HUB_CACHE"):
        return environ["HF_HUB_CACHE"]
    return os.path.join(_hf_home(environ), "hub")


def _hf_home(environ: Mapping[str, str]) -> str:
    default = os.path.join(environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.expanduser(environ.get("HF_HOME") or default)


def resolve_source(scheme: str, config: ServerConfig, environ: Mapping[str, str]) -> Source:
    """The registry behind `scheme`. `huggingface` is always there (HF_ENDPOINT, HF_TOKEN and the
    HF cache apply to it); any other scheme must be configured under `[sources.<scheme>]`."""
    configured = config.sources.get(scheme)
    if scheme != HUGGINGFACE and (configured is None or not configured.endpoint):
        known = sorted({HUGGINGFACE, *config.sources})
        raise BadRequest(
            f"unknown model source {scheme!r}: configure [sources.{scheme}] endpoint; "
            f"known sources: {known}",
            param="model_id",
        )
    configured = configured or SourceConfig()
    if scheme == HUGGINGFACE:
        endpoint = configured.endpoint or environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT
        cache_dir = configured.cache_dir or hf_cache_dir(environ)
        # None lets huggingface_hub fall back to the token that `hf auth login` stored.
        token = environ.get(configured.auth_env or "HF_TOKEN") or None
    else:
        endpoint = configured.endpoint
        cache_dir = configured.cache_dir or os.path.join(_hf_home(environ), f"hub-{scheme}")
        # Never let huggingface_hub send the hub's own token to another registry.
        token = (environ.get(configured.auth_env) if configured.auth_env else None) or False
    return Source(scheme, endpoint.rstrip("/"), token, os.path.expanduser(cache_dir))


def preflight_error(kind: str, model_id: str, message: str, **extra) -> Unprocessable:
    """neuron's typed preflight error: a 422 whose error object carries `kind` and `model_id`."""
    return Unprocessable(message, code=kind, extra={"kind": kind, "model_id": model_id, **extra})


def quant_label(filename: str) -> str:
    """The quantisation part of a GGUF name: `Qwen3-0.6B-Q4_K_M.gguf` -> `Q4_K_M`."""
    stem = _SHARD_RE.sub("", Path(filename).name)
    stem = re.sub(r"\.gguf$", "", stem, flags=re.I)
    return re.split(r"[-.]", stem)[-1]


def plan_files(
    model_id: str, files: list[str], quant: str | None, tensor_parallel: int = 1
) -> FilePlan:
    """Checks that a repo holding `files` can serve the spec, and says what to fetch.

    Raises the preflight 422s: `empty_repo` (no .safetensors or .gguf weights),
    `quant_not_found` (with the nearest quant). Tensor parallelism takes safetensors where the
    repo has them, else the GGUF file (whose split is checked once it is here: `check_tp_gguf`).
    """
    gguf = sorted(f for f in files if f.lower().endswith(".gguf"))
    dense = [f for f in files if f.endswith(".safetensors")]
    if not gguf and not dense:
        raise preflight_error(
            "empty_repo", model_id, f"{model_id}: no .safetensors or .gguf weights in the repo"
        )
    if tensor_parallel > 1 and dense:
        return FilePlan(["*.safetensors", *_META_PATTERNS])  # quant is an in-situ dtype for TP
    if quant is None:
        if dense:
            return FilePlan(["*.safetensors", *_META_PATTERNS])
        if len({_SHARD_RE.sub("", f) for f in gguf}) == 1:  # one GGUF: no choice to make
            return _gguf_plan(gguf, gguf[0])
        raise _quant_error(model_id, "", gguf, "the repo has several GGUF files: set quant")
    matches = [f for f in gguf if quant.lower() in Path(f).name.lower()]
    if not matches:
        why = f"quant {quant!r} given, but the repo has no .gguf files"
        if gguf:
            nearest = nearest_quant(quant, gguf)
            hint = f"; did you mean {nearest!r}?" if nearest else ""
            why = f"no .gguf file matches quant {quant!r}{hint}"
        raise _quant_error(model_id, quant, gguf, why)
    return _gguf_plan(gguf, matches[0])


def _gguf_plan(gguf: list[str], chosen: str) -> FilePlan:
    """Fetches `chosen` (every shard of it) and the metadata, none of the other quants."""
    parts = [f for f in gguf if _SHARD_RE.sub("", f) == _SHARD_RE.sub("", chosen)]
    return FilePlan([*parts, *_META_PATTERNS], gguf_file=chosen)


def nearest_quant(quant: str, gguf_files: list[str]) -> str | None:
    """The quant label among `gguf_files` closest to `quant` (difflib ratio, case-insensitive)."""
    by_lower = {quant_label(f).lower(): quant_label(f) for f in gguf_files}
    close = difflib.get_close_matches(quant.lower(), list(by_lower), n=1, cutoff=0.0)
    return by_lower[close[0]] if close else None


def _quant_error(model_id: str, quant: str, gguf: list[str], why: str) -> Unprocessable:
    return preflight_error(
        "quant_not_found",
        model_id,
        f"{model_id}: {why}",
        quant=quant or None,
        available=sorted({quant_label(f) for f in gguf}),
        suggestion=nearest_quant(quant, gguf) if quant and gguf else None,
    )


def list_repo_files(ref: ModelRef, source: Source, model_id: str) -> list[str]:
    """The repo's file names from one model-info call (nothing is downloaded).

    Raises the 422 `repo_fetch_failed` when the registry cannot be reached or has no such repo.
    """
    import httpx2
    from huggingface_hub import HfApi

    api = HfApi(endpoint=source.endpoint, token=source.token)
    try:
        info = api.model_info(ref.repo_id, revision=ref.revision)
    except (OSError, ValueError, httpx2.HTTPError) as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise preflight_error(
            "repo_fetch_failed",
            model_id,
            f"{model_id}: cannot list {ref.repo_id} on {source.endpoint}: {first_line}",
            endpoint=source.endpoint,
            status=status,
        ) from exc
    return [sibling.rfilename for sibling in info.siblings or []]


def download(ref: ModelRef, source: Source, plan: FilePlan, offline: bool = False) -> Path:
    """Fetches the planned files into the source's cache (hf-hub layout) and returns the
    snapshot directory. Files already cached are not fetched again."""
    from huggingface_hub import snapshot_download

    logger.info(
        "fetching %s%s from %s into %s",
        ref.repo_id,
        f"@{ref.revision}" if ref.revision else "",
        source.endpoint,
        source.cache_dir,
    )
    try:
        path = snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            cache_dir=source.cache_dir,
            endpoint=source.endpoint,
            token=source.token,
            allow_patterns=plan.allow_patterns,
            local_files_only=offline,
        )
    except (OSError, ValueError) as exc:
        raise BadRequest(f"downloading {ref.repo_id} failed: {exc}", param="model_id") from exc
    return Path(path)


def resolve_model(
    spec: ModelSpec,
    config: ServerConfig,
    environ: Mapping[str, str] | None = None,
    trusted: bool = False,
) -> Path:
    """The local path to load for `spec` (a checkpoint directory, or a .gguf file): a local path
    as it is, a repo after preflight and download. Blocking; run it in a thread. A local path is
    confined to the allowed roots unless `trusted` (the operator's own spec).

    Raises BadRequest (bad id, path not allowed, unknown source, failed download) or the
    preflight 422s.
    """
    environ = os.environ if environ is None else environ
    tensor_parallel = spec.tensor_parallel or 1
    path = _locate(spec, config, environ, trusted)
    if not trusted:  # before any of its files is read (a GGUF header below)
        check_model_files(path, model_file_roots(config, environ), spec.model_id)
    return check_tp_gguf(spec.model_id, path, tensor_parallel)


def _locate(
    spec: ModelSpec, config: ServerConfig, environ: Mapping[str, str], trusted: bool
) -> Path:
    tensor_parallel = spec.tensor_parallel or 1
    roots = None if trusted else allowed_local_roots(config, environ)
    local = local_model_path(spec.model_id, roots)
    if local is not None:
        return _resolve_local(spec, local, tensor_parallel)
    ref = parse_model_ref(spec.model_id, config.default_source, spec.revision)
    source = resolve_source(ref.scheme, config, environ)
    offline = environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE
    if offline:  # no listing to check against: take what the cache holds
        snapshot = download(ref, source, FilePlan(["*"]), offline=True)
        files = list_checkpoint_files(snapshot, spec.model_id)
        plan = plan_files(spec.model_id, files, spec.quant, tensor_parallel)
    else:
        plan = plan_files(
            spec.model_id, list_repo_files(ref, source, spec.model_id), spec.quant, tensor_parallel
        )
        snapshot = download(ref, source, plan)
    return snapshot / plan.gguf_file if plan.gguf_file else snapshot


def check_tp_gguf(model_id: str, path: Path, tensor_parallel: int) -> Path:
    """`path`, when its ranks can split it: a GGUF file under tensor parallelism whose
    row-parallel tensors would cut quant blocks is the preflight 422 `tp_gguf_split`, which
    names the tensor and the sizes. Reads the file's header only."""
    if tensor_parallel == 1 or path.suffix.lower() != ".gguf" or not path.is_file():
        return path
    from axon.loader.gguf import tp_split_problem  # lazy: torch

    problem = tp_split_problem(str(path), tensor_parallel)
    if problem:
        raise preflight_error(
            "tp_gguf_split", model_id, f"{model_id}: {problem}", tensor_parallel=tensor_parallel
        )
    return path


def _resolve_local(spec: ModelSpec, path: Path, tensor_parallel: int) -> Path:
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        if path.suffix.lower() != ".gguf":
            raise BadRequest(f"model file {shown(spec.model_id)} is not a .gguf", param="model_id")
        return path
    if not stat.S_ISDIR(mode):
        raise BadRequest(f"{shown(spec.model_id)} is not a file or directory", param="model_id")
    files = list_checkpoint_files(path, spec.model_id)
    plan = plan_files(spec.model_id, files, spec.quant, tensor_parallel)
    return path / plan.gguf_file if plan.gguf_file else path
