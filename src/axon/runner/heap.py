"""Returning the host heap's free memory to the system after a load.

Loading a model and its tokenizer allocates and frees a lot of small objects (a 262k-entry vocab
is parsed into Python and Rust structures, then most of it dropped). glibc keeps those freed
chunks in its heap and arenas, so they stay resident: 180 MiB of the demo model's 280 MiB of
anonymous memory after `LLM(...)` was such garbage. `malloc_trim` hands it back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_freed_heap() -> bool:
    """Collects garbage, then returns the heap's free pages to the system (glibc's malloc_trim;
    elsewhere nothing). Returns whether anything could be returned. Changes no live object."""
    gc.collect()
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
