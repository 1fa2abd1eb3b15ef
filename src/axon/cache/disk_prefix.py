"""The prefix cache's disk tier: one file per full KV block (and per recurrent-state snapshot of
a hybrid model), keyed by the block's sha256 chain hash (block_manager.chain_hash), so a prefix
computed by one engine process is found by the next. No torch: payloads are bytes-like.

Layout: `DIR/<model fingerprint, 16 hex>/<block hash, 64 hex>.kv` (or `.state`). The fingerprint
names everything the bytes depend on besides the tokens (the model file, dtypes, cache layout,
block size, parallel layout), so engines of different models or settings share one directory
without reading each other's blocks.

Each file is a fixed header (magic, version, kind, the full fingerprint, the block hash, payload
length, crc32 of the payload) and the payload. A reader checks all of it and removes a file that
does not match: a torn write after a crash, bit rot, a file copied in from another model. Files
are written to a unique temporary name and renamed into place, so two processes writing the same
block race harmlessly (the last rename wins, both files are whole).

Writes run on one daemon thread fed by a bounded queue: the engine's step loop only copies the
bytes out and enqueues them, and drops the block when the queue is full. An OSError on a write
(a full disk, a read-only directory) turns writing off with one warning; reads go on. Writing is
tried again after a pause (5 s, doubled after each failed try up to 5 minutes) with the next
block offered: the first that is written turns writing back on, with one line in the log. Past
`max_bytes` in the whole directory the least recently used files go (a read marks a file used by
touching its mtime), down to 90% of the cap.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterator

logger = logging.getLogger(__name__)

MAGIC = b"AXONPFX\x00"
VERSION = 1
KINDS = {"kv": 0, "state": 1}  # the file suffix and the header's kind field
_HEADER = struct.Struct("<8sHH32s32sQI")  # magic, version, kind, fingerprint, hash, length, crc
HEADER_SIZE = _HEADER.size
_EVICT_TO = 0.9  # evicting goes down to this share of the cap, so it runs once per many writes
_STALE_TMP_S = 3600.0  # a temporary file this old belongs to a process that died mid-write
RETRY_MIN_S, RETRY_MAX_S = 5.0, 300.0  # pauses before writing is tried again after a failure


_SUFFIXES = tuple(f".{kind}" for kind in KINDS)


def _is_fingerprint_dir(name: str) -> bool:
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


def _write_file(path: str, header: bytes, payload) -> None:
    """Writes one whole file (the tests make this raise OSError to stand for a full disk)."""
    with open(path, "wb") as file:
        file.write(header)
        file.write(payload)


class DiskPrefixStore:
    """The files of one model fingerprint under `root`, and the writer thread."""

    def __init__(self, root: str, fingerprint: bytes, max_bytes: int, queue_size: int = 64):
        if len(fingerprint) != 32:
            raise ValueError("the fingerprint is a 32-byte digest")
        self.root = os.path.abspath(root)
        self.fingerprint = fingerprint
        self.dir = os.path.join(self.root, fingerprint.hex()[:16])
        self.max_bytes = max_bytes
        self.writable = True
        self.retry_min_s = RETRY_MIN_S
        self._failures = 0  # failed tries in a row; the pause doubles with each
        self._retry_at = 0.0  # time.monotonic() from which a write is tried again
        self._probing = False  # a block queued as the try is not written yet
        self.num_written = 0
        self.num_dropped = 0  # blocks not written: the queue was full or writing is off
        self.num_rejected = 0  # files found bad on reading, removed
        self.num_evicted = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._total = 0  # bytes in the directory as last scanned plus what this process wrote
        self._pending: set[tuple[str, bytes]] = set()  # queued, not yet written
        self._lock = threading.Lock()
        try:
            os.makedirs(self.dir, exist_ok=True)
            self._total = sum(size for _, size, _ in self._scan())
        except OSError as exc:
            self._stop_writing(exc)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="axon-prefix-disk", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a script that never closes its engine still writes

    # ---- names ------------------------------------------------------------------------------

    def path(self, kind: str, block_hash: bytes) -> str:
        return os.path.join(self.dir, f"{block_hash.hex()}.{kind}")

    def contains(self, kind: str, block_hash: bytes) -> bool:
        """Whether a file for the block exists or is queued (unchecked: `read_into` checks)."""
        return (kind, block_hash) in self._pending or os.path.exists(self.path(kind, block_hash))

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers `read_into` names."""
        return ("disk",)

    def reset(self) -> None:
        """A prefix-cache reset leaves the files: they outlive the process anyway."""

    def needs(self, kind: str, block_hash: bytes) -> bool:
        """Whether `put` would have something to do for the block (the host tier's has more)."""
        return not self.contains(kind, block_hash)

    # ---- reading ----------------------------------------------------------------------------

    def read_into(self, kind: str, block_hash: bytes, buffer) -> str | None:
        """Fill `buffer` (writable, exactly the payload's length) from the block's file: "disk",
        the tier read, or None when there is none or it does not check out (a bad file is
        removed)."""
        path = self.path(kind, block_hash)
        view = memoryview(buffer).cast("B")
        try:
            with open(path, "rb") as file:
                header = file.read(HEADER_SIZE)
                ok = self._header_ok(header, kind, block_hash, len(view))
                ok = ok and file.readinto(view) == len(view) and not file.read(1)
        except FileNotFoundError:
            return None  # evicted (by another process, perhaps) since it was seen
        except OSError as exc:
            logger.warning("prefix cache file %s unreadable: %s", path, exc)
            return None
        if ok and zlib.crc32(view) == _HEADER.unpack(header)[6]:
            self._touch(path)
            return "disk"
        self.num_rejected += 1
        logger.warning("prefix cache file %s is corrupt, partial or foreign: removed", path)
        self._remove(path)
        return None

    def _header_ok(self, header: bytes, kind: str, block_hash: bytes, length: int) -> bool:
        if len(header) != HEADER_SIZE:
            return False
        magic, version, kind_id, fingerprint, stored_hash, stored_len, _ = _HEADER.unpack(header)
        return (magic, version, kind_id, fingerprint, stored_hash, stored_len) == (
            MAGIC, VERSION, KINDS[kind], self.fingerprint, block_hash, length,
        )  # fmt: skip

    @staticmethod
    def _touch(path: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used, for every process's eviction

    # ---- writing ----------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """Whether `put` would take a block now: ask before copying its bytes out."""
        return self.may_write() and not self._queue.full()

    def may_write(self) -> bool:
        """Writing is on, or off and due to be tried again (by one block at a time)."""
        return self.writable or (not self._probing and time.monotonic() >= self._retry_at)

    def put(self, kind: str, block_hash: bytes, payload) -> bool:
        """Queue a file for the writer thread; False (dropped) when the queue is full or writing
        is off."""
        if not self.may_write() or self._closed:
            self.num_dropped += 1
            return False
        probe = not self.writable
        self._probing = probe  # before the writer can take it and clear it
        try:
            self._queue.put_nowait((kind, block_hash, payload, probe))
        except queue.Full:
            self._probing = False
            self.num_dropped += 1
            return False
        self._pending.add((kind, block_hash))
        return True

    def flush(self) -> None:
        """Wait until every queued file is written (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued and stop the thread (once; later calls return at once)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)  # the thread runs until it takes this: never blocks for good
        self._thread.join()
        atexit.unregister(self.close)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, block_hash, payload, probe = item
            try:
                if self.writable or probe:
                    self._write(kind, block_hash, payload)
            except Exception:  # a bug must not kill the thread and block flush() forever
                logger.exception("prefix cache writer failed")
            finally:
                if probe:
                    self._probing = False
                self._pending.discard((kind, block_hash))
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, kind: str, block_hash: bytes, payload) -> None:
        view = memoryview(payload).cast("B")
        header = _HEADER.pack(
            MAGIC, VERSION, KINDS[kind], self.fingerprint, block_hash, len(view), zlib.crc32(view)
        )
        path = self.path(kind, block_hash)
        tmp = os.path.join(self.dir, f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            if not self.writable:  # a try after a failure: the directory may be gone
                os.makedirs(self.dir, exist_ok=True)
            _write_file(tmp, header, view)
            os.replace(tmp, path)  # atomic: a reader sees the old file or the new, never half
        except OSError as exc:
            self._remove(tmp)
            self._stop_writing(exc)
            return
        self._resume_writing()
        self.num_written += 1
        with self._lock:
            self._total += HEADER_SIZE + len(view)
            over = self._total > self.max_bytes
        if over:
            self._evict()

    def _stop_writing(self, exc: OSError) -> None:
        """Writing off until the next try, each failure in a row pausing twice as long."""
        if self.writable:
            logger.warning(
                "prefix cache directory %s is not writable (%s): prefixes are no longer saved "
                "to disk, tried again from time to time; requests are served as before",
                self.dir,
                exc,
            )
        self.writable = False
        pause = min(self.retry_min_s * 2**self._failures, RETRY_MAX_S)
        self._failures += 1
        self._retry_at = time.monotonic() + pause

    def _resume_writing(self) -> None:
        if not self.writable:
            logger.warning("prefix cache directory %s is writable again: saving prefixes", self.dir)
        self.writable = True
        self._failures = 0

    # ---- the size cap -----------------------------------------------------------------------

    def _scan(self) -> Iterator[tuple[str, int, float]]:
        """(path, size, mtime) of every block file under the root, any fingerprint's; stale
        temporary files are removed on the way."""
        now = time.time()
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False) or not _is_fingerprint_dir(sub.name):
                continue  # not ours: left alone
            for entry in os.scandir(sub.path):
                if not entry.name.endswith(_SUFFIXES) and not entry.name.startswith(".tmp-"):
                    continue
                try:
                    stat = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if entry.name.startswith(".tmp-"):
                    if now - stat.st_mtime > _STALE_TMP_S:
                        self._remove(entry.path)
                    continue
                yield entry.path, stat.st_size, stat.st_mtime

    def _evict(self) -> None:
        """Remove the least recently used files of the whole directory (every process's, every
        model's: the cap is the directory's) until it holds at most 90% of the cap."""
        try:
            files = sorted(self._scan(), key=lambda f: f[2])
        except OSError as exc:
            logger.warning("prefix cache directory %s not scanned: %s", self.root, exc)
            return
        total = sum(size for _, size, _ in files)
        target = int(self.max_bytes * _EVICT_TO)
        for path, size, _ in files:
            if total <= target:
                break
            if self._remove(path):
                self.num_evicted += 1
            total -= size
        with self._lock:
            self._total = total

    @staticmethod
    def _remove(path: str) -> bool:
        try:
            os.remove(path)
        except OSError:
            return False
        return True

    def stats(self) -> dict:
        return {
            "prefix_disk_blocks_written": self.num_written,
            "prefix_disk_blocks_dropped": self.num_dropped,
            "prefix_disk_files_rejected": self.num_rejected,
            "prefix_disk_files_evicted": self.num_evicted,
        }
