"""Fixtures of the engine tests that several modules share."""

from __future__ import annotations

import pytest

from tests.model.qwen3_5_tiny import get_any_tiny
from tests.model.tiny_models import get_tiny_model


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text", "qwen3_5_text"])
def any_tiny(request, tiny_model_root):
    """Each kind of attention cache: dense; sliding-window layers beside full ones; hybrid
    Gated DeltaNet."""
    return get_any_tiny(request.param, tiny_model_root)


@pytest.fixture(scope="module")
def qwen3(tiny_model_root):
    return get_tiny_model("qwen3", tiny_model_root)
