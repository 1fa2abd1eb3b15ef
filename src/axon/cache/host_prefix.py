"""The prefix cache's host-memory tier (`--prefix-cache-host-size`): full KV blocks (and a hybrid
model's state snapshots) kept as bytes in host RAM, the least recently used dropped past a cap,
in front of the disk tier (cache/disk_prefix.py) where there is one.

It pays where the KV cache is device memory: on a GPU, a block the cache evicted comes back by
one copy over the bus instead of a prefill or a file read. On the CPU the KV cache is host memory
already, so a larger cache (`--kv-cache-memory`) keeps as many blocks without copying them.

The interface is DiskPrefixStore's, so engine/prefix_tiers.py drives this store, the disk's, or
this one with the disk's behind it:

- a read looks in memory, then on disk; a block read from disk is kept in memory as well;
- a block put is kept in memory, and queued for the disk when the disk lacks it.

No torch: payloads are bytes-like and copied in (callers reuse their buffers).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from axon.cache.disk_prefix import DiskPrefixStore


class HostPrefixStore:
    def __init__(self, max_bytes: int, disk: DiskPrefixStore | None = None) -> None:
        self.max_bytes = max_bytes
        self.disk = disk
        self._entries: OrderedDict[tuple[str, bytes], np.ndarray] = OrderedDict()  # LRU first
        self.num_bytes = 0
        self.num_kept = 0
        self.num_evicted = 0

    def contains(self, kind: str, block_hash: bytes) -> bool:
        """Whether the block is in memory or (unchecked) on disk."""
        if (kind, block_hash) in self._entries:
            return True
        return self.disk is not None and self.disk.contains(kind, block_hash)

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers `read_into` names."""
        return ("host", *(self.disk.tiers if self.disk is not None else ()))

    def needs(self, kind: str, block_hash: bytes) -> bool:
        """Whether `put` would keep or queue the block: memory or the disk lacks it."""
        if (kind, block_hash) not in self._entries:
            return True
        return self.disk is not None and self.disk.needs(kind, block_hash)

    def read_into(self, kind: str, block_hash: bytes, buffer) -> str | None:
        """Fill `buffer` (writable, exactly the payload's length) with the block: the tier it
        came from ("host" or "disk"), or None when neither has it whole."""
        key = (kind, block_hash)
        view = memoryview(buffer).cast("B")
        entry = self._entries.get(key)
        if entry is not None and entry.nbytes == len(view):
            self._entries.move_to_end(key)
            view[:] = entry
            return "host"
        if self.disk is None or self.disk.read_into(kind, block_hash, buffer) is None:
            return None
        self._keep(key, view)
        return "disk"

    @property
    def accepting(self) -> bool:
        """Memory takes every block (dropping the least recently used)."""
        return True

    def put(self, kind: str, block_hash: bytes, payload) -> bool:
        """Keep the block in memory and queue it for the disk, where each lacks it."""
        key = (kind, block_hash)
        data = self._entries.get(key)
        if data is None:
            data = self._keep(key, memoryview(payload).cast("B"))
        else:
            self._entries.move_to_end(key)
        if self.disk is not None and self.disk.needs(kind, block_hash) and self.disk.may_write():
            self.disk.put(kind, block_hash, data if data is not None else payload)
        return True

    def _keep(self, key: tuple[str, bytes], view: memoryview) -> np.ndarray | None:
        """A copy of `view` kept as the most recently used entry; older ones go past the cap."""
        if len(view) > self.max_bytes:
            return None
        data = np.frombuffer(view, dtype=np.uint8).copy()
        self._entries[key] = data
        self.num_bytes += data.nbytes
        self.num_kept += 1
        while self.num_bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.num_bytes -= dropped.nbytes
            self.num_evicted += 1
        return data

    def reset(self) -> None:
        """Forget every block in memory (a reset of the prefix cache; the disk's files stay)."""
        self._entries.clear()
        self.num_bytes = 0

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Memory goes with the process; what is queued for the disk is written."""
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict:
        disk = self.disk.stats() if self.disk is not None else {}
        return {
            "prefix_host_bytes": self.num_bytes,
            "prefix_host_blocks_kept": self.num_kept,
            "prefix_host_blocks_evicted": self.num_evicted,
            **disk,
        }
