"""The prefix cache's slower tiers on the CPU: time to bring a long prefix's KV back from host memory and
from disk, in the CED bench config's real cache layout, without building the model. JSONL rows and a table.

    python benchmarks/tier_fetch_bench.py --prefixes 16384 65536 --out tier_fetch.jsonl

The cache is a CEDCache of the bench config (gpu_bench.ced_config("bench"); FP4 global KV and MXFP4 indexer
keys of every full layer, block_size 16) on the CPU, filled with random bytes; the views are the model's
``paged_kv_views``. One sequence of P tokens is committed to a PrefixCache over a BlockPool, freed, and
pushed out of the pool by an allocation of every free block (the engine's eviction path: PrefixCache._evict
-> BlockMover.save -> flush into the tiers). Then, per tier:
- ``host``: a lookup of the same tokens finds every block in a HostTier (pinned memory off: CPU);
- ``disk``: a restarted DiskTier over the directory (``startup_ms``: the tier's start-up, directory scan
  included) and a lookup that finds every block there (files in the page cache, as right after a write).
``fetch_ms`` is the lookup's time (hashing the prompt, finding the entries, copying them into the pool's
blocks), the median of ``--repeats`` lookups (``fetch_min_ms`` the fastest, ``fetch_cpu_ms`` the median
process CPU time, which a busy shared machine inflates less than wall time; torch runs one thread);
``find_ms``/``find_cpu_ms`` the part of it spent in the store's ``find`` (finding, reading and checking the
entries: what a tier costs, without the hashing and the scatter into the cache), medians likewise;
``entries_read`` the tier entries one lookup reads (host entries or disk files); between two, the blocks are
evicted again (already stored: nothing new written). ``hash_ms``: hashing the prompt's blocks alone, the
fastest of five.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import types

import torch

from deepinfer.core.kv_cache import BlockPool
from deepinfer.core.kv_offload import BlockMover
from deepinfer.core.kv_tiers import DiskTier, HostTier, TieredStore
from deepinfer.core.prefix_cache import PrefixCache, block_hashes, root_key


class _Seq:
    def __init__(self, tokens, root):
        self.token_ids, self.cache_root = tokens, root
        self.block_hashes, self.block_table, self.num_committed_blocks = [], [], 0


def ced_views(num_blocks: int, block_size: int) -> list:
    """The paged views of a CED bench-config cache on the CPU, filled with random bytes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_bench

    from deepinfer.models.ced.cache import CEDCache
    from deepinfer.models.ced.config import CEDConfig
    from deepinfer.models.ced.model import CEDEngineMixin

    hf = gpu_bench.ced_config("bench", num_blocks * block_size)
    c = CEDConfig.from_hf(hf)
    cache = CEDCache(c, num_blocks, block_size, 1, torch.bfloat16, torch.device("cpu"))
    views = CEDEngineMixin.paged_kv_views(types.SimpleNamespace(config=c), cache, block_size)
    g = torch.Generator().manual_seed(0)
    for _, t, _, _ in views:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    return views


def evict_all(pool: BlockPool, mover) -> None:
    got = pool.allocate(pool.num_free)
    mover.flush(wait=True)
    pool.free(got)


def measure(P: int, tier: str, views, num_blocks: int, bs: int, directory: str, repeats: int) -> dict:
    tokens = random.Random(P).choices(range(3, 32000), k=P)
    root = root_key("tier-fetch-bench")
    hash_ms = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        block_hashes(root, tokens, bs)
        hash_ms = min(hash_ms, (time.perf_counter() - t0) * 1e3)
    identity = "tier-fetch-bench|ced-bench"

    def store():
        if tier == "host":
            return TieredStore(HostTier(1 << 33, pin_memory=False), None)
        return TieredStore(None, DiskTier(directory, 1 << 34, identity))

    pool = BlockPool(num_blocks)
    first = store()
    cache = PrefixCache(pool, bs, BlockMover(views, first, "cpu"))
    seq = _Seq(tokens, root)
    seq.block_table = pool.allocate(P // bs)
    cache.commit(seq, P)
    pool.free(seq.block_table)
    evict_all(pool, cache.mover)
    startup_ms = None
    if tier == "disk":  # a restart: a new tier over the directory, a new pool
        t0 = time.perf_counter()
        again = store()
        startup_ms = (time.perf_counter() - t0) * 1e3
        pool = BlockPool(num_blocks)
        cache = PrefixCache(pool, bs, BlockMover(views, again, "cpu"))
    times, cpu, find_times, find_cpu = [], [], [], []
    store = cache.mover.store
    before = store.stats()
    in_find = [0.0, 0.0]
    real_find = store.find

    def timed_find(h):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return real_find(h)
        finally:
            in_find[0] += time.perf_counter() - t0
            in_find[1] += time.process_time() - c0

    store.find = timed_find
    for r in range(repeats):
        s = _Seq(tokens, root)
        in_find[:] = [0.0, 0.0]
        t0, c0 = time.perf_counter(), time.process_time()
        hit = cache.lookup(s, P)
        times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        find_times.append(in_find[0] * 1e3)
        find_cpu.append(in_find[1] * 1e3)
        assert len(hit) == P // bs, (len(hit), P // bs)
        pool.free(hit)
        evict_all(pool, cache.mover)
    after = cache.mover.store.stats()
    entries = (after.host_hits + after.disk_hits - before.host_hits - before.disk_hits) / repeats
    block_bytes = sum(t[:rows].numel() * t.element_size() if dim == 0 else 0 for _, t, dim, rows in views)
    row = {"bench": "tier_fetch", "layout": "ced-bench", "prefix": P, "blocks": P // bs, "tier": tier,
           "fetch_ms": round(statistics.median(times), 2), "fetch_min_ms": round(min(times), 2),
           "fetch_cpu_ms": round(statistics.median(cpu), 2),
           "find_ms": round(statistics.median(find_times), 2), "find_cpu_ms": round(statistics.median(find_cpu), 2),
           "entries_read": entries, "hash_ms": round(hash_ms, 2),
           "views": len(views), "block_bytes": block_bytes, "repeats": repeats}
    if startup_ms is not None:
        row["startup_ms"] = round(startup_ms, 2)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixes", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--tiers", nargs="+", default=["host", "disk"], choices=["host", "disk"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", default="", help="a note stored in every row (e.g. before/after)")
    ap.add_argument("--out", default="tier_fetch.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(1)
    num_blocks = max(args.prefixes) // args.block_size + 16
    views = ced_views(num_blocks, args.block_size)
    rows = []
    for P in args.prefixes:
        for tier in args.tiers:
            with tempfile.TemporaryDirectory(prefix="deepinfer-tier-fetch-") as d:
                row = measure(P, tier, views, num_blocks, args.block_size, d, args.repeats)
            row["label"] = args.label
            rows.append(row)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print("row", json.dumps(row), flush=True)
    print(f"\n{'prefix':>7} {'blocks':>6} {'tier':5} {'entries':>7} {'fetch ms':>9} {'min ms':>8} {'cpu ms':>8} "
          f"{'find ms':>8} {'find cpu':>8} {'hash ms':>8} {'startup ms':>10}")
    for r in rows:
        print(f"{r['prefix']:7} {r['blocks']:6} {r['tier']:5} {r['entries_read']:7.0f} {r['fetch_ms']:9.1f} "
              f"{r['fetch_min_ms']:8.1f} {r['fetch_cpu_ms']:8.1f} {r['find_ms']:8.2f} {r['find_cpu_ms']:8.2f} "
              f"{r['hash_ms']:8.2f} {r.get('startup_ms', float('nan')):10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
