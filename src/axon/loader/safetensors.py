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


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class CheckpointSlice:
    """A tensor still in the mmapped file: `narrow` and `to(dtype)` only record what to read,
    `materialize()` reads just those bytes. A tensor-parallel rank narrows each weight to its
    shard first, so it never holds a whole tensor it does not own. Valid while the file is
    open, i.e. until the iterator that yielded it moves on."""

    def __init__(self, source, ranges: list[tuple[int, int]], dtype: torch.dtype):
        self._source = source  # safetensors' PySafeSlice
        self._ranges = ranges  # [(start, stop)] per dimension
        self.dtype = dtype

    @classmethod
    def of(cls, source) -> CheckpointSlice:
        ranges = [(0, size) for size in source.get_shape()]
        return cls(source, ranges, _DTYPES.get(source.get_dtype(), torch.float32))

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self._ranges)

    def dim(self) -> int:
        return len(self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        dim = dim % self.dim()
        first, stop = self._ranges[dim]
        if start < 0 or length < 0 or first + start + length > stop:
            raise ValueError(f"narrow({dim}, {start}, {length}) outside shape {tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[dim] = (first + start, first + start + length)
        return CheckpointSlice(self._source, ranges, self.dtype)

    def to(self, dtype: torch.dtype) -> CheckpointSlice:
        return CheckpointSlice(self._source, self._ranges, dtype)

    def materialize(self) -> torch.Tensor:
        """The recorded slice as a tensor of the recorded dtype (only its bytes are read)."""
        if not self._ranges:  # a scalar
            return self._source[...].to(self.dtype)
        tensor = self._source[tuple(slice(start, stop) for start, stop in self._ranges)]
        return tensor.to(self.dtype)


def iterate_safetensors(
    model_dir: str | Path, sliced: bool = False
) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """(name, tensor) of every checkpoint tensor; with `sliced`, CheckpointSlices that read
    only the part a weight loader narrows them to (tensor-parallel ranks)."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, CheckpointSlice.of(f.get_slice(name)) if sliced else f.get_tensor(name)
