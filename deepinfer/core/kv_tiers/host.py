"""HostTier: KV payloads in host memory, least-recently-used first out, capped by bytes, with TTLs.

An entry is a plain payload or a run of blocks (payload.py); the tier indexes every member of a run, so
``find`` answers a lookup that starts at any block of it, and capacity, LRU order and eviction count whole
entries: dropping a run drops all its members. Payloads live in pinned memory when CUDA is available (so the
device tier copies them back asynchronously) and as the given CPU tensors otherwise. An entry may carry a time
to live (CED's encoder SWA KV is kept for minutes); an expired entry is never returned and its memory is given
back at the next put or get. Time comes from an injected clock (time.monotonic by default), so tests move it
by hand. All methods are thread-safe.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict

import attrs
import torch

from deepinfer.core.kv_tiers.payload import Run, check_key, check_payload, check_run


def _check_ttl(ttl_s):
    if ttl_s is not None and not (isinstance(ttl_s, (int, float)) and ttl_s > 0):
        raise ValueError(f"ttl_s={ttl_s!r} must be a number > 0 or None")
    return ttl_s


@attrs.frozen
class HostStats:
    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int  # pushed out to stay under capacity_bytes
    expirations: int  # dropped when their TTL ran out


@attrs.define(eq=False)
class _Entry:
    payload: dict
    nbytes: int
    expires_at: float | None
    members: tuple = ()  # a run's block hashes; () for a plain entry


class HostTier:
    """An LRU map key -> payload of at most capacity_bytes payload bytes.

    ttl_s is the default time to live of an entry (None: until evicted); put's ttl_s overrides it per entry.
    pin_memory=None pins when CUDA is available. The tier owns a payload once put (it may keep the very
    tensors) and get returns the stored tensors: neither side may write to them afterwards.
    """

    def __init__(self, capacity_bytes: int, ttl_s: float | None = None, clock=time.monotonic,
                 pin_memory: bool | None = None):
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r} must be an int >= 0")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = _check_ttl(ttl_s)
        self._clock = clock
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._where: dict = {}  # run member -> (run key, position)
        self._expiries: list = []  # heap of (expires_at, seq, key, entry); stale rows are skipped
        self._seq = 0
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._expirations = 0
        self._lock = threading.Lock()

    def put(self, key: bytes, payload: dict, ttl_s: float | None = None, members=None) -> bool:
        """Store (or replace) key's payload as the most recently used; ttl_s=None takes the tier's default.
        With ``members`` the entry is a run (payload.py) and each member now finds it (a member another run
        held moves to this one). False, storing nothing, when the payload alone is over capacity_bytes."""
        check_key(key)
        nbytes = check_payload(payload)
        members = () if members is None else check_run(key, members, payload)
        ttl_s = self.ttl_s if ttl_s is None else _check_ttl(ttl_s)
        payload = {name: t if not self._pin or t.is_pinned() else t.pin_memory() for name, t in payload.items()}
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._drop(key)
            if nbytes > self.capacity_bytes:
                return False
            entry = _Entry(payload, nbytes, None if ttl_s is None else now + ttl_s, members)
            self._entries[key] = entry
            for i, m in enumerate(members):
                self._where[m] = (key, i)
            self._bytes += nbytes
            if entry.expires_at is not None:
                self._seq += 1
                heapq.heappush(self._expiries, (entry.expires_at, self._seq, key, entry))
            while self._bytes > self.capacity_bytes:
                self._drop(next(iter(self._entries)))
                self._evictions += 1
            return True

    def get(self, key: bytes) -> dict | None:
        """key's payload, now the most recently used, or None (a miss) if absent or expired."""
        with self._lock:
            self._expire(self._clock())
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry.payload

    def find(self, member: bytes) -> Run | None:
        """The run holding block ``member`` (now the most recently used), or None (a miss)."""
        check_key(member)
        with self._lock:
            self._expire(self._clock())
            key, pos = self._where.get(member, (None, 0))
            if key is None:
                self._misses += 1
                return None
            entry = self._entries[key]
            self._entries.move_to_end(key)
            self._hits += 1
            return Run(key, entry.members, pos, entry.payload)

    def held(self, members) -> list:
        """For each hash, whether a run here holds it; a run holding one becomes the most recently used (the
        caller was about to store that block again)."""
        with self._lock:
            self._expire(self._clock())
            out = []
            for m in members:
                where = self._where.get(m)
                out.append(where is not None)
                if where is not None:
                    self._entries.move_to_end(where[0])
            return out

    def stored(self, key: bytes) -> dict | None:
        """key's payload as stored (pinned where the tier pins), changing no order or count; None if absent."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.payload

    def contains(self, key: bytes) -> bool:
        """Whether get(key) would hit now; changes neither the LRU order nor the hit counts."""
        with self._lock:
            self._expire(self._clock())
            return key in self._entries

    def evict(self, key: bytes) -> bool:
        """Drop key's entry; whether there was one."""
        with self._lock:
            return self._drop(key)

    def stats(self) -> HostStats:
        with self._lock:
            self._expire(self._clock())
            return HostStats(len(self._entries), self._bytes, self.capacity_bytes, self._hits, self._misses,
                             self._evictions, self._expirations)

    def _drop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            for m in entry.members:
                if self._where.get(m, (None,))[0] == key:
                    del self._where[m]
        return entry is not None

    def _expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            _, _, key, entry = heapq.heappop(self._expiries)
            if self._entries.get(key) is entry:  # not replaced or dropped since
                self._drop(key)
                self._expirations += 1
