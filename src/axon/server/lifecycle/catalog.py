"""The models an operator's models dirs hold, found without loading them (models on demand).

A models dir (`--models-dir`, `models_dirs`; default axon's model cache and the HF cache) is
read two levels deep:

- a `.gguf` file at its top or in a folder of it is a model whose id is the file's stem
  (`SmolLM2-135M-Instruct.Q4_1`); of a split file (`-00001-of-00003.gguf`) the first part, under
  the stem without the part numbers;
- a folder holding `config.json` and `.safetensors` weights is a model whose id is the folder's
  name;
- a repo of the HF cache layout (`models--org--name/snapshots/<rev>/`, the snapshot `refs/main`
  names, else the newest) is `org/name` when its snapshot holds `config.json` and safetensors;
  its `.gguf` files are models under their stems.

Path safety: every file and folder is resolved, symlinks followed, and taken only when it lies
inside the models dir (so an HF cache's snapshot links to its blobs pass, a link out of the
dir does not); a model is listed only when every file its load may open does too (a GGUF's
folder's entries, as for `POST /models/load`: a link out of a folder hides its GGUF files).
Hidden entries (a download's or an assembly's temporary file) are skipped, and
a dir's listing stops after MAX_LISTED_ENTRIES. When two dirs hold the same id the first dir
listed wins.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from axon.cache_dir import cache_dir as axon_cache_dir
from axon.server.errors import AxonHTTPError
from axon.server.lifecycle.local_paths import MAX_LISTED_ENTRIES, check_model_files
from axon.server.lifecycle.sources import hf_cache_dir

logger = logging.getLogger(__name__)

HF_REPO_PREFIX = "models--"
_SPLIT_RE = re.compile(r"-(\d{5})-of-\d{5}$")


@dataclass(frozen=True)
class Found:
    """A servable model in a models dir: its id, resolved path (a checkpoint folder or a
    .gguf file), the dir it was found in (resolved), its format and weight bytes."""

    id: str
    path: Path
    root: Path
    format: str  # "gguf" | "safetensors"
    size_bytes: int
    modified: int  # the weights' mtime, seconds


def default_models_dirs(environ: Mapping[str, str]) -> tuple[str, ...]:
    """axon's model cache and the HF hub cache (HF_HUB_CACHE, else $HF_HOME/hub)."""
    return (str(axon_cache_dir() / "models"), hf_cache_dir(environ))


def scan(dirs: tuple[str, ...]) -> dict[str, Found]:
    """Every servable model in `dirs`, by id; the first dir wins a shared id. Blocking."""
    found: dict[str, Found] = {}
    for directory in dirs:
        root = Path(os.path.realpath(os.path.expanduser(directory)))
        if not root.is_dir():
            continue
        for model in _scan_root(root):
            if model.id in found:
                logger.debug("models dirs: %s found again in %s; the first is kept", model.id, root)
                continue
            found[model.id] = model
    return found


def _scan_root(root: Path) -> Iterator[Found]:
    for entry in _entries(root):
        path = _inside(root, entry)
        if path is None:
            continue
        if entry.name.startswith(HF_REPO_PREFIX) and path.is_dir():
            yield from _hf_repo(root, path, entry.name[len(HF_REPO_PREFIX) :])
        elif path.is_file():
            yield from _gguf(root, [(entry.name, path)])
        elif path.is_dir():
            yield from _folder(root, path, entry.name)


def _entries(folder: Path) -> list[os.DirEntry]:
    """The folder's visible entries, at most MAX_LISTED_ENTRIES; none when unreadable."""
    listed = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if len(listed) >= MAX_LISTED_ENTRIES:
                    logger.warning("models dir %s: more than %d entries", folder, len(listed))
                    break
                if not entry.name.startswith("."):
                    listed.append(entry)
    except OSError:
        return []
    return listed


def _inside(root: Path, entry: os.DirEntry | Path) -> Path | None:
    """The entry's real path when it exists inside `root`, else None."""
    real = Path(os.path.realpath(entry.path if isinstance(entry, os.DirEntry) else entry))
    if not real.is_relative_to(root) or not real.exists():
        return None
    return real


