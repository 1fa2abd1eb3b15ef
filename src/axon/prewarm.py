"""`python -m axon.prewarm`: does ahead of time what the first `axon serve` would otherwise do
(meant for scripts/setup.sh): compiles the C kernels, assembles the demo model and builds its
tokenizer, all into axon's cache (axon/cache_dir.py). Later starts find them there. Exit status
0 also when the demo package is absent (nothing of it to prepare); it says so.
"""

from __future__ import annotations

import sys
import time

from axon.demo import demo_model_path
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
    try:
        path = demo_model_path()
    except FileNotFoundError as exc:
        print(f"axon prewarm: no demo model: {exc}")
        return 0
    started = time.monotonic()
    load_gguf_tokenizer(path)
    print(f"axon prewarm: demo model and its tokenizer ready ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
