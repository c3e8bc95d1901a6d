"""TieredStore: the host and disk tiers behind one get/put (the device tier, above them, is the engine's).

get looks in the host tier, then on disk, and promotes a disk hit to the host tier (find, for runs, does not:
see its docstring); put writes through to both
(to_disk=False keeps an entry in host memory only: CED's encoder SWA KV, with a TTL). Either tier may be None.

Runs (payload.py) go in through put_run and come out through find, the same way; with ``writes``
(disk_writes.py) a run reaches the disk through a background thread, and find and disk_held see it while it
is queued. put_run stores in each tier
only the stretches of the run that tier does not hold yet (each stretch a run of its own, keyed by its first
block), so a chain whose head came back from a tier and whose tail is new adds the tail, and never replaces
a longer run that starts at the same block.
"""

from __future__ import annotations

import threading

import attrs

from deepinfer.core.kv_tiers.disk import DiskStats, DiskTier
from deepinfer.core.kv_tiers.disk_writes import DiskWrites
from deepinfer.core.kv_tiers.host import HostStats, HostTier
from deepinfer.core.kv_tiers.payload import Run, check_key, check_run, run_slice


@attrs.frozen
class StoreStats:
    host_hits: int
    disk_hits: int
    misses: int
    host: HostStats | None
    disk: DiskStats | None


class TieredStore:
    def __init__(self, host: HostTier | None, disk: DiskTier | None, writes: DiskWrites | None = None):
        """writes: runs go to the disk through this background queue (disk_writes.py; stores over one disk
        tier share it) instead of being written by the caller."""
        self.host, self.disk, self.writes = host, disk, writes
        self._lock = threading.Lock()
        self._host_hits = self._disk_hits = self._misses = 0

    def get(self, key: bytes) -> dict | None:
        """key's payload from the nearest tier that has it, or None."""
        check_key(key)
        payload = self.host.get(key) if self.host is not None else None
        tier = "host"
        if payload is None and self.disk is not None:
            payload, tier = self.disk.get(key), "disk"
            if payload is not None and self.host is not None:
                self.host.put(key, payload)
        self._count(payload is not None, tier)
        return payload

    def put(self, key: bytes, payload: dict, host_ttl: float | None = None, to_disk: bool = True) -> None:
        """Store key's payload in the host tier (host_ttl=None: the tier's default TTL) and, with to_disk, on
        disk. A tier that refuses it (too large, disabled, a failed write) leaves it to the others."""
        if self.host is not None:
            self.host.put(key, payload, ttl_s=host_ttl)
        if to_disk and self.disk is not None:
            self.disk.put(key, payload)

    def find(self, member: bytes) -> Run | None:
        """The run holding block ``member`` from the nearest tier that has one, or None. A disk hit is served
        from the (pinned, where the disk tier pins) tensors its file was read into and is not promoted to the
        host tier: its blocks go back to the device, and when the device evicts them again they are saved to
        the host tier like any block. So those tensors are freed once copied, and the next disk hit reuses
        their pinned memory instead of pinning more (a fresh pinned allocation costs ~0.7 ms per MB)."""
        check_key(member)
        run = self.host.find(member) if self.host is not None else None
        tier = "host"
        if run is None and self.disk is not None:
            run, tier = self.writes.find(member) if self.writes is not None else None, "disk"
            if run is None:
                run = self.disk.find(member)
        self._count(run is not None, tier)
        return run

    def disk_held(self, members) -> list:
        """For each hash, whether the disk tier holds it or it is queued for the disk (DiskTier.held)."""
        members = list(members)
        if self.disk is None:
            return [False] * len(members)
        queued = self.writes.held(members) if self.writes is not None else [False] * len(members)
        rest = [m for m, q in zip(members, queued) if not q]
        on_disk = iter(self.disk.held(rest) if rest else [])
        return [q or next(on_disk) for q in queued]

    def drain(self) -> None:
        """Wait for the runs queued for the disk to be written."""
        if self.writes is not None:
            self.writes.drain()

    def _count(self, hit: bool, tier: str) -> None:
        with self._lock:
            if not hit:
                self._misses += 1
            elif tier == "host":
                self._host_hits += 1
            else:
                self._disk_hits += 1

    def put_run(self, members, payload: dict) -> None:
        """Store a run (payload.py) in every tier: in each, the stretches of blocks it does not hold already."""
        members = check_run(members[0] if members else b"", members, payload)
        for tier in (self.host, self.disk):
            if tier is None:
                continue
            held = tier.held(members) if tier is self.host else self.disk_held(members)
            put = self.writes.put if tier is self.disk and self.writes is not None else tier.put
            i = 0
            while i < len(members):
                if held[i]:
                    i += 1
                    continue
                j = i
                while j < len(members) and not held[j]:
                    j += 1
                put(members[i], payload if j - i == len(members) else run_slice(payload, i, j),
                    members=members[i:j])
                i = j

    def contains(self, key: bytes) -> bool:
        return (self.host is not None and self.host.contains(key)) or (
            self.disk is not None and self.disk.contains(key))

    def evict(self, key: bytes) -> bool:
        """Drop key from every tier; whether any held it."""
        self.drain()  # (a queued write of key would land after the eviction)
        dropped = [t.evict(key) for t in (self.host, self.disk) if t is not None]
        return any(dropped)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(self._host_hits, self._disk_hits, self._misses,
                              None if self.host is None else self.host.stats(),
                              None if self.disk is None else self.disk.stats())
