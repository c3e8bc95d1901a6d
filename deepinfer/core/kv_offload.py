"""Moving whole KV blocks between the device cache and the slower prefix-cache tiers (core/kv_tiers).

A model's paged cache is a set of tensors in which block b owns ``rows`` consecutive rows along one dim
(``paged_kv_views``): the Llama family's K and V [layers, slots, heads, dim] own slots b*bs .. b*bs+bs-1 along
dim 1; CED's FP4 global KV and indexer keys own bs/m entry rows along dim 0 per full layer. A block's payload
is those rows of every view, copied to host memory.

Leaving the device (``save``): when the pool evicts a cached block, its rows are copied to pinned host memory
without blocking, in stream order before any later kernel overwrites the block; the payloads wait in
``pending`` until the engine, which has waited for its step anyway, stores them (``flush``). Coming back
(``load``): a payload found in a tier is copied into a freshly allocated block, again in stream order, so
the step that reads it sees it.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def paged_kv_views(model, cache, block_size: int) -> list:
    """[(name, tensor, dim, rows per block)] of the model's paged cache: the model's own ``paged_kv_views``,
    else a tensor (or tuple of tensors) whose dim 1 is the slot (the Llama family, MLA)."""
    own = getattr(model, "paged_kv_views", None)
    if own is not None:
        return own(cache, block_size)
    tensors = cache if isinstance(cache, (tuple, list)) else (cache,)
    return [(f"kv{i}", t, 1, block_size) for i, t in enumerate(tensors)]


class BlockMover:
    def __init__(self, views: list, store, device):
        self.views, self.store, self.device = views, store, torch.device(device)
        self.pending: list = []  # (hash, payload, event or None) copied off the device, not yet stored
        self.saved = self.loaded = 0

    def _index(self, blocks: list, rows: int, device) -> torch.Tensor:
        """The rows of ``blocks`` along a view's block dim, block after block."""
        b = torch.tensor(blocks, dtype=torch.long)
        return (b[:, None] * rows + torch.arange(rows)).flatten().to(device, non_blocking=True)

    def save(self, items: list) -> None:
        """items: (hash, block id) of blocks about to be reused: copy them off the device now, one gather and
        one copy per view for all of them (each block's payload is a slice of those copies)."""
        cuda = self.device.type == "cuda"
        blocks = [b for _, b in items]
        payloads = [{} for _ in items]
        for name, t, dim, rows in self.views:
            src = t.index_select(dim, self._index(blocks, rows, t.device))
            dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=cuda)
            dst.copy_(src, non_blocking=cuda)
            for p, part in zip(payloads, dst.split(rows, dim)):
                p[name] = part
        ev = None
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
        self.pending += [(h, p, ev) for (h, _), p in zip(items, payloads)]

    def flush(self, wait: bool = False) -> None:
        """Store the copied blocks in the tiers: those whose copies have run (all of them with ``wait``)."""
        keep = []
        for h, payload, ev in self.pending:
            if ev is not None and not wait and not ev.query():
                keep.append((h, payload, ev))
                continue
            if ev is not None:
                ev.synchronize()
            self.store.put(h, payload)
            self.saved += 1
        self.pending = keep

    def find(self, h: bytes):
        """The payload stored under hash h (a block evicted before, possibly by another engine), or None."""
        for ph, payload, ev in self.pending:  # evicted this step, not stored yet
            if ph == h:
                if ev is not None:
                    ev.synchronize()
                return payload
        payload = self.store.get(h)
        if payload is None:
            return None
        for name, t, dim, rows in self.views:  # a file of another layout is a miss, never a wrong read
            p = payload.get(name)
            want = list(t.shape)
            want[dim] = rows
            if p is None or list(p.shape) != want or p.dtype != t.dtype:
                log.warning("deepinfer: a stored KV block does not fit this engine's cache (%s); ignored", name)
                return None
        return payload

    def load(self, blocks: list, payloads: list) -> None:
        """Copy payloads into device blocks: one host concatenation, one copy and one scatter per view."""
        if not blocks:
            return
        cuda = self.device.type == "cuda"
        for name, t, dim, rows in self.views:
            data = torch.cat([p[name] for p in payloads], dim)
            if cuda:
                data = data.pin_memory()
            t.index_copy_(dim, self._index(blocks, rows, t.device), data.to(t.device, non_blocking=True))
        self.loaded += len(blocks)


def block_mover(config, model, cache, identity: str, device):
    """The mover over the tiers EngineConfig asks for (host_cache_gb, cache_dir / $DEEPINFER_CACHE_DIR,
    disk_cache_gb), or None when it asks for none."""
    import os

    from .kv_tiers import DiskTier, HostTier, TieredStore

    directory = config.cache_dir or os.environ.get("DEEPINFER_CACHE_DIR") or None
    host = HostTier(int(config.host_cache_gb * 2**30)) if config.host_cache_gb > 0 else None
    disk = DiskTier(directory, int(config.disk_cache_gb * 2**30), identity) if directory else None
    if host is None and disk is None:
        return None
    return BlockMover(paged_kv_views(model, cache, config.block_size), TieredStore(host, disk), device)
