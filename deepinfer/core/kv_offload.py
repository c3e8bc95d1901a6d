"""Moving KV blocks between the device cache and the slower prefix-cache tiers (core/kv_tiers), in runs.

A model's paged cache is a set of tensors in which block b owns ``rows`` consecutive rows along one dim
(``paged_kv_views``): the Llama family's K and V [layers, slots, heads, dim] own slots b*bs .. b*bs+bs-1 along
dim 1; CED's FP4 global KV and indexer keys own bs/m entry rows along dim 0 per full layer.

Runs: the tiers store consecutive blocks of one chain as one entry (kv_tiers/payload.py), so a long prefix
is a few files and a few host entries, not one per block. A run's payload holds, per view, one tensor
[blocks, rows, *the view's other dims] (the view's block dim moved first): the run's rows back to back, so
any stretch of its blocks is a slice along dim 0 and a load is one copy per view.

Leaving the device (``save``): when the pool evicts a batch of cached blocks, ``chain_runs`` groups them into
runs (a block whose parent block is in the batch continues its parent's run; at most ``max_run_blocks``
blocks per run), their rows are gathered and copied to pinned host memory without blocking, in stream order
before any later kernel overwrites the blocks (one gather and one copy per view per MAX_GATHER_BYTES); the
runs wait in ``pending`` until the engine, which has waited for its step anyway, stores them (``flush``,
which first joins runs that successive evictions cut from one chain).
Coming back: ``fetch`` finds the runs covering a list of hashes (a run may start before the first hash or go
on past what matches; the fetch takes what matches, in order, and stops at the first hash no tier has), and
``load`` copies them into freshly allocated blocks: per view one host-to-device copy per run found and one
scatter for them all, again in stream order, so the step that reads them sees them.
"""

from __future__ import annotations

import logging

import torch

from .kv_tiers.payload import Run

log = logging.getLogger(__name__)

MAX_RUN_BYTES = 16 << 20  # a run's payload at most (fewer blocks when a tier is small: see BlockMover)
MAX_RUN_BLOCKS = 1024  # and at most this many blocks (a disk header lists them: 32 bytes each)
MAX_GATHER_BYTES = 256 << 20  # device memory one gather of evicted blocks may take (save)


def paged_kv_views(model, cache, block_size: int) -> list:
    """[(name, tensor, dim, rows per block)] of the model's paged cache: the model's own ``paged_kv_views``,
    else a tensor (or tuple of tensors) whose dim 1 is the slot (the Llama family, MLA)."""
    own = getattr(model, "paged_kv_views", None)
    if own is not None:
        return own(cache, block_size)
    tensors = cache if isinstance(cache, (tuple, list)) else (cache,)
    return [(f"kv{i}", t, 1, block_size) for i, t in enumerate(tensors)]


def chain_runs(items: list, max_blocks: int) -> list:
    """items: (hash, block, parent hash or None) of evicted blocks, in eviction order. Returns runs, lists of
    items in chain order: a block whose parent is among the items continues its parent's run (the first such
    child in item order does; a sibling starts a run of its own), and a run longer than max_blocks goes on
    in a new run. Every item is in exactly one run; runs come in the order of their first item's chain root."""
    index = {it[0]: it for it in items}
    children: dict = {}
    for it in items:
        if it[2] in index and it[2] != it[0]:
            children.setdefault(it[2], []).append(it)
    runs, seen = [], set()
    starts = [it for it in items if it[2] not in index or it[2] == it[0]]
    starts += items  # anything not reached from a root (a cycle, which hashes never form) starts its own run
    for start in starts:
        if start[0] in seen:
            continue
        todo = [start]
        while todo:
            it, run = todo.pop(), []
            while it is not None and it[0] not in seen:
                seen.add(it[0])
                if len(run) == max_blocks:
                    runs.append(run)
                    run = []
                run.append(it)
                kids = [k for k in children.get(it[0], ()) if k[0] not in seen]
                todo += reversed(kids[1:])
                it = kids[0] if kids else None
            if run:
                runs.append(run)
    return runs


def _cat(parts: list) -> torch.Tensor:
    """torch.cat along dim 0, into pinned memory when the parts are pinned (the host tier keeps it as is)."""
    shape = (sum(len(p) for p in parts), *parts[0].shape[1:])
    out = torch.empty(shape, dtype=parts[0].dtype, pin_memory=parts[0].is_pinned())
    return torch.cat(parts, out=out)


