"""TieredStore: the host and disk tiers behind one get/put (the device tier, above them, is the engine's).

get looks in the host tier, then on disk, and promotes a disk hit to the host tier; put writes through to both
(to_disk=False keeps an entry in host memory only: CED's encoder SWA KV, with a TTL). Either tier may be None.
"""

from __future__ import annotations

import threading

import attrs

from deepinfer.core.kv_tiers.disk import DiskStats, DiskTier
from deepinfer.core.kv_tiers.host import HostStats, HostTier
from deepinfer.core.kv_tiers.payload import check_key


@attrs.frozen
class StoreStats:
    host_hits: int
    disk_hits: int
    misses: int
    host: HostStats | None
    disk: DiskStats | None


class TieredStore:
    def __init__(self, host: HostTier | None, disk: DiskTier | None):
        self.host, self.disk = host, disk
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
        with self._lock:
            if payload is None:
                self._misses += 1
            elif tier == "host":
                self._host_hits += 1
            else:
                self._disk_hits += 1
        return payload

    def put(self, key: bytes, payload: dict, host_ttl: float | None = None, to_disk: bool = True) -> None:
        """Store key's payload in the host tier (host_ttl=None: the tier's default TTL) and, with to_disk, on
        disk. A tier that refuses it (too large, disabled, a failed write) leaves it to the others."""
        if self.host is not None:
            self.host.put(key, payload, ttl_s=host_ttl)
        if to_disk and self.disk is not None:
            self.disk.put(key, payload)

    def contains(self, key: bytes) -> bool:
        return (self.host is not None and self.host.contains(key)) or (
            self.disk is not None and self.disk.contains(key))

    def evict(self, key: bytes) -> bool:
        """Drop key from every tier; whether any held it."""
        dropped = [t.evict(key) for t in (self.host, self.disk) if t is not None]
        return any(dropped)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(self._host_hits, self._disk_hits, self._misses,
                              None if self.host is None else self.host.stats(),
                              None if self.disk is None else self.disk.stats())
