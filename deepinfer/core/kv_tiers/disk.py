"""DiskTier: KV payloads as files in a directory that outlives the process, LRU, capped by bytes.

The directory comes from the argument or DEEPINFER_CACHE_DIR; its layout and why several processes may share
it are in entry_files.py, the file format in entry_format.py. put replaces whatever file is under its key's
name (a foreign one included) unless it already holds this identity's complete entry (for a run: one whose
members begin with the new run's), which it only stamps.

Runs (payload.py) are files named by their first block's hash. The tier keeps an in-memory index from every
member hash to (run key, position), built at start-up from each file's head (entry_format.read_head: the
header and the members, not the payload), extended by its own writes and by every run it reads, and
refreshed by every directory scan (files it has not indexed, by name and inode, are read the same way; gone
ones are forgotten): scans come with evictions, and with a find that misses when the last scan is
``rescan_s`` old. ``find(h)`` reads the file the index names, or the file named h itself when h is not
indexed (a run another live process wrote since the last scan, found from its first block), checks it
whole as ``get`` does, and serves it only when its members hold h: an index entry whose file vanished or
was replaced by another run is a miss, and the index learns the file's real members.

LRU: a hit and a write stamp the file's mtime. When a writer's estimate of the directory's bytes (its last
scan plus its own writes) passes capacity_bytes, it scans the directory and deletes the oldest entries, any
identity's, down to evict_to x capacity_bytes. With several writers the directory can overshoot by what the
others wrote since their last scans; deleting a file another process deleted first is not an error.

Failures degrade, never raise (from put and get; bad arguments still raise):
- A corrupt or truncated entry is logged once, counted, deleted and is a miss; a foreign one (another
  identity or format version) is logged once, counted, left alone (its writer may still use it) and is a
  miss; an unreadable one is logged once and is a miss. Logs go to logging.getLogger("deepinfer.kv_tiers").
- A name that something other than an entry file holds (a directory in an entry's place, a file in its
  shard directory's) is logged once and stores nothing; the tier carries on with the other names.
- A directory that cannot be created, written or scanned at start-up, and any write or scan error other than
  a racing deletion or a blocked name (read-only: EROFS; full: ENOSPC, EDQUOT; EACCES, EIO, ...), disables
  the tier with one warning: from then on get misses and put stores nothing, and the other tiers carry on.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

import attrs
import torch

from deepinfer.core.kv_tiers.entry_files import EntryFiles, unlink_quietly
from deepinfer.core.kv_tiers.entry_format import EntryCorrupt, EntryForeign, encode, read_entry, read_head
from deepinfer.core.kv_tiers.payload import Run, check_key, check_payload, check_run

log = logging.getLogger("deepinfer.kv_tiers")

_RACES = (errno.ENOENT, errno.ESTALE)  # someone else removed the file or directory first: a miss, not a fault
# Something that is not a file holds the entry's name (a directory) or its shard's (a file): that name only.
_BLOCKED = (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY)


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
    indexed: int  # run members this process knows where to find


class DiskTier:
    """Entries for one identity (model + dtype + cache layout) in a directory that several processes share.
    get and find return new tensors that the file's bytes were read into (checked as they were read), pinned
    where pin_memory says; the caller owns them. Thread-safe."""

    def __init__(self, directory: str | os.PathLike | None, capacity_bytes: int, identity: str,
                 evict_to: float = 0.9, rescan_s: float = 10.0, clock=time.monotonic,
                 pin_memory: bool | None = None):
        """rescan_s: a find that misses rescans the directory (learning other processes' runs) when the last
        scan is at least this old; clock: where that age comes from (tests move it by hand). pin_memory=None
        pins when CUDA is available (as HostTier: a promoted run is kept without a copy and goes to the
        device asynchronously)."""
        root = directory if directory is not None else os.environ.get("DEEPINFER_CACHE_DIR")
        if not root:
            raise ValueError("DiskTier needs a directory: pass directory= or set DEEPINFER_CACHE_DIR")
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r} must be an int >= 0")
        if not isinstance(identity, str) or not identity:
            raise ValueError(f"identity={identity!r} must be a non-empty string")
        if not 0 <= evict_to <= 1:
            raise ValueError(f"evict_to={evict_to!r} must be in [0, 1]")
        if not (isinstance(rescan_s, (int, float)) and rescan_s >= 0):
            raise ValueError(f"rescan_s={rescan_s!r} must be a number >= 0")
        self.rescan_s, self._clock = rescan_s, clock
        self._pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._scanned_at = clock()
        self.root = Path(root).expanduser().absolute()  # a later chdir must not move the cache
        self.capacity_bytes, self.identity, self.evict_to = capacity_bytes, identity, evict_to
        self.enabled, self.disabled_reason = True, None
        self._files = EntryFiles(self.root)
        self._lock = threading.Lock()
        self._evicting = threading.Lock()
        self._reported: set = set()  # (file name, inode) already logged
        self._entries = self._bytes = 0
        self._hits = self._misses = self._writes = self._evictions = self._corrupt = self._foreign = 0
        self._runs: dict = {}  # file key -> (inode, members): every entry file whose head this process read
        self._where: dict = {}  # run member -> (run key, position)
        try:
            self._files.probe()
            self._evict()  # counts what is there, removes dead writers' temporaries, applies the cap, indexes
        except OSError as e:
            self._disable(f"cannot use {self.root}: {e}")

    def put(self, key: bytes, payload: dict, members=None) -> bool:
        """Write key's entry; with ``members``, a run (payload.py) that each member then finds. False, storing
        nothing, when the tier is disabled, the write failed or the entry alone is over capacity_bytes."""
        check_key(key)
        check_payload(payload)
        members = () if members is None else check_run(key, members, payload)
        if not self.enabled:
            return False
        if self._holds(key, members):
            self._files.stamp(self._files.path(key))
            return True
        chunks = encode(key, self.identity, payload, members)
        size = sum(memoryview(c).nbytes for c in chunks)
        if size > self.capacity_bytes:
            return False
        try:
            inode = self._files.publish(key, chunks)
        except OSError as e:
            if e.errno in _BLOCKED and self._root_is_dir():
                self._report(self._files.path(key), None, "not a file", f"not stored: {e}")
            elif e.errno not in _RACES:
                self._disable(f"writing {key.hex()}: {e}")
            return False
        with self._lock:
            self._learn(key, inode, members)
            self._writes += 1
            self._entries += 1
            self._bytes += size
            over = self._bytes > self.capacity_bytes
        if over:
            self._scan()
        return True

    def get(self, key: bytes) -> dict | None:
        """key's payload, now the most recently used, or None: absent, invalid, or the tier disabled."""
        check_key(key)
        got = self._read(key) if self.enabled else None
        self._count(got is not None)
        return None if got is None else got[0]

    def find(self, member: bytes) -> Run | None:
        """The run holding block ``member`` (its file now the most recently used), or None: not indexed and no
        run starts there, the file gone, invalid or holding other blocks now, or the tier disabled."""
        check_key(member)
        run = None
        if self.enabled:
            with self._lock:
                where = self._where.get(member)
            if where is None and self._clock() - self._scanned_at >= self.rescan_s:
                self._scan()  # another process may have written a run holding it since the last scan
                with self._lock:
                    where = self._where.get(member)
            key, pos = where if where is not None else (member, 0)
            got = self._read(key)
            if got is not None:
                payload, members = got
                if pos >= len(members) or members[pos] != member:
                    pos = members.index(member) if member in members else -1
                if pos >= 0:
                    run = Run(key, members, pos, payload)
        self._count(run is not None)
        return run

    def held(self, members) -> list:
        """For each hash, whether the index knows a file holding it that still exists (not validated: find may
        still miss); such files are stamped as just used (the caller was about to store those blocks again)."""
        if not self.enabled:
            return [False] * len(members)
        with self._lock:
            keys = [self._where.get(m, (None,))[0] for m in members]
        alive = {}
        for k in dict.fromkeys(keys):
            if k is not None:
                path = self._files.path(k)
                try:
                    alive[k] = path.is_file()
                except OSError:  # unreadable: store the blocks again (a failing write turns the tier off)
                    alive[k] = False
                if alive[k]:
                    self._files.stamp(path)
        return [k is not None and alive[k] for k in keys]

    def contains(self, key: bytes) -> bool:
        """Whether an entry file exists under key's name (not validated: get may still miss)."""
        return self.enabled and self._files.path(check_key(key)).is_file()

    def evict(self, key: bytes) -> bool:
        """Delete key's entry file; whether there was one."""
        gone = unlink_quietly(self._files.path(check_key(key)))
        with self._lock:
            self._forget(key)
        return gone

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(self.enabled, self._entries, self._bytes, self.capacity_bytes, self._hits,
                             self._misses, self._writes, self._evictions, self._corrupt, self._foreign,
                             len(self._where))

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1

    def _read(self, key: bytes) -> tuple | None:
        """(payload, members) of key's file, checked whole; None (and the index forgets the file) otherwise."""
        path = self._files.path(key)
        got = None
        try:
            with self._files.opened(path) as (f, size, inode):
                try:
                    got = read_entry(f, size, key, self.identity, self._alloc)
                except EntryForeign as e:
                    self._report(path, inode, "foreign", str(e))
                except EntryCorrupt as e:
                    self._report(path, inode, "corrupt", f"{e}; deleted")
                    self._files.remove_if_same(path, inode)
        except OSError as e:
            if e.errno not in _RACES:
                self._report(path, None, "unreadable", str(e))
        with self._lock:
            if got is None:
                self._forget(key)
            elif self._runs.get(key) != (inode, got[1]):  # most reads find what the index knows already
                self._learn(key, inode, got[1])
        if got is not None:
            self._files.stamp(path)
        return got

    def _alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A tensor that an entry's tensor is read into, pinned where the tier pins (if pinning fails, the tier
        warns once and reads into pageable memory from then on). One per tensor, not one buffer per file: the
        pinned allocator rounds each allocation up to a power of two, so a 16K-token CED run's twelve ~0.93 MB
        tensors take 12 MB of pinned memory where one 11.2 MB buffer would take 16 MB."""
        if self._pin:
            try:
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError as e:
                self._pin = False
                log.warning("KV disk tier: pinned memory failed, reading into pageable memory: %s", e)
        return torch.empty(shape, dtype=dtype)

    @property
    def pins(self) -> bool:
        """Whether reads go into pinned memory (until pinning fails once)."""
        return self._pin

    def _holds(self, key: bytes, members: tuple) -> bool:
        """Whether key's file looks like this identity's complete entry holding at least ``members`` (head and
        size, not the checksum); the index learns its members."""
        try:
            (header, held, start), inode, size = self._files.read_head(self._files.path(key), read_head)
            ok = (header.get("identity") == self.identity and header.get("key") == key.hex()
                  and size == start + header.get("payload_bytes", -1) and held[:len(members)] == members
                  and bool(held) == bool(members))
        except (OSError, ValueError, TypeError):
            return False
        if ok:
            with self._lock:
                self._learn(key, inode, held)
        return ok

    def _learn(self, key: bytes, inode: int, members: tuple) -> None:
        """The file named key (this inode) holds these members. Caller holds self._lock."""
        self._forget(key)
        self._runs[key] = (inode, members)
        for i, m in enumerate(members):
            self._where[m] = (key, i)

    def _forget(self, key: bytes) -> None:
        """The file named key is gone or unknown. Caller holds self._lock."""
        _, members = self._runs.pop(key, (None, ()))
        for m in members:
            if self._where.get(m, (None,))[0] == key:
                del self._where[m]

    def _scan(self) -> None:
        """_evict, a failure other than a racing deletion turning the tier off."""
        try:
            self._evict()
        except OSError as e:
            if e.errno not in _RACES:
                self._disable(f"scanning {self.root}: {e}")

    def _evict(self) -> None:
        """Scan the directory (removing dead writers' temporaries), delete the oldest entries while over
        capacity, down to evict_to of it, then bring the index up to date with the files that are left."""
        if not self._evicting.acquire(blocking=False):
            return  # another thread of this process is at it
        try:
            files = self._files.scan()
            total, evicted = sum(f[1] for f in files), 0
            target = self.evict_to * self.capacity_bytes if total > self.capacity_bytes else total
            for _, size, path, _ in files:
                if total <= target:
                    break
                unlink_quietly(path)  # gone either way: a racing evicter may have been first
                total -= size
                evicted += 1
            with self._lock:
                self._entries, self._bytes = len(files) - evicted, total
                self._evictions += evicted
            self._index(files[evicted:])
            self._scanned_at = self._clock()
        finally:
            self._evicting.release()

    def _index(self, files: list) -> None:
        """Read the heads of the files (from a scan) that the index does not know by name and inode, and forget
        the files that are no longer there. A head that does not read as this identity's is left out (get and
        find report it when they meet it)."""
        keys = {}
        for _, _, path, inode in files:
            name = os.path.basename(path)[:-len(".kvb")]
            try:
                keys[bytes.fromhex(name)] = (inode, path)
            except ValueError:
                continue
        with self._lock:
            for k in [k for k in self._runs if k not in keys]:
                self._forget(k)
            todo = [(k, inode, path) for k, (inode, path) in keys.items() if self._runs.get(k, (None,))[0] != inode]
        for k, inode, path in todo:
            try:
                (header, members, _), inode, _ = self._files.read_head(path, read_head)
            except OSError:
                continue  # gone meanwhile
            except ValueError:  # EntryCorrupt, EntryForeign: known, holding nothing to find
                members = ()
            else:
                if header.get("identity") != self.identity or header.get("key") != k.hex() \
                        or (members and members[0] != k):
                    members = ()
            with self._lock:
                self._learn(k, inode, members)

    def _root_is_dir(self) -> bool:
        try:
            return self.root.is_dir()
        except OSError:
            return False

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
