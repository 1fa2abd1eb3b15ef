"""Local paths a model spec names, confined to the allowed roots unless the spec is trusted.

Local paths from the operator (MODEL on the command line, `default_models`) are trusted. Paths in
a `POST /models/load` are not: once symlinks and `..` are resolved they must lie under the
`allowed_local_model_paths`, and one outside them gets the same error as one that does not exist,
so that the port reveals nothing about the rest of the filesystem. A directory is searched two
levels deep at most, and only so many entries, so no request can walk a whole tree.

The folder itself is not enough: a symlink inside it (`chat_template.jinja -> /etc/passwd`, a
config, a weights file, a shard that an index names) would make axon open a file outside the
roots, so every entry of it that axon may open is resolved and checked too (check_model_files).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from axon.server.errors import BadRequest

PATH_PREFIXES = ("/", "./", "../", "~")
MAX_PATH_CHARS = 4096  # PATH_MAX: an id longer than this names no file
# A checkpoint is a directory of at most a few hundred files; a directory search stops here.
MAX_LISTED_ENTRIES = 10_000


class PathNotAllowed(BadRequest):
    code = "model_path_not_allowed"


def local_model_path(
    model_id: str, roots: tuple[Path, ...] | None = None, param: str = "model_id"
) -> Path | None:
    """The local file or directory `model_id` names (resolved), or None when it is a repo id.

    `roots` None trusts the id (the operator's own): an id spelled like a path (`/…`, `./…`,
    `~…`) that does not exist is a BadRequest. Otherwise the path must lie under `roots`; one
    outside them, missing, or neither a file nor a directory is the same PathNotAllowed, and
    nothing outside `roots` is looked at.
    """
    if len(model_id) > MAX_PATH_CHARS or "\0" in model_id:
        why = "it holds a NUL character" if "\0" in model_id else "it is too long"
        raise BadRequest(f"{param} is not a path or model id: {why}", param=param)
    spelled_as_path = model_id.startswith(PATH_PREFIXES) or model_id in (".", "..")
    if roots is None:
        try:
            path = Path(model_id).expanduser()
            if path.exists():
                return path.resolve()
        except (OSError, RuntimeError):  # a name too long, an unknown ~user: not there
            pass
        if spelled_as_path:
            what = "model path" if param == "model_id" else param
            raise BadRequest(f"{what} {shown(model_id)} does not exist", param=param)
        return None
    return _allowed_path(model_id, spelled_as_path, roots, param)


def _allowed_path(
    model_id: str, spelled_as_path: bool, roots: tuple[Path, ...], param: str
) -> Path | None:
    # Lexically first (no filesystem access), so that a path outside the roots is never stat'ed;
    # then resolved, so that a symlink or `..` cannot lead out of them. A root may be spelled
    # through a symlink (/tmp -> /private/tmp): both spellings pass the lexical test.
    real_roots = [Path(os.path.realpath(root)) for root in roots]
    absolute = Path(os.path.abspath(os.path.expanduser(model_id)))
    if not any(absolute.is_relative_to(root) for root in (*roots, *real_roots)):
        if spelled_as_path:
            raise not_allowed(model_id, roots, param)
        return None  # `org/name`: a repo id
    real = Path(os.path.realpath(absolute))
    try:
        mode = os.stat(real).st_mode
    except (OSError, ValueError):
        mode = None
    inside = any(real.is_relative_to(root) for root in real_roots)
    if mode is not None and inside and (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return real
    if spelled_as_path or mode is not None:
        raise not_allowed(model_id, roots, param)
    return None


def not_allowed(model_id: str, roots: tuple[Path, ...], param: str) -> PathNotAllowed:
    return PathNotAllowed(
        f"{param} {shown(model_id)} is not a file or directory under the allowed local model "
        f"paths {[str(root) for root in roots]} (allowed_local_model_paths)",
        param=param,
    )


def shown(text: str) -> str:
    return repr(text if len(text) <= 200 else text[:200] + "...")


def list_checkpoint_files(directory: Path, model_id: str) -> list[str]:
    """The files in `directory` and its immediate subdirectories, relative to it (as a checkpoint
    lays them out). Symlinked directories are not followed. Raises BadRequest when it holds more
    than MAX_LISTED_ENTRIES entries (not a checkpoint) or cannot be listed."""
    files: list[str] = []
    pending, seen = [(directory, "")], 0
    while pending:
        folder, prefix = pending.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    seen += 1
                    if seen > MAX_LISTED_ENTRIES:
                        raise BadRequest(
                            f"{shown(model_id)} holds more than {MAX_LISTED_ENTRIES} entries: "
                            "name a checkpoint directory or a .gguf file",
                            param="model_id",
                        )
                    if entry.is_dir(follow_symlinks=False):
                        if not prefix:  # the checkpoint dir and one level below, no deeper
                            pending.append((Path(entry.path), entry.name + "/"))
                    elif entry.is_file():  # hf-hub snapshots link their files to blobs
                        files.append(prefix + entry.name)
        except OSError as exc:
            if folder == directory:
                why = exc.strerror or str(exc)
                raise BadRequest(
                    f"cannot list {shown(model_id)}: {why}", param="model_id"
                ) from None
    return files


INDEX_FILE = "model.safetensors.index.json"  # names the shards the loader opens
MAX_INDEX_BYTES = 64 << 20


def check_model_files(path: Path, roots: tuple[Path, ...], model_id: str) -> None:
    """Raises PathNotAllowed (param model_id) unless every entry of the model's folder that axon
    may open resolves, symlinks followed, inside `roots`: the folder's entries and those one
    level down (config, tokenizer files, templates, weights) and the shards its safetensors
    index names. `path` is a checkpoint directory, or a .gguf file (whose folder holds its
    tokenizer files). Raises BadRequest for a folder that cannot be listed or is too large."""
    folder = path if path.is_dir() else path.parent
    real_roots = [Path(os.path.realpath(root)) for root in roots]

    def check(name: str) -> None:
        real = Path(os.path.realpath(folder / name))
        if not any(real.is_relative_to(root) for root in real_roots):
            raise PathNotAllowed(
                f"model_id {shown(model_id)}: {shown(name)} in the model's folder leads outside "
                "the allowed local model paths (allowed_local_model_paths)",
                param="model_id",
            )

    check(path.name if path.is_file() else ".")
    # A GGUF file's folder may be a root holding other models: only its own level is read.
    _walk_folder(folder, model_id, check, descend=not path.is_file())
    for name in _indexed_shards(folder):
        check(name)


def _walk_folder(folder: Path, model_id: str, check, descend: bool) -> None:
    # A directory (a symlinked one too) is entered only once its own entry passed `check`, so
    # nothing outside the roots is ever listed.
    pending, seen = [(folder, "")], 0
    while pending:
        directory, prefix = pending.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    seen += 1
                    if seen > MAX_LISTED_ENTRIES:
                        raise BadRequest(
                            f"{shown(model_id)}'s folder holds more than {MAX_LISTED_ENTRIES} "
                            "entries: name a checkpoint directory or a .gguf file in its own",
                            param="model_id",
                        )
                    check(prefix + entry.name)
                    if descend and not prefix and entry.is_dir():
                        pending.append((Path(entry.path), entry.name + "/"))
        except OSError as exc:
            if directory == folder:
                why = exc.strerror or str(exc)
                raise BadRequest(
                    f"cannot list {shown(model_id)}: {why}", param="model_id"
                ) from None


def _indexed_shards(folder: Path) -> list[str]:
    """The file names the folder's safetensors index maps weights to; none when it has no
    readable index (the loader reports a broken one)."""
    try:
        fd = os.open(folder / INDEX_FILE, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            return []
        data = file.read(MAX_INDEX_BYTES + 1)
    try:
        weight_map = json.loads(data)["weight_map"]
        return sorted({str(name) for name in weight_map.values()})
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


def check_prefix_cache_dir(spec, config, trusted: bool = False) -> None:
    """An untrusted load (`POST /models/load`) may not choose where the engine writes and
    removes prefix cache files: it keeps the server's own `prefix_cache_dir` (none, or the
    operator's), else a 400 naming the field."""
    wanted = spec.engine_args().get("prefix_cache_dir")
    own = config.engine.engine_args().get("prefix_cache_dir")
    if trusted or wanted is None or wanted == own:
        return
    raise BadRequest(
        "prefix_cache_dir is the operator's to set (--prefix-cache-dir or [engine]), not a load's",
        param="prefix_cache_dir",
    )
