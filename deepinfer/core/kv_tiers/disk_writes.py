"""Runs on their way to the disk tier, written by one background thread so that the engine's step never waits
for a file write (an 8K-token prompt of the Llama-3.1-8B shape writes 1 GB through: crc32s, the write, the
rename). Until a run's file is published, ``find`` serves it from the payload it was queued with and ``held``
counts its blocks as stored, so nothing is lost or written twice in between.

Writes go in submission order. ``drain`` waits for all of them (LLM.generate does before it returns, so a
restarted engine finds what a finished generate computed; a process that exits normally also finishes its
queue). The queued payloads stay in (pinned) host memory until written: past MAX_PENDING_BYTES, ``put`` waits
for the oldest writes first, so a disk slower than the engine slows the engine instead of filling memory.
A write that fails is the disk tier's to handle (it reports and may turn itself off, as for a synchronous
put); the queue only logs an unexpected error and goes on.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from deepinfer.core.kv_tiers.payload import Run, check_payload, check_run

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 2 << 30


class DiskWrites:
    def __init__(self, disk, max_pending_bytes: int = MAX_PENDING_BYTES):
        self.disk, self.max_pending_bytes = disk, max_pending_bytes
        self._lock = threading.Lock()
        self._where: dict = {}  # member -> (entry, position), entry = (key, members, payload)
        self._pending: deque = deque()  # futures, oldest first (the submitting thread's)
        self._bytes = 0
        self._pool, self._pid = None, None
        self.written = self.errors = 0

    def put(self, key: bytes, payload: dict, members) -> None:
        """Queue a run (checked now, so a malformed one fails here, not on the thread)."""
        nbytes = check_payload(payload)
        members = check_run(key, members, payload)
        entry = (key, members, payload)
        with self._lock:
            for pos, m in enumerate(members):
                self._where[m] = (entry, pos)
            self._bytes += nbytes
        if self._pid != os.getpid():  # none yet, or a forked child's copy, whose thread is not running
            self._pool, self._pid = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write"), os.getpid()
        self._pending.append(self._pool.submit(self._write, entry, nbytes))
        while self._pending and (self._pending[0].done() or self._bytes > self.max_pending_bytes):
            self._pending.popleft().result()

    def _write(self, entry, nbytes: int) -> None:
        key, members, payload = entry
        try:
            self.disk.put(key, payload, members=members)
            self.written += 1
        except Exception:  # noqa: BLE001  (the engine goes on; the blocks are simply not on disk)
            self.errors += 1
            log.exception("KV disk tier: a background write of %d blocks failed", len(members))
        finally:
            with self._lock:
                for m in members:
                    if self._where.get(m, (None,))[0] is entry:
                        del self._where[m]
                self._bytes -= nbytes

    def find(self, member: bytes) -> Run | None:
        """The queued run holding ``member``, or None."""
        with self._lock:
            got = self._where.get(member)
        if got is None:
            return None
        (key, members, payload), pos = got
        return Run(key, members, pos, payload)

    def held(self, members) -> list:
        with self._lock:
            return [m in self._where for m in members]

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def drain(self) -> None:
        """Wait until every queued run is written (or has failed)."""
        while self._pending:
            self._pending.popleft().result()
