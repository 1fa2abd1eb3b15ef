"""Fixtures of the tokenizer tests: llama.cpp's vocab test vectors and chat-template corpus (from
the `llama-cpp-python` sdist, fetched once from the package index and cached), and both real Qwen
tokenizers (built in the suite's conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llama_cpp_sdist import extract_llama_cpp

MODELS_IN_LLAMA_CPP = "models/"


def _wanted(rest: str) -> bool:
    """The members of `models/` to extract: vocab GGUFs, their .inp/.out vectors, the Jinja
    templates."""
    return rest.startswith("ggml-vocab-") or (
        rest.startswith("templates/") and rest.endswith(".jinja")
    )


@pytest.fixture(scope="session")
def llama_cpp_models() -> Path:
    """llama.cpp's `models/` directory (ggml-vocab-*.gguf[.inp|.out], templates/*.jinja)."""
    return extract_llama_cpp(MODELS_IN_LLAMA_CPP, _wanted)


@pytest.fixture(scope="session")
def template_dir(llama_cpp_models: Path) -> Path:
    return llama_cpp_models / "templates"


@pytest.fixture(scope="session", params=["qwen3", "qwen3_5"])
def qwen_tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")
