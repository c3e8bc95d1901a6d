"""Prefix caching, the device tier: full KV blocks found again by a hash of everything up to their end.

Block i of a sequence hashes (block i-1's hash, block i's token ids); block 0 chains from the sequence's
root key, which holds the extra keys (the engine's identity: model, dtype and cache layout; the request's
``cache_salt``). So two sequences share block i only when their first (i + 1) * block_size tokens and
their extra keys are equal. Only full blocks are hashed; a block's hash is registered once the step that
completes it has been launched (the KV is written in stream order before any later step reads it).

A registered block belongs to the pool like any other; when its last owner frees it, it stays findable
among the free blocks until an allocation evicts it (least recently freed first, core/kv_cache.py). A
lookup takes the longest run of registered hashes from block 0 and adds an owner to each block.

With slower tiers (a ``mover``, core/kv_offload.py): the cache remembers each registered block's parent
hash, so an eviction hands the mover (hash, block, parent) and chains of evicted blocks are stored as runs,
one tier entry each; a lookup goes on past the device's blocks with the runs the tiers hold and brings
them back in one batched copy.

Disk write-through (``disk_write_through``, on by default): with a disk tier, every block ``commit`` registers
is also copied off the device for the disk, so a restart finds what a run without memory pressure computed
(evictions alone would leave nothing there). The blocks committed since the last collection are gathered
once as the engine collects a step, in stream order behind the kernels that wrote them (``write_through``: a
second BlockMover, over the disk tier alone, the same views and runs as an eviction); blocks the disk already
holds are skipped, and the copied runs wait until about MAX_RUN_BYTES of them are pending or the engine goes
idle (``flush``), so one chain's blocks of successive steps join into one file; the files are written by a
background thread (kv_tiers/disk_writes.py), never inside a step, and ``drain`` waits for them. The host tier
stays write-back (evictions only); with no host tier, an eviction skips the blocks the disk already holds.

The per-request policy (the extra keys, which requests may hit, how much of a hit a model can use) is the
``prefix_cache`` and ``swa_replay`` stages'; this module is the mechanism the scheduler calls.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections import Counter
from pathlib import Path
from typing import Optional

from .kv_cache import BlockPool
from .kv_offload import MAX_RUN_BYTES, BlockMover
from .kv_tiers import TieredStore


def checkpoint_identity(path, hf_config: dict, load_format: str = "auto") -> str:
    """What a checkpoint's KV depends on: its config and its weight files (name, size, modification time; not
    their bytes, which would mean reading gigabytes at start-up). Random weights (load_format "dummy") are the
    same for the same config."""
    h = hashlib.sha256(json.dumps(hf_config, sort_keys=True, default=str).encode())
    h.update(load_format.encode())
    if load_format != "dummy":
        for f in sorted(Path(path).glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def root_key(identity: str, salt: Optional[str] = None) -> bytes:
    """The hash block 0 chains from: the engine identity and the request's cache salt (any str: encoded as UTF-8
    with lone surrogates passed through, which keeps distinct strings distinct and ordinary ones as they were)."""
    h = hashlib.sha256(b"deepinfer-prefix-v1\0" + identity.encode() + b"\0")
    if salt is not None:
        h.update(b"salt\0" + salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def token_bytes(tokens) -> bytes:
    """Token ids as 8-byte little-endian signed ints, packed (an id outside int64 is an OverflowError)."""
    a = array("q", tokens)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def chain(parent: bytes, tokens) -> bytes:
    """The hash of a full block: sha256 of its parent's hash, then its token ids (``token_bytes``)."""
    return hashlib.sha256(parent + token_bytes(tokens)).digest()


def block_hashes(root: bytes, tokens, block_size: int, have: Optional[list] = None,
                 upto: Optional[int] = None) -> list:
    """Hashes of every full block of ``tokens`` (of its first ``upto`` tokens), extending ``have`` (the hashes
    already computed) in place. The same as ``chain`` block by block; the tokens are packed once."""
    out = [] if have is None else have
    n = len(tokens) if upto is None else min(upto, len(tokens))
    first, last = len(out), n // block_size
    if first >= last:
        return out
    packed = token_bytes(tokens[first * block_size:last * block_size])
    step = 8 * block_size
    prev = out[-1] if out else root
    sha = hashlib.sha256
    for off in range(0, len(packed), step):
        prev = sha(prev + packed[off:off + step]).digest()
        out.append(prev)
    return out


