"""CUDA graphs for decode: capture the model's one-token-per-row forward once per (batch, context) bucket
and replay it, so a decode step costs one graph launch instead of hundreds of kernel launches.

A bucket fixes the batch size (rows padded up to it) and the block-table width (contexts padded up to a
power-of-two number of blocks, so short contexts don't pay for the longest). Padded rows write their KV
into a scratch block that belongs to no sequence and attend only to it; their logits are dropped.
Graphs are captured lazily, on the first step that needs a bucket, and share one memory pool.

Only models whose decode forward has no host sync can be captured (``model.supports_cuda_graphs``); the
forward stage falls back to the eager forward for the others, for mixed steps and for rows the buckets
don't cover. The graph ends at the final hidden states; the verify stage applies the LM head to the rows
it scores.
"""

from __future__ import annotations

import torch

from .base import AttnMetadata, resolve_future, to_device

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def _bucket(n: int, buckets) -> int:
    for b in buckets:
        if n <= b:
            return b
    return -1


class DecodeGraphs:
    def __init__(self, model, kv_cache, block_size: int, scratch_block: int, max_blocks: int, device,
                 max_batch: int = 256):
        self.model, self.kv_cache = model, kv_cache
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, torch.device(device)
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b <= max_batch) or (max_batch,)
        nb, self.block_buckets = 1, []
        while nb < max_blocks:
            self.block_buckets.append(nb)
            nb *= 2
        self.block_buckets.append(max_blocks)
        self.graphs: dict = {}
        self.pool = None
        self.num_replays = 0

    def covers(self, batch: int, blocks: int) -> bool:
        return _bucket(batch, self.batch_buckets) > 0 and _bucket(blocks, self.block_buckets) > 0

    def _capture(self, B: int, NB: int):
        bs, dev = self.block_size, self.device
        st = {
            "ids": torch.zeros(B, dtype=torch.long, device=dev),
            "pos": torch.zeros(B, dtype=torch.long, device=dev),
            "slot": torch.full((B,), self.scratch_block * bs, dtype=torch.long, device=dev),
            "lens": torch.ones(B, dtype=torch.long, device=dev),
            "bt": torch.full((B, NB), self.scratch_block, dtype=torch.long, device=dev),
        }
        # Every tensor the graph reads must outlive it: a graph holds raw pointers, so a tensor freed after
        # capture (say, one only a closure referenced) would be reused by the allocator under the graph.
        st["q_index"] = q_index = torch.arange(B, device=dev)[:, None]
        st["q_valid"] = q_valid = torch.ones(B, 1, dtype=torch.bool, device=dev)
        st["kv_pos"] = kv_pos = torch.arange(NB * bs, device=dev)

        def forward():
            kv_slots = st["bt"][:, kv_pos // bs] * bs + kv_pos % bs  # [B, NB * bs]
            meta = AttnMetadata(positions=st["pos"], slot_mapping=st["slot"], seq_lens=st["lens"], q_index=q_index,
                                q_valid=q_valid, kv_slots=kv_slots, q_pos=st["pos"][:, None], block_table=st["bt"],
                                block_size=bs)
            return self.model(st["ids"], meta, self.kv_cache)  # hidden [B, d]; the LM head runs eagerly after

        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()  # warm up (allocator, lazy inits) outside the capture; writes only the scratch block
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.graphs[(B, NB)] = (graph, st, out)
        return self.graphs[(B, NB)]

    def run(self, ids: list, positions: list, block_tables: list, future=None) -> torch.Tensor:
        """One decode step for len(ids) rows; returns the final hidden states [rows, d]. Negative ids are pending
        tokens, read from ``future`` on the device (overlap scheduling)."""
        n = len(ids)
        nb = max(len(t) for t in block_tables)
        B, NB = _bucket(n, self.batch_buckets), _bucket(nb, self.block_buckets)
        graph, st, out = self.graphs.get((B, NB)) or self._capture(B, NB)
        bs, pad = self.block_size, self.scratch_block
        bt = [(t + [pad] * NB)[:NB] for t in block_tables] + [[pad] * NB] * (B - n)
        slot = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions)] + [pad * bs] * (B - n)
        host = torch.tensor([list(ids) + [0] * (B - n), list(positions) + [0] * (B - n),
                             [p + 1 for p in positions] + [1] * (B - n), slot], dtype=torch.long)
        dev = to_device(host, torch.long, self.device)
        if min(ids) < 0:
            st["ids"].copy_(resolve_future(dev[0], future))
        else:
            st["ids"].copy_(dev[0])
        st["pos"].copy_(dev[1])
        st["lens"].copy_(dev[2])
        st["slot"].copy_(dev[3])
        st["bt"].copy_(to_device(bt, torch.long, self.device))
        graph.replay()
        self.num_replays += 1
        return out[:n].clone()  # the static output is overwritten by the next replay
