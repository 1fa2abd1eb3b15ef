"""Model sources: a HF directory (config.json + safetensors) or a single `.gguf` file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


def load_hf_config(path: str):
    """The transformers config of a model directory or GGUF file."""
    if is_gguf(path):
        from axon.loader.gguf import open_gguf  # lazy: torch
        from axon.loader.gguf_config import gguf_to_hf_config  # lazy: torch

        return gguf_to_hf_config(open_gguf(str(path)))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def iterate_weights(path: str) -> Iterator[tuple[str, object]]:
    """(hf_name, tensor) pairs of a model directory or GGUF file (QuantizedTensors for GGUF)."""
    if is_gguf(path):
        from axon.loader.gguf import iterate_gguf_file  # lazy: torch

        return iterate_gguf_file(path)
    from axon.loader.safetensors import iterate_safetensors  # lazy: torch

    return iterate_safetensors(path)
