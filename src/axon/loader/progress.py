"""Load progress: the bytes of checkpoint tensors read so far.

A bar on the engine's stderr when it is a terminal (tqdm), and a reporter that whoever starts
the load may install: the engine process forwards it to the HTTP process, which shows it in
`/health.activation` and `GET /models`. Bytes are the tensors' stored sizes (GGML blocks for
GGUF), counted against the checkpoint files' sizes; the last report is always total/total.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

Reporter = Callable[[int, int], None]  # (loaded bytes, total bytes)

_reporter: Reporter | None = None
REPORT_INTERVAL_S = 0.25


def set_reporter(reporter: Reporter | None) -> None:
    """Install the process's load-progress listener (None: remove it)."""
    global _reporter
    _reporter = reporter


def checkpoint_bytes(path: str | Path) -> int:
    """The size of a checkpoint: a GGUF file, or a directory's safetensors files."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(file.stat().st_size for file in path.glob("*.safetensors"))


def tensor_bytes(tensor) -> int:
    """Stored bytes of a checkpoint tensor: a torch tensor, a GGML QuantizedTensor (its raw
    blocks) or a lazy safetensors slice (the whole tensor it stands for)."""
    data = getattr(tensor, "data", None)
    if hasattr(tensor, "ggml_type") and data is not None:
        return data.nbytes
    nbytes = getattr(tensor, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    return math.prod(tensor.shape) * tensor.dtype.itemsize


def track(
    weights: Iterable[tuple[str, object]], path: str | Path, show_bar: bool = True
) -> Iterator[tuple[str, object]]:
    """`weights`, counting each tensor once the loader has taken it."""
    total = max(checkpoint_bytes(path), 1)
    reporter = _reporter
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="loading weights",
        disable=None if show_bar else True,  # None: only on a terminal
        leave=False,
    )
    loaded, last_report = 0, 0.0
    try:
        for name, tensor in weights:
            yield name, tensor
            size = min(tensor_bytes(tensor), total - loaded)
            loaded += size
            bar.update(size)
            now = time.monotonic()
            if reporter is not None and now - last_report >= REPORT_INTERVAL_S:
                reporter(loaded, total)
                last_report = now
    finally:
        bar.close()
    if reporter is not None:
        reporter(total, total)
