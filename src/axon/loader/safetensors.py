"""Yield (hf_name, tensor) pairs from a HF model directory's safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files: those named by `model.safetensors.index.json`, else every
    `*.safetensors` in the directory. Raises FileNotFoundError when there are none."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iterate_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
