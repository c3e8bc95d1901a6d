"""The storage under the prefix cache's device tier: KV payloads in host memory and on disk.

KV blocks leave device memory in runs: consecutive blocks of one chain as one entry, a ``dict[str,
torch.Tensor]`` of CPU tensors whose dim 0 is the run's block index, keyed by the first block's chained hash
(bytes) and listing every block's hash (its members); each tier finds a run from any member. Plain entries
(a payload under a key, no members) are stored too: the encoder-SWA pool's snapshots. Entries are also tied
to an identity string (model + dtype + cache layout): the disk tier serves only entries written for its own.

- payload.py      the key, payload and run contract, tensors to and from raw bytes
- host.py         HostTier: LRU in (pinned) host memory, byte cap, per-entry TTL, member index
- entry_format.py the disk file format (magic, version, checksum, JSON header, members, raw bytes; no pickle)
- entry_files.py  the directory's files: atomic publication, reads, stamps, scans
- disk.py         DiskTier: one file per entry, LRU by mtime, shared by processes, a member index rebuilt
                  from the files' heads at start-up, faults degrade to "no disk tier" with one warning
- disk_writes.py  DiskWrites: runs queued for the disk tier, written by a background thread, served while queued
- store.py        TieredStore: host then disk (get promotes disk hits, find does not), writes through (runs: what a tier lacks)

The modules' docstrings state the file format, the atomicity argument and the failure behaviour.
"""

from deepinfer.core.kv_tiers.disk import DiskStats, DiskTier
from deepinfer.core.kv_tiers.disk_writes import DiskWrites
from deepinfer.core.kv_tiers.entry_format import FORMAT_VERSION, EntryCorrupt, EntryForeign
from deepinfer.core.kv_tiers.host import HostStats, HostTier
from deepinfer.core.kv_tiers.payload import Run
from deepinfer.core.kv_tiers.store import StoreStats, TieredStore

__all__ = ["DiskStats", "DiskTier", "DiskWrites", "EntryCorrupt", "EntryForeign", "FORMAT_VERSION", "HostStats", "HostTier",
           "Run", "StoreStats", "TieredStore"]
