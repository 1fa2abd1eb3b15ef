"""runner/kv_blocks.py's byte matrix over cache tensors: rows gathered and scattered whole, for
any element type and row shape (a quantised cache's scales too), by numpy on the CPU and by torch
elsewhere (the same bytes)."""

from __future__ import annotations

import pytest
import torch

from axon.runner.kv_blocks import ByteRows


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(6, 4, 2, 8, generator=generator).to(torch.bfloat16),  # a K cache's blocks
        torch.randn(6, 4, 2, 8, generator=generator),  # float32 V
        torch.randint(0, 255, (6, 3), generator=generator, dtype=torch.uint8),  # q8 bytes
        torch.randn(6, 2, generator=generator).to(torch.float16),  # per-block scales
    ]


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_rows_round_trip_through_bytes(path):
    source, target = _tensors(), [torch.zeros_like(t) for t in _tensors()]
    reader, writer = ByteRows(source), ByteRows(target)
    if path == "torch":
        reader.arrays = writer.arrays = None  # the device path, on CPU tensors
    data = reader.gather([4, 1])
    assert data.dtype == torch.uint8
    assert data.shape == (2, 4 * 2 * 8 * 2 + 4 * 2 * 8 * 4 + 3 + 2 * 2)

    writer.scatter([0, 5], data)

    for src, dst in zip(source, target):
        assert torch.equal(dst[0], src[4]) and torch.equal(dst[5], src[1])
        assert not dst[1:5].any()  # nothing else written


def test_both_paths_give_the_same_bytes():
    rows = ByteRows(_tensors())
    by_numpy = rows.gather([2, 3, 0])
    rows.arrays = None
    assert torch.equal(rows.gather([2, 3, 0]), by_numpy)