class BlockMover:
    def __init__(self, views: list, store, device, max_run_bytes: int = MAX_RUN_BYTES,
                 max_run_blocks: int = MAX_RUN_BLOCKS):
        """max_run_bytes / max_run_blocks cap a run; a run is also kept under a quarter of the smallest tier's
        capacity, so a tier never refuses one for its size alone."""
        self.views, self.store, self.device = views, store, torch.device(device)
        # The shape of one block's rows in a run tensor, per view: [rows, *the view's dims but the block dim].
        self._block_shapes = {name: [rows, *t.movedim(dim, 0).shape[1:]] for name, t, dim, rows in views}
        block_bytes = sum(rows * t.movedim(dim, 0)[0].numel() * t.element_size() for _, t, dim, rows in views)
        caps = [max_run_bytes] + [tier.capacity_bytes // 4 for tier in (getattr(store, "host", None),
                                                                        getattr(store, "disk", None))
                                  if tier is not None]
        self.block_bytes = max(1, block_bytes)
        self.max_run_blocks = max(1, min(max_run_blocks, min(caps) // self.block_bytes))
        # (members, payload, event or None, parent hash of the first member): runs copied off the device, not
        # stored yet
        self.pending: list = []
        self._pending_at: dict = {}  # member -> (index in pending, position)
        self.saved = self.loaded = self.runs_saved = 0

    def warm_pinned(self, runs: int = 2) -> None:
        """Pin, once at start-up, the host memory that ``runs`` full runs read from disk take (per view, the
        tensor a disk read allocates), and free it: torch's caching host allocator keeps it (by power-of-two
        size), so the first disk hits of a restarted engine reuse it instead of pinning memory on the
        request's path (~0.7 ms per MB on the H200's host, most of a 16K-token CED run's lookup)."""
        held = [torch.empty((self.max_run_blocks, *self._block_shapes[name]), dtype=t.dtype, pin_memory=True)
                for _ in range(runs) for name, t, _, _ in self.views]
        del held

    def _index(self, blocks: list, rows: int, device) -> torch.Tensor:
        """The rows of ``blocks`` along a view's block dim, block after block."""
        b = torch.tensor(blocks, dtype=torch.long)
        return (b[:, None] * rows + torch.arange(rows)).flatten().to(device, non_blocking=True)

    def save(self, items: list) -> None:
        """items: (hash, block id, parent hash or None) of blocks about to be reused: group them into runs and
        copy them off the device now, one gather and one copy per view for each MAX_GATHER_BYTES of them (the
        gather's device buffer: evicting a whole 40 GB pool must not need 40 GB more)."""
        batch, size = [], 0
        for run in chain_runs(items, self.max_run_blocks):
            if batch and size + len(run) * self.block_bytes > MAX_GATHER_BYTES:
                self._save_runs(batch)
                batch, size = [], 0
            batch.append(run)
            size += len(run) * self.block_bytes
        if batch:
            self._save_runs(batch)

    def _save_runs(self, runs: list) -> None:
        blocks = [b for run in runs for _, b, _ in run]
        cuda = self.device.type == "cuda"
        payloads = [{} for _ in runs]
        index = {}
        for name, t, dim, rows in self.views:
            idx = index.get((rows, t.device))
            if idx is None:
                idx = index[rows, t.device] = self._index(blocks, rows, t.device)
            src = t.movedim(dim, 0).index_select(0, idx)  # [blocks*rows, ...]
            dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=cuda)
            dst.copy_(src, non_blocking=cuda)
            dst = dst.view(len(blocks), *self._block_shapes[name])
            at = 0
            for p, run in zip(payloads, runs):
                p[name] = dst[at:at + len(run)]
                at += len(run)
        ev = None
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
        for run, p in zip(runs, payloads):
            members = tuple(h for h, _, _ in run)
            for pos, h in enumerate(members):
                self._pending_at[h] = (len(self.pending), pos)
            self.pending.append((members, p, ev, run[0][2]))

    def flush(self, wait: bool = False) -> None:
        """Store the copied runs in the tiers: those whose copies have run (all of them with ``wait``). Runs
        that several evictions since the last flush made of one chain (a step's allocations each evict a few
        blocks, oldest first) are joined first, up to the cap."""
        keep, ready = [], []
        for entry in self.pending:
            ev = entry[2]
            if ev is not None and not wait and not ev.query():
                keep.append(entry)
                continue
            if ev is not None:
                ev.synchronize()
            ready.append(entry)
        for members, payload in self._join(ready):
            self.store.put_run(members, payload)
            self.saved += len(members)
            self.runs_saved += 1
        self.pending = keep
        self._pending_at = {h: (i, pos) for i, entry in enumerate(keep) for pos, h in enumerate(entry[0])}

    def _join(self, ready: list) -> list:
        """[(members, payload)]: the pending runs, a run whose first block's parent is the last block of an
        earlier one appended to it (one host concatenation per view) while the two fit under the cap."""
        joined: list = []  # [members, [payloads]]
        by_last: dict = {}  # last member -> index in joined
        for members, payload, _, parent in ready:
            j = by_last.pop(parent, None) if parent is not None else None
            if j is not None and len(joined[j][0]) + len(members) <= self.max_run_blocks \
                    and not set(members) & set(joined[j][0]):
                joined[j][0] += members
                joined[j][1].append(payload)
            else:
                j = len(joined)
                joined.append([list(members), [payload]])
            by_last[members[-1]] = j
        return [(tuple(members), parts[0] if len(parts) == 1 else {name: _cat([p[name] for p in parts])
                                                                   for name in parts[0]})
                for members, parts in joined]

    def find(self, h: bytes) -> Run | None:
        """The run holding block h (evicted before, possibly by another engine), or None."""
        at = self._pending_at.get(h)
        if at is not None:  # evicted, not stored yet
            members, payload, ev, _ = self.pending[at[0]]
            if ev is not None:
                ev.synchronize()
            return Run(members[0], members, at[1], payload)
        run = self.store.find(h)
        if run is None:
            return None
        for name, t, _, _ in self.views:  # a file of another layout is a miss, never a wrong read
            p = run.payload.get(name)
            if p is None or list(p.shape) != [len(run.members), *self._block_shapes[name]] or p.dtype != t.dtype:
                log.warning("deepinfer: a stored KV run does not fit this engine's cache (%s); ignored", name)
                return None
        return run

    def fetch(self, hashes: list, stop=None) -> list:
        """[(payload, start, count)]: runs covering hashes[0], hashes[1], ... in order, each contributing its
        blocks start .. start+count-1; they end at the first hash no tier has, or for which ``stop(h)``."""
        pieces, i = [], 0
        while i < len(hashes) and not (stop is not None and stop(hashes[i])):
            run = self.find(hashes[i])
            if run is None:
                break
            pos = run.position
            k = min(len(run.members) - pos, len(hashes) - i)
            want = hashes[i:i + k]
            if run.members[pos:pos + k] == tuple(want) and not (stop is not None and any(map(stop, want))):
                n = k  # the common case: the run matches to its end or to the last hash asked for
            else:
                n = 1
                while n < k and run.members[pos + n] == want[n] and not (stop is not None and stop(want[n])):
                    n += 1
            pieces.append((run.payload, pos, n))
            i += n
        return pieces

    def load(self, blocks: list, pieces: list) -> None:
        """Copy the blocks of ``pieces`` (from fetch; the first len(blocks) of them) into device blocks. Per
        view: on a GPU, the pieces' rows are copied into one device buffer (no host concatenation) and
        scattered by one index_copy_; on the CPU, each piece is scattered straight from where it lies."""
        if not blocks:
            return
        cut, left = [], len(blocks)
        for payload, start, n in pieces:
            if left == 0:
                break
            cut.append((payload, start, min(n, left)))
            left -= cut[-1][2]
        if left:
            raise ValueError(f"load: {len(blocks)} blocks but the pieces hold {len(blocks) - left}")
        cuda = self.device.type == "cuda"
        index = {}
        for name, t, dim, rows in self.views:
            idx = index.get((rows, t.device))
            if idx is None:
                idx = index[rows, t.device] = self._index(blocks, rows, t.device)
            parts = [p[name][s:s + n].flatten(0, 1) for p, s, n in cut]  # [n*rows, ...] each
            if not cuda:
                at = 0
                for part in parts:  # the rows go back to the view's block dim
                    t.index_copy_(dim, idx[at:at + len(part)], part.movedim(0, dim))
                    at += len(part)
                continue
            if len(parts) == 1:
                data = parts[0].to(t.device, non_blocking=True)
            else:
                data = torch.empty((len(idx), *parts[0].shape[1:]), dtype=t.dtype, device=t.device)
                at = 0
                for part in parts:
                    data[at:at + len(part)].copy_(part, non_blocking=True)
                    at += len(part)
            t.index_copy_(dim, idx, data.movedim(0, dim))
        self.loaded += len(blocks)


def block_mover(config, model, cache, identity: str, device):
    """The mover over the tiers EngineConfig asks for (host_cache_gb, cache_dir / $DEEPINFER_CACHE_DIR,
    disk_cache_gb), or None when it asks for none."""
    import os

    from .kv_tiers import DiskTier, DiskWrites, HostTier, TieredStore

    directory = config.cache_dir or os.environ.get("DEEPINFER_CACHE_DIR") or None
    host = HostTier(int(config.host_cache_gb * 2**30)) if config.host_cache_gb > 0 else None
    disk = DiskTier(directory, int(config.disk_cache_gb * 2**30), identity) if directory else None
    if host is None and disk is None:
        return None
    # The engine never writes a file itself: runs reach the disk through a background queue (disk_writes.py).
    store = TieredStore(host, disk, DiskWrites(disk) if disk is not None else None)
    mover = BlockMover(paged_kv_views(model, cache, config.block_size), store, device)
    if disk is not None and disk.enabled and disk.pins:
        mover.warm_pinned()
    return mover
