"""Compiles axon's C kernels once per machine and loads them with ctypes.

Each C file is built with the system C compiler (`$CC`, else `cc`, else `gcc`) into the cache
(`$AXON_CACHE_DIR/kernels`, else `$XDG_CACHE_HOME/axon/kernels`, else `~/.cache/axon/kernels`),
under a name that hashes the source, the flags and the CPU's feature flags, so an edit or a new
machine rebuilds and everything else reuses the file. `load` returns None when there is no
compiler or the build fails; callers then take their pure-PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")


def cache_dir() -> Path:
    """axon's cache: $AXON_CACHE_DIR, else $XDG_CACHE_HOME/axon, else ~/.cache/axon."""
    if os.environ.get("AXON_CACHE_DIR"):
        return Path(os.environ["AXON_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "axon"


def _cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def _build(compiler: str, source: Path) -> Path:
    """Compile `source` (once: the name hashes source, flags and CPU) and return the .so."""
    key = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode() + _cpu_flags().encode())
    target = cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(source), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(tmp, target)  # atomic: concurrent builders each rename a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: Path) -> ctypes.CDLL | None:
    """The compiled library of `source`, or None (logged) without a compiler or on failure."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler: %s is not built, the PyTorch path runs instead", source.name)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, source)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("building %s failed (%s); the PyTorch path runs instead", source, detail)
        return None
