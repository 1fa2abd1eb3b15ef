"""axon's on-disk cache, where start-up work is kept between runs: the demo model, the compiled C
kernels and what is derived from a model file (a GGUF's tokenizer).

An entry derived from a file is keyed by that file (`file_key`: size, mtime and a hash of its
head, where a GGUF keeps its metadata) and by whatever else shapes it (library versions), so an
edited or replaced file misses. Each entry is a directory with a manifest of its files' sha256,
checked on every use: a partial or corrupt entry is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1  # bump when what an entry holds changes shape
# A GGUF's metadata (vocabulary, merges, chat template) comes before its tensors: 32 MiB covers
# the largest vocabularies (~10 MiB) at ~50 ms of hashing.
HEAD_BYTES = 32 << 20


def cache_dir() -> Path:
    """axon's cache: $AXON_CACHE_DIR, else $XDG_CACHE_HOME/axon, else ~/.cache/axon."""
    if os.environ.get("AXON_CACHE_DIR"):
        return Path(os.environ["AXON_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "axon"


def file_key(path: str | Path, *extra: str) -> str:
    """A key for what is derived from the file at `path`: its size, mtime, the sha256 of its
    first HEAD_BYTES, and `extra` (e.g. library versions)."""
    path = Path(path)
    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(HEAD_BYTES))
    digest.update(json.dumps([FORMAT, stat.st_size, stat.st_mtime_ns, *extra]).encode())
    return digest.hexdigest()[:32]


def cached_entry(kind: str, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """(directory, hit): the entry `cache_dir()/kind/key`, reused when its manifest matches its
    files, else built by `build(directory)` (which writes the files) and put in place whole.
    Raises what `build` raises."""
    entry = cache_dir() / kind / key
    if verified(entry):
        return entry, True
    logger.info("start-up cache miss: building %s/%s", kind, key)
    return _rebuild(entry, build), False


def verified(entry: Path) -> bool:
    """Whether `entry` holds a manifest and exactly the files it lists, with their sha256."""
    try:
        files = json.loads((entry / MANIFEST).read_text())["files"]
        if not isinstance(files, dict) or not files:
            return False
        return all(_sha256(entry / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def discard(entry: Path) -> None:
    """Removes an entry that was verified but failed to load (the next use rebuilds it)."""
    logger.warning("start-up cache entry %s could not be used: rebuilding it", entry)
    shutil.rmtree(entry, ignore_errors=True)


def _rebuild(entry: Path, build: Callable[[Path], None]) -> Path:
    entry.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}."))
    try:
        build(scratch)
        files = {item.name: _sha256(item) for item in sorted(scratch.iterdir()) if item.is_file()}
        (scratch / MANIFEST).write_text(json.dumps({"files": files}))
        if not verified(entry):  # a corrupt or partial one; a concurrent builder's is kept
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.replace(scratch, entry)  # whole or not at all
        except OSError:
            if not verified(entry):  # a concurrent builder's entry is as good as ours
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return entry


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
