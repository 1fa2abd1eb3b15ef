"""Compiles axon's C kernels once per machine and loads them with ctypes.

The C files are built together into one library with the system C compiler (`$CC`, else `cc`,
else `gcc`) into the cache (`$AXON_CACHE_DIR/kernels`, else `$XDG_CACHE_HOME/axon/kernels`, else
`~/.cache/axon/kernels`), under a name that hashes the sources, the flags and the CPU's feature
flags, so an edit or a new machine rebuilds and everything else reuses the file. `load` returns
None when there is no compiler or the build fails; callers then take their pure-PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from axon.cache_dir import cache_dir

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them ("" where there is none): the ISA a
    -march=native build targets."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("ggml_cpu.c", "ggml_q8.c", "cpu_ops.c", "cpu_layer.c", "cpu_moe.c", "layout.c")
)
# included by the sources: in the key. axon_kernels.h is the interface (kernels/abi.py its
# Python side); the others are helpers of the matmul files.
HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in ("axon_kernels.h", "work_shares.h", "k_scales.h", "k23_blocks.h")
)


def _build(compiler: str, sources: tuple[Path, ...]) -> Path:
    """Compile `sources` into one library (once: the name hashes sources, flags and CPU)."""
    key = hashlib.sha256(b"".join(path.read_bytes() for path in (*sources, *HEADERS)))
    key.update(" ".join(FLAGS).encode() + cpu_flags().encode())
    target = cache_dir() / "kernels" / f"axon_cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    # Said out loud: a miss costs seconds to minutes, and scripts/setup.sh should have built it.
    logger.warning("C kernels: cache miss, compiling %s (once per machine and source)", target)
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, *map(str, sources), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(tmp, target)  # atomic: concurrent builders each rename a whole file
        logger.warning("compiled the C kernels in %.1f s", time.monotonic() - started)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """axon's C kernels (every file of SOURCES in one library), or None (logged) without a
    compiler or when the build fails."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler: the C kernels are not built, the PyTorch paths run instead")
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, SOURCES)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("building the C kernels failed (%s); the PyTorch paths run instead", detail)
        return None
