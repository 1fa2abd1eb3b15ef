"""Suite-wide pytest setup: import path, the `gpu` mark, and a session directory for checkpoints."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("axon") is None:
    # Lets `pytest` run from a plain checkout, without an editable install or PYTHONPATH.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def pytest_configure(config: pytest.Config) -> None:
    # The suite's models are tiny: two intra-op threads spinning on two (often shared) cores cost
    # far more than they save (the model tests run ~10x faster on one). OMP_NUM_THREADS overrides.
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
