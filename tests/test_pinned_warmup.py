"""A restarted engine's first disk hits reuse pinned memory pinned at start-up (BlockMover.warm_pinned): the
read of a full run allocates no new pinned block, and the blocks it brings back hold the bytes that were
saved. Needs CUDA (pinned memory); skipped elsewhere."""

from __future__ import annotations

import hashlib

import pytest
import torch

from deepinfer.core.kv_offload import BlockMover
from deepinfer.core.kv_tiers import DiskTier, TieredStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")

BLOCKS, ROWS = 64, 4


def views(kv, ik):
    return [("kv", kv, 1, ROWS), ("ik", ik, 0, 1)]


def test_a_full_run_read_from_disk_reuses_the_warmed_pinned_memory(tmp_path):
    kv = torch.randn(2, BLOCKS * ROWS, 24, device="cuda", dtype=torch.bfloat16)
    ik = torch.randint(0, 255, (BLOCKS, 40), device="cuda", dtype=torch.uint8)
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(BLOCKS)]
    items = [(h, b, hashes[b - 1] if b else None) for b, h in enumerate(hashes)]
    saver = BlockMover(views(kv, ik), TieredStore(None, DiskTier(tmp_path, 1 << 30, "warm-test")), "cuda",
                       max_run_blocks=BLOCKS)
    saver.save(items)
    saver.flush(wait=True)
    kv2, ik2 = torch.zeros_like(kv), torch.zeros_like(ik)
    fresh = BlockMover(views(kv2, ik2), TieredStore(None, DiskTier(tmp_path, 1 << 30, "warm-test")), "cuda",
                       max_run_blocks=BLOCKS)
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or "num_host_alloc" not in stats():
        pytest.skip("this torch reports no pinned-allocation counts")
    fresh.warm_pinned(runs=1)
    before = stats()["num_host_alloc"]
    pieces = fresh.fetch(hashes)
    assert [n for _, _, n in pieces] == [BLOCKS] and pieces[0][0]["kv"].is_pinned()
    assert stats()["num_host_alloc"] == before, "the disk read pinned new memory"
    order = list(range(BLOCKS))[::-1]  # other device blocks than the saved ones
    fresh.load(order, pieces)
    torch.cuda.synchronize()
    for b, src in enumerate(order):
        assert torch.equal(kv2[:, src * ROWS:(src + 1) * ROWS], kv[:, b * ROWS:(b + 1) * ROWS])
        assert torch.equal(ik2[src], ik[b])
