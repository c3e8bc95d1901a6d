"""The files of a KV cache directory: where entries live, how they are published, read, stamped and listed.

Layout: ``<root>/<first two hex digits of the key>/<key hex>.kvb`` holds one entry, a run's under its first
block's hash (format: entry_format.py);
``.<key hex>.<pid>.<random>.tmp`` beside it is an entry being written (``.probe.<pid>.<random>.tmp`` in the
root is the start-up check that the directory is writable). Only names of these shapes are ever opened or
removed; anything else in the directory is left alone.

Atomicity (several processes may share one directory, on one local file system):
- A writer creates its temporary file with O_EXCL under a name no one else uses, holds an exclusive flock on
  it while writing, and renames it onto the entry's name (rename(2) within one directory is atomic). A
  reader's open() finds no file, a complete old file or a complete new one, never half an entry; two writers
  of one key both rename complete files and the last one wins.
- A reader that has opened a file keeps reading that inode even if another process replaces or deletes the
  name; a reader that comes after a deletion gets ENOENT, which is a miss.
- A writer killed mid-entry (SIGKILL included) leaves only its temporary file, whose name never reads as an
  entry; the kernel drops its flock, and a scan removes the temporaries it can lock (a live writer's lock
  keeps its file safe from cleaners).
- Every read checks the checksums (entry_format.py), so damage outside this protocol (a bad disk, a power
  loss: there is no fsync, a manual copy) is a miss too. Shard directories are made with exist_ok and never
  removed, so a writer's mkdir never races a cleaner's rmdir.

LRU order lives in the files' mtimes: publish and stamp set them, strictly increasing within a process and by
the wall clock across processes (file systems keep coarse time, so the process adds its own tie-break).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import threading
import time
from pathlib import Path

ENTRY_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
_HEX = frozenset("0123456789abcdef")


def _write_chunks(f, chunks) -> None:  # a seam: tests stop a writer halfway through here
    for c in chunks:
        f.write(c)


class EntryFiles:
    """One process's access to the files under root. Methods raise OSError; deciding what a failure means
    is the tier's job. Thread-safe."""

    def __init__(self, root: Path):
        self.root = root
        self._last_stamp = 0
        self._lock = threading.Lock()

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + ENTRY_SUFFIX)

    def probe(self) -> None:
        """Create the root if needed and prove it writable: write, then delete, a temporary file."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.unlink(self._write_temp(self.root, "probe", [b""])[0])

    def publish(self, key: bytes, chunks) -> int:
        """Write key's entry from chunks and rename it into place; nothing of it is left behind on failure.
        Returns the file's inode."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return self._write_temp(path.parent, key.hex(), chunks, publish_as=path)[1]

    @contextlib.contextmanager
    def opened(self, path: Path):
        """(the file open for binary reading, its size, its inode) while the block runs: the inode read from
        start to end, whatever happens to the name meanwhile."""
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            yield f, st.st_size, st.st_ino

    def read_head(self, path, parse) -> tuple:
        """(parse(read), inode, size) with ``read(n)`` reading the file's next n bytes: a file's first bytes
        without the rest (entry_format.read_head)."""
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            return parse(f.read), st.st_ino, st.st_size

    def remove_if_same(self, path: Path, inode: int) -> None:
        """Delete path if it is still the file read as inode (not a good entry published since)."""
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass

    def stamp(self, path: Path) -> None:
        """Mark path as just used; a file gone meanwhile is no error (the order is only advice)."""
        stamp = self._next_stamp()
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            pass

    def scan(self) -> list:
        """[(mtime_ns, size, path, inode)] of every entry file, oldest first; removes dead writers' temporaries."""
        files = []
        top = _scandir_quietly(self.root)
        for in_shard, listing in [(False, top), *((True, _scandir_quietly(e.path)) for e in top if _is_shard(e))]:
            for e in listing:
                if in_shard and e.name.endswith(ENTRY_SUFFIX) and not e.name.startswith(".") and _is_file(e):
                    try:
                        st = e.stat()
                        files.append((st.st_mtime_ns, st.st_size, e.path, e.inode()))
                    except FileNotFoundError:
                        pass
                elif e.name.startswith(".") and e.name.endswith(TMP_SUFFIX):
                    _remove_if_dead(e.path)
        return sorted(files)

    def _next_stamp(self) -> int:
        with self._lock:
            self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            return self._last_stamp

    def _write_temp(self, directory: Path, stem: str, chunks, publish_as: Path | None = None) -> tuple:
        """Write chunks to a new locked temporary file in directory and rename it to publish_as, if given,
        before the lock is released; (its first name, its inode). The temporary is removed if anything fails."""
        tmp = directory / f".{stem}.{os.getpid()}.{secrets.token_hex(8)}{TMP_SUFFIX}"
        with open(tmp, "xb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released by the kernel however this process ends
                _write_chunks(f, chunks)
                f.flush()
                stamp = self._next_stamp()
                os.utime(f.fileno(), ns=(stamp, stamp))
                inode = os.fstat(f.fileno()).st_ino
                if publish_as is not None:
                    os.replace(tmp, publish_as)
            except BaseException:
                unlink_quietly(tmp)
                raise
        return tmp, inode


def unlink_quietly(path) -> bool:
    """Delete path; whether this call deleted it (another process may have been first)."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _is_shard(e: os.DirEntry) -> bool:
    return len(e.name) == 2 and set(e.name) <= _HEX and e.is_dir(follow_symlinks=False)


def _is_file(e: os.DirEntry) -> bool:
    try:
        return e.is_file()
    except OSError:
        return False


def _scandir_quietly(directory) -> list:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _remove_if_dead(tmp: str) -> None:
    """Delete a temporary file whose writer is gone: one whose flock we can take."""
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(tmp).st_ino == os.fstat(fd).st_ino:  # still the file we locked, not renamed into place
            os.unlink(tmp)
    except OSError:
        pass  # a live writer holds it, or it was published or removed meanwhile
    finally:
        os.close(fd)
