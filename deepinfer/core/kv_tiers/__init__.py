"""The storage under the prefix cache's device tier: KV block payloads in host memory and on disk.

A KV block leaves device memory as a payload, ``dict[str, torch.Tensor]`` of CPU tensors (one block's bytes
across the model's cache tensors), keyed by the engine's chained block hash (bytes). Entries are also tied to
an identity string (model + dtype + cache layout): the disk tier serves only entries written for its own.

- payload.py      the key and payload contract, tensors to and from raw bytes
- host.py         HostTier: LRU in (pinned) host memory, byte cap, per-entry TTL
- entry_format.py the disk file format (magic, version, checksum, JSON header, raw bytes; no pickle)
- disk.py         DiskTier: one file per entry, atomic publication, LRU by mtime, shared by processes,
                  faults degrade to "no disk tier" with one warning
- store.py        TieredStore: host then disk, disk hits promoted, writes through

The modules' docstrings state the file format, the atomicity argument and the failure behaviour.
"""

from deepinfer.core.kv_tiers.disk import DiskStats, DiskTier
from deepinfer.core.kv_tiers.entry_format import FORMAT_VERSION, EntryCorrupt, EntryForeign
from deepinfer.core.kv_tiers.host import HostStats, HostTier
from deepinfer.core.kv_tiers.store import StoreStats, TieredStore

__all__ = ["DiskStats", "DiskTier", "EntryCorrupt", "EntryForeign", "FORMAT_VERSION", "HostStats", "HostTier",
           "StoreStats", "TieredStore"]