def hashes_upto(seq, block_size: int, n: int) -> list:
    """seq.block_hashes with at least its first n full blocks' hashes computed (fewer where the tokens end first).
    A lookup walks only as far as the cache holds the prefix, so a cold prompt hashes one block before its step
    and the rest at commit, once its forward is queued (16K tokens: ~1.5 ms of host time off the step's start)."""
    if len(seq.block_hashes) < n:
        block_hashes(seq.cache_root, seq.token_ids, block_size, seq.block_hashes, upto=n * block_size)
    return seq.block_hashes


def hash_at(seq, block_size: int, i: int, limit: int) -> bytes:
    """The hash of seq's block i (< limit) for a walk over its prefix: where it is not computed yet, the blocks up to
    twice as far as the walk got are hashed (so a hit of n blocks hashes O(n), never past ``limit``)."""
    if i >= len(seq.block_hashes):
        hashes_upto(seq, block_size, min(limit, max(i + 1, 2 * i)))
    return seq.block_hashes[i]


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, mover=None, disk_write_through: bool = True):
        """mover: core.kv_offload.BlockMover over the host/disk tiers, or None (device memory only);
        disk_write_through: with a disk tier in the mover's store, every registered block goes to the disk too
        (the module docstring), not only evicted ones."""
        self.pool, self.block_size, self.mover = pool, block_size, mover
        self.block_of: dict = {}  # hash -> block id
        self.hash_of: dict = {}  # block id -> hash
        self.parent_of: dict = {}  # hash -> the hash of the block before it (None: a sequence's first block)
        pool.on_evict = self._evict
        self.stats = Counter()  # queries, query_tokens, hit_tokens, evictions, registered, written_through
        disk = getattr(getattr(mover, "store", None), "disk", None)
        # The disk tier's own mover: the same views and runs as ``mover``, stored in the disk tier only.
        writes = getattr(getattr(mover, "store", None), "writes", None)  # the background queue, shared
        self.writer = BlockMover(mover.views, TieredStore(None, disk, writes), mover.device) \
            if disk_write_through and disk is not None else None
        self._to_write: list = []  # (hash, block, parent hash) registered since the last write_through
        self._unflushed = 0  # blocks in writer.pending

    def lookup(self, seq, max_tokens: int) -> list:
        """Block ids of the longest cached prefix of seq (at most ``max_tokens`` tokens), each with an owner
        added; the caller frees them if it does not use them (and counts the admission: ``count``).

        Blocks in device memory are taken as they are; where the device has none, the run goes on in the
        slower tiers: runs of blocks found there (as few entries as cover the next hashes) come back into
        freshly allocated blocks, all of them with one batched copy per cache view."""
        bs = self.block_size
        limit = min(len(seq.token_ids), max_tokens) // bs
        hashes = seq.block_hashes  # computed as far as the walk goes (hash_at)
        hit, loaded, pieces, i = [], [], [], 0
        while i < limit:
            b = self.block_of.get(hash_at(seq, bs, i, limit))
            if b is not None:
                self.pool.revive(b)
                hit.append(b)
                i += 1
                continue
            if self.mover is None:
                break
            hashes_upto(seq, bs, limit)  # the tiers are asked for the whole rest
            got = self.mover.fetch(hashes[i:limit], stop=self.block_of.__contains__)
            n = min(sum(c for _, _, c in got), self.pool.num_free)
            if n == 0:
                break
            blocks = self.pool.allocate(n)  # may evict other free cached blocks (to the tiers)
            for k, b in enumerate(blocks):
                h = hashes[i + k]
                self.block_of[h], self.hash_of[b] = b, h
                self.parent_of[h] = hashes[i + k - 1] if i + k else None
                self.pool.mark_cached(b)
            loaded += blocks
            pieces += got
            hit += blocks
            i += n
            if n < sum(c for _, _, c in got):
                break  # no room for more (load takes the first len(loaded) blocks of the pieces)
        if loaded:
            self.mover.load(loaded, pieces)
            self.stats["tier_hit_blocks"] += len(loaded)
        return hit

    def count(self, seq) -> None:
        """An admission that looked up seq: its tokens and the ones its hit covers."""
        self.stats["queries"] += 1
        self.stats["query_tokens"] += len(seq.token_ids)
        self.stats["hit_tokens"] += seq.num_cached_tokens

    def commit(self, seq, num_tokens: int) -> None:
        """Register seq's full blocks among its first ``num_tokens`` positions (computed, tokens known); a step
        that filled no block costs a comparison."""
        n = min(num_tokens, len(seq.token_ids)) // self.block_size
        if n <= seq.num_committed_blocks:
            return
        hashes = block_hashes(seq.cache_root, seq.token_ids, self.block_size, seq.block_hashes, upto=num_tokens)
        for i in range(seq.num_committed_blocks, n):
            h, b = hashes[i], seq.block_table[i]
            if h not in self.block_of and b not in self.hash_of:
                self.block_of[h], self.hash_of[b] = b, h
                self.parent_of[h] = hashes[i - 1] if i else None
                self.pool.mark_cached(b)
                self.stats["registered"] += 1
                if self.writer is not None:
                    self._to_write.append((h, b, self.parent_of[h]))
        seq.num_committed_blocks = n

    def write_through(self) -> None:
        """Copy the blocks registered since the last call off the device for the disk tier (those it does not
        hold already): one gather and one copy per view for all of them, in stream order after the kernels
        queued so far. The engine calls it as it collects a step; an eviction calls it first, so a block is never
        reused before its copy is queued. Blocks that would take the disk's write queue past its cap are
        skipped (counted in ``write_through_skipped``)."""
        items, self._to_write = self._to_write, []
        if not items:
            return
        held = self.writer.store.disk_held([h for h, _, _ in items])
        items = [it for it, on_disk in zip(items, held) if not on_disk]
        writes = self.writer.store.writes
        if items and writes is not None and writes.pending_bytes + (self._unflushed + len(items)) \
                * self.writer.block_bytes > writes.max_pending_bytes:
            # The disk is behind: write-through is best effort and never makes a step wait for the disk (the
            # device still holds these blocks; an eviction stores them in the tiers then).
            self.stats["write_through_skipped"] += len(items)
            return
        if items:
            self.writer.save(items)
            self._unflushed += len(items)
            self.stats["written_through"] += len(items)

    def flush(self, wait: bool = False) -> None:
        """Store the runs the movers copied off the device: the evicted ones whose copies have run, and the
        written-through ones once about MAX_RUN_BYTES of them are pending (all of them, waiting for their
        copies, with ``wait``: the engine is idle)."""
        if self.mover is not None and self.mover.pending:
            self.mover.flush(wait)
        w = self.writer
        if w is not None and w.pending and (wait or self._unflushed * w.block_bytes >= MAX_RUN_BYTES):
            w.flush(wait)
            self._unflushed = sum(len(entry[0]) for entry in w.pending)

    def drain(self) -> None:
        """Store everything copied off the device and wait until the disk tier has written it (a restarted
        engine then finds it): LLM.generate calls it before it returns; the engine's own steps never wait."""
        self.flush(wait=True)
        if self.mover is not None:
            self.mover.store.drain()

    def _forget(self, blocks: list) -> list:
        """Drop the hashes of ``blocks``; returns (hash, block, parent hash) of those that had one."""
        gone = []
        for b in blocks:
            h = self.hash_of.pop(b, None)
            if h is not None:
                del self.block_of[h]
                gone.append((h, b, self.parent_of.pop(h, None)))
        return gone

    def _evict(self, blocks: list) -> None:
        if self._to_write:
            self.write_through()  # their copies queued before the blocks are reused
        gone = self._forget(blocks)
        self.stats["evictions"] += len(gone)
        if gone and self.writer is not None and self.mover.store.host is None:  # the disk has the written ones
            held = self.mover.store.disk_held([h for h, _, _ in gone])
            gone = [it for it, on_disk in zip(gone, held) if not on_disk]
        if gone and self.mover is not None:
            self.mover.save(gone)  # before the blocks are reused; chains of them become runs

    def summary(self) -> dict:
        """Totals since start-up: lookups, their prompt tokens and the tokens hit, blocks registered, evicted,
        and held now (in use or free); runs found in the host and disk tiers, blocks written through to the
        disk and files this process wrote there."""
        st = self.stats
        q = st["query_tokens"]
        store = self.mover.store.stats() if self.mover is not None else None
        return {"queries": st["queries"], "query_tokens": q, "hit_tokens": st["hit_tokens"],
                "hit_rate": st["hit_tokens"] / q if q else 0.0, "blocks_registered": st["registered"],
                "evictions": st["evictions"], "cached_blocks": len(self.block_of),
                "cached_free_blocks": self.pool.num_cached_free, "tier_hit_blocks": st["tier_hit_blocks"],
                "blocks_saved_to_tiers": self.mover.saved if self.mover is not None else 0,
                "runs_saved_to_tiers": self.mover.runs_saved if self.mover is not None else 0,
                "host_hit_runs": store.host_hits if store is not None else 0,
                "disk_hit_runs": store.disk_hits if store is not None else 0,
                "blocks_written_through": st["written_through"],
                "write_through_skipped": st["write_through_skipped"],
                "disk_writes": store.disk.writes if store is not None and store.disk is not None else 0}

    def reset(self) -> int:
        """Forget every cached block that no one uses (they return to plain free blocks); returns how many."""
        free = [b for b in list(self.hash_of) if self.pool.ref_count(b) == 0]
        self.pool.uncache_free(free)
        self._forget(free)
        return len(free)
