"""The host heap: its free memory returned to the system after a load, then kept while serving.

Loading a model and its tokenizer allocates and frees a lot of small objects (a 262k-entry vocab
is parsed into Python and Rust structures, then most of it dropped). glibc keeps those freed
chunks in its heap and arenas, so they stay resident: 180 MiB of the demo model's 280 MiB of
anonymous memory after `LLM(...)` was such garbage. `malloc_trim` hands it back.

Serving on the CPU is the opposite case: every prefill step allocates activations of megabytes
(16 prompts x 128 tokens: 25 MiB for one MLP's intermediate), which glibc maps fresh from the
kernel and unmaps on free (above its mmap threshold, 32 MiB at most), so each step paid page
faults and zeroing again. `keep_freed_heap` raises both thresholds once the model is loaded, so
those buffers come from the heap and go back to it, faulted in once. The heap then keeps
the largest step's activations resident (+100-120 MiB after that prefill, demo and Qwen3
Q4_K_M; `docs/performance.md`) until the serving engine has been idle for a heartbeat, when it
trims them (`engine_proc.EngineLoop`).
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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
KEEP_BYTES = 1 << 30


def keep_freed_heap() -> bool:
    """From now on, allocations up to KEEP_BYTES come from the heap and freed memory stays in it
    (glibc's mmap and trim thresholds; elsewhere nothing). Returns whether both were set."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    mapped = libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)
    trimmed = libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    return bool(mapped) and bool(trimmed)


def release_freed_heap() -> bool:
    """Collects garbage, then returns the heap's free pages to the system (glibc's malloc_trim;
    elsewhere nothing). Returns whether anything could be returned. Changes no live object."""
    gc.collect()
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
