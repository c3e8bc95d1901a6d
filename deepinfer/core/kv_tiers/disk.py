"""DiskTier: KV block payloads as files in a directory that outlives the process, LRU, capped by bytes.

The directory comes from the argument or DEEPINFER_CACHE_DIR; its layout and why several processes may share
it are in entry_files.py, the file format in entry_format.py. put replaces whatever file is under its key's
name (a foreign one included) unless it already holds this identity's complete entry, which it only stamps.

LRU: a hit and a write stamp the file's mtime. When a writer's estimate of the directory's bytes (its last
scan plus its own writes) passes capacity_bytes, it scans the directory and deletes the oldest entries, any
identity's, down to evict_to x capacity_bytes. With several writers the directory can overshoot by what the
others wrote since their last scans; deleting a file another process deleted first is not an error.

Failures degrade, never raise (from put and get; bad arguments still raise):
- A corrupt or truncated entry is logged once, counted, deleted and is a miss; a foreign one (another
  identity or format version) is logged once, counted, left alone (its writer may still use it) and is a
  miss; an unreadable one is logged once and is a miss. Logs go to logging.getLogger("deepinfer.kv_tiers").
- A directory that cannot be created, written or scanned at start-up, and any write or scan error other than
  a racing deletion (read-only: EROFS; full: ENOSPC, EDQUOT; EACCES, EIO, ...), disables the tier with one
  warning: from then on get misses and put stores nothing, and the other tiers carry on.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import attrs

from deepinfer.core.kv_tiers.entry_files import EntryFiles, unlink_quietly
from deepinfer.core.kv_tiers.entry_format import (PREFIX_BYTES, EntryCorrupt, EntryForeign, decode, encode,
                                                  read_header, read_prefix)
from deepinfer.core.kv_tiers.payload import check_key, check_payload

log = logging.getLogger("deepinfer.kv_tiers")

_RACES = (errno.ENOENT, errno.ESTALE)  # someone else removed the file or directory first: a miss, not a fault


@attrs.frozen
class DiskStats:
    enabled: bool
    entries: int  # as of this process's last scan, plus its writes since
    bytes: int  # file bytes, headers included, counted like entries
    capacity_bytes: int
    hits: int
    misses: int
    writes: int
    evictions: int
    corrupt: int
    foreign: int


class DiskTier:
    """Entries for one identity (model + dtype + cache layout) in a directory that several processes share.
    get returns tensors over one buffer read from the file; the caller owns them. Thread-safe."""

    def __init__(self, directory: str | os.PathLike | None, capacity_bytes: int, identity: str,
                 evict_to: float = 0.9):
        root = directory if directory is not None else os.environ.get("DEEPINFER_CACHE_DIR")
        if not root:
            raise ValueError("DiskTier needs a directory: pass directory= or set DEEPINFER_CACHE_DIR")
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r} must be an int >= 0")
        if not isinstance(identity, str) or not identity:
            raise ValueError(f"identity={identity!r} must be a non-empty string")
        if not 0 <= evict_to <= 1:
            raise ValueError(f"evict_to={evict_to!r} must be in [0, 1]")
        self.root = Path(root).expanduser()
        self.capacity_bytes, self.identity, self.evict_to = capacity_bytes, identity, evict_to
        self.enabled, self.disabled_reason = True, None
        self._files = EntryFiles(self.root)
        self._lock = threading.Lock()
        self._evicting = threading.Lock()
        self._reported: set = set()  # (file name, inode) already logged
        self._entries = self._bytes = 0
        self._hits = self._misses = self._writes = self._evictions = self._corrupt = self._foreign = 0
        try:
            self._files.probe()
            self._evict()  # counts what is there, removes dead writers' temporaries, applies the cap
        except OSError as e:
            self._disable(f"cannot use {self.root}: {e}")

    def put(self, key: bytes, payload: dict) -> bool:
        """Write key's entry. False, storing nothing, when the tier is disabled, the write failed or the entry
        alone is over capacity_bytes."""
        check_key(key)
        check_payload(payload)
        if not self.enabled:
            return False
        if self._holds(key):
            self._files.stamp(self._files.path(key))
            return True
        chunks = encode(key, self.identity, payload)
        size = sum(memoryview(c).nbytes for c in chunks)
        if size > self.capacity_bytes:
            return False
        try:
            self._files.publish(key, chunks)
        except OSError as e:
            if e.errno not in _RACES:
                self._disable(f"writing {key.hex()}: {e}")
            return False
        with self._lock:
            self._writes += 1
            self._entries += 1
            self._bytes += size
            over = self._bytes > self.capacity_bytes
        if over:
            try:
                self._evict()
            except OSError as e:
                if e.errno not in _RACES:
                    self._disable(f"scanning {self.root}: {e}")
        return True

    def get(self, key: bytes) -> dict | None:
        """key's payload, now the most recently used, or None: absent, invalid, or the tier disabled."""
        check_key(key)
        payload = self._read(key) if self.enabled else None
        with self._lock:
            if payload is None:
                self._misses += 1
            else:
                self._hits += 1
        return payload

    def contains(self, key: bytes) -> bool:
        """Whether an entry file exists under key's name (not validated: get may still miss)."""
        return self.enabled and self._files.path(check_key(key)).is_file()

    def evict(self, key: bytes) -> bool:
        """Delete key's entry file; whether there was one."""
        return unlink_quietly(self._files.path(check_key(key)))

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(self.enabled, self._entries, self._bytes, self.capacity_bytes, self._hits,
                             self._misses, self._writes, self._evictions, self._corrupt, self._foreign)

    def _read(self, key: bytes) -> dict | None:
        path = self._files.path(key)
        try:
            buf, inode = self._files.read(path)
        except OSError as e:
            if e.errno not in _RACES:
                self._report(path, None, "unreadable", str(e))
            return None
        try:
            payload = decode(buf, key, self.identity)
        except EntryForeign as e:
            self._report(path, inode, "foreign", str(e))
            return None
        except EntryCorrupt as e:
            self._report(path, inode, "corrupt", f"{e}; deleted")
            self._files.remove_if_same(path, inode)
            return None
        self._files.stamp(path)
        return payload

    def _holds(self, key: bytes) -> bool:
        """Whether key's file looks like this identity's complete entry (header and size, not the checksum)."""
        try:
            with open(self._files.path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                prefix = f.read(PREFIX_BYTES)
                header_len, header = read_header(prefix + f.read(read_prefix(prefix)))
            return (header.get("identity") == self.identity and header.get("key") == key.hex()
                    and size == PREFIX_BYTES + header_len + header.get("payload_bytes", -1))
        except (OSError, ValueError, TypeError):
            return False

    def _evict(self) -> None:
        """Scan the directory (removing dead writers' temporaries), then delete the oldest entries while over
        capacity, down to evict_to of it."""
        if not self._evicting.acquire(blocking=False):
            return  # another thread of this process is at it
        try:
            files = self._files.scan()
            total, evicted = sum(f[1] for f in files), 0
            target = self.evict_to * self.capacity_bytes if total > self.capacity_bytes else total
            for _, size, path in files:
                if total <= target:
                    break
                unlink_quietly(path)  # gone either way: a racing evicter may have been first
                total -= size
                evicted += 1
            with self._lock:
                self._entries, self._bytes = len(files) - evicted, total
                self._evictions += evicted
        finally:
            self._evicting.release()

    def _report(self, path: Path, inode, kind: str, why: str) -> None:
        with self._lock:
            self._corrupt += kind == "corrupt"
            self._foreign += kind == "foreign"
            first = (path.name, inode) not in self._reported
            self._reported.add((path.name, inode))
        if first:
            log.warning("KV disk entry %s is %s, treated as a miss: %s", path, kind, why)

    def _disable(self, reason: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled, self.disabled_reason = False, reason
        log.warning("KV disk tier disabled (the other tiers carry on): %s", reason)
