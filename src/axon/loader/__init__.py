"""Model sources: a HF directory (config.json + safetensors) or a single `.gguf` file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from axon.loader.light_config import read_config_json


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


def load_hf_config(path: str):
    """The config of a model directory or GGUF file: transformers' attributes and values
    (loader/light_config.py)."""
    if is_gguf(path):
        from axon.loader.gguf import open_gguf  # lazy: torch
        from axon.loader.gguf_config import gguf_to_hf_config  # lazy: torch

        return gguf_to_hf_config(open_gguf(str(path)))
    return read_config_json(path)


def iterate_weights(path: str, with_mtp: bool = False) -> Iterator[tuple[str, object]]:
    """(hf_name, tensor) pairs of a model directory or GGUF file (QuantizedTensors for GGUF);
    a GGUF file's MTP (`nextn`) blocks as `mtp.*` only `with_mtp` (a directory's `mtp.*` are
    always there: the model skips them unless it drafts with them)."""
    if is_gguf(path):
        from axon.loader.gguf import iterate_gguf_file  # lazy: torch

        return iterate_gguf_file(path, with_mtp=with_mtp)
    from axon.loader.safetensors import iterate_safetensors  # lazy: torch

    return iterate_safetensors(path)