def _folder(root: Path, folder: Path, name: str) -> Iterator[Found]:
    files = [(entry.name, _inside(root, entry)) for entry in _entries(folder)]
    files = [(file_name, path) for file_name, path in files if path is not None and path.is_file()]
    dense = _dense(root, folder, name, files)
    if dense is not None:
        yield dense
    yield from _gguf(root, files)


def _dense(root: Path, folder: Path, model_id: str, files: list[tuple[str, Path]]) -> Found | None:
    """A safetensors checkpoint: `config.json` and at least one `.safetensors` file."""
    names = {file_name for file_name, _ in files}
    weights = [path for file_name, path in files if file_name.endswith(".safetensors")]
    if "config.json" not in names or not weights or not _servable(root, folder, model_id):
        return None
    stats = [path.stat() for path in weights]
    size = sum(stat.st_size for stat in stats)
    modified = int(max(stat.st_mtime for stat in stats))
    return Found(model_id, folder, root, "safetensors", size, modified)


def _gguf(root: Path, files: list[tuple[str, Path]]) -> Iterator[Found]:
    for file_name, path in files:
        if not file_name.lower().endswith(".gguf"):
            continue
        stem = file_name[: -len(".gguf")]
        split = _SPLIT_RE.search(stem)
        if split is not None and split.group(1) != "00001":
            continue  # a later part of a split file: its first part stands for it
        model_id = _SPLIT_RE.sub("", stem)
        if not _servable(root, path, model_id):
            continue
        stat = path.stat()
        yield Found(model_id, path, root, "gguf", stat.st_size, int(stat.st_mtime))


def _servable(root: Path, path: Path, model_id: str) -> bool:
    """Whether every file a load of `path` may open (local_paths.check_model_files: the
    folder's entries, a GGUF's folder's one level) resolves inside `root`: a model that could
    not load is not listed."""
    try:
        check_model_files(path, (root,), model_id)
    except AxonHTTPError as exc:
        logger.info("models dir %s: %s is not listed: %s", root, model_id, exc.message)
        return False
    return True


def _hf_repo(root: Path, repo: Path, name: str) -> Iterator[Found]:
    """An HF cache repo folder (`models--org--name`): its current snapshot's models."""
    org, sep, rest = name.partition("--")
    snapshot = _snapshot(root, repo)
    if not sep or not org or not rest or snapshot is None:
        return
    yield from _folder(root, snapshot, f"{org}/{rest}")


def _snapshot(root: Path, repo: Path) -> Path | None:
    """The snapshot `refs/main` names, else the most recently modified one."""
    snapshots = repo / "snapshots"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except (OSError, UnicodeDecodeError):
        revision = ""
    if revision and "/" not in revision and not revision.startswith("."):
        named = _inside(root, snapshots / revision)
        if named is not None and named.is_dir():
            return named
    candidates = [_inside(root, entry) for entry in _entries(snapshots)]
    folders = [path for path in candidates if path is not None and path.is_dir()]
    return max(folders, key=lambda path: path.stat().st_mtime, default=None)


class Catalog:
    """The models dirs' contents, scanned at most every `ttl_s` (a listing or a request for an
    unknown id rescans so a model copied in shows up without a restart)."""

    def __init__(self, dirs: tuple[str, ...], ttl_s: float = 2.0, clock=time.monotonic):
        self.dirs = dirs
        self.ttl_s = ttl_s
        self._clock = clock
        self._found: dict[str, Found] = {}
        self._scanned_at: float | None = None
        self._lock = threading.Lock()  # one scan at a time; the others take its result

    def models(self) -> dict[str, Found]:
        """The models found, by id, rescanned when the last scan is older than ttl_s.
        Blocking: call it in a thread."""
        if not self.dirs:
            return {}
        with self._lock:
            now = self._clock()
            if self._scanned_at is None or now - self._scanned_at >= self.ttl_s:
                self._found = scan(self.dirs)
                self._scanned_at = now
            return self._found
