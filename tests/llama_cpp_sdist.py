"""llama.cpp's source as the `llama-cpp-python` sdist vendors it: fetched once from the package
index with pip and cached under ~/.cache/axon-test, then only the members a test needs are
extracted next to it. The tokenizer tests read its `models/` (vocab test vectors, chat templates);
the GGUF tests run its `convert_hf_to_gguf.py`. A run of several workers starts the download at
once, in the background (`start_prefetch`), so that the network wait overlaps other tests."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

CACHE = Path.home() / ".cache" / "axon-test"
SDIST_CACHE = CACHE / "llama-cpp-python"
# Copies other scripts of this project may already have fetched (the benchmarks' llama.cpp).
SDIST_ELSEWHERE = (Path("/tmp/lcp"), Path.home() / ".cache" / "axon-bench")
LLAMA_CPP_IN_SDIST = "vendor/llama.cpp/"


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Held while one test process fills a shared entry of CACHE: the suite runs in several
    pytest-xdist workers, and two of them may reach the same cold entry at once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _find_sdist(directory: Path) -> Path | None:
    archives = sorted(directory.glob("llama_cpp_python-*.tar.gz"))
    return archives[-1] if archives else None


def _cached_sdist() -> Path | None:
    for directory in (SDIST_CACHE, *SDIST_ELSEWHERE):
        if directory.is_dir() and (found := _find_sdist(directory)) is not None:
            return found
    return None


def download_sdist() -> Path:
    """The sdist in SDIST_CACHE: reused if present, else copied from where another script put
    it, else downloaded with pip. Skips the calling test when none can be had."""
    if (found := _cached_sdist()) is not None:
        return found
    SDIST_CACHE.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    command += ["llama-cpp-python", "-d", str(SDIST_CACHE)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = _find_sdist(SDIST_CACHE)
    if found is None:
        pytest.skip(f"cannot download the llama-cpp-python sdist: {result.stderr[-300:]}")
    return found


def extract_llama_cpp(subdir: str, wanted: Callable[[str], bool], suffix: str = "") -> Path:
    """The directory holding the members of the sdist's `vendor/llama.cpp/<subdir>` whose path
    below it `wanted` accepts (extracted once, into SDIST_CACHE/<sdist name><suffix>)."""
    with cache_lock("sdist"):
        return _extract(download_sdist(), subdir, wanted, suffix)


def _extract(sdist: Path, subdir: str, wanted: Callable[[str], bool], suffix: str) -> Path:
    prefix = LLAMA_CPP_IN_SDIST + subdir
    target = SDIST_CACHE / (sdist.name.removesuffix(".tar.gz") + suffix)
    done = target / ".extracted"
    if not done.exists():
        with tarfile.open(sdist) as archive:
            members = []
            for member in archive.getmembers():
                rest = member.name.split(prefix, 1)[1] if prefix in member.name else None
                if member.isfile() and rest is not None and wanted(rest):
                    member.name = rest
                    members.append(member)
            archive.extractall(target, members=members, filter="data")
        done.touch()
    return target


def start_prefetch() -> subprocess.Popen | None:
    """A background process fetching the sdist under the cache lock, or None when it is cached.
    A test needing it meanwhile waits on the lock; a failed fetch is retried (and reported) by
    that test."""
    if _cached_sdist() is not None:
        return None
    script = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    script += "import llama_cpp_sdist as s\nwith s.cache_lock('sdist'): s.download_sdist()"
    quiet = subprocess.DEVNULL
    command = [sys.executable, "-c", script]
    return subprocess.Popen(command, stdout=quiet, stderr=quiet, start_new_session=True)


def stop_prefetch(process: subprocess.Popen) -> None:
    """Ends a prefetch still running (no test needed it) with its pip: the next run fetches."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
