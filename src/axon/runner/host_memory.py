"""Zeroed host tensors whose pages are zeroed by the kernel when first touched.

`torch.zeros` on the CPU writes every byte up front: for a 4 GiB KV cache that is seconds of a
cold start and 4 GiB resident before a single token is cached. An anonymous mapping reads as
zeros and costs nothing until a page is written, so the cache grows in memory as it fills.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape`; on the CPU backed by an anonymous mapping (page-aligned, zero
    pages on demand), elsewhere `torch.zeros`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `buffer` alive for as long as the tensor (or a view of it) lives.
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
