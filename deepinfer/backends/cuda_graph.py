"""CUDA graphs for decode: the model's one-token-per-row forward captured at start-up for every (batch,
context) bucket and replayed, so a decode step costs one graph launch instead of hundreds of kernel launches.

A bucket fixes the batch size (rows padded up to it; ``cuda_graph_sizes``) and the block-table width
(contexts padded up to a power-of-two number of blocks, so short contexts don't pay for the longest). The
graph reads the engine's persistent device block tables (and SWA cuts: core/block_tables.py) by state
slot, so a replay copies only each row's token, position and slot (one small host-to-device copy). Padded
rows use the tables' scratch row: they write their KV into a scratch block that belongs to no sequence and
attend only to it (a model with per-sequence state keeps a scratch row of it too); their outputs are
dropped. The graph ends at the final hidden states; the verify stage applies the LM head to the rows it
scores. All graphs share one memory pool.

Only models whose decode forward has no host sync can be captured (``model.supports_cuda_graphs``); the
forward stage falls back to the eager forward for the others, for mixed steps and for rows the buckets
don't cover.
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import AttnMetadata, resolve_future, to_device

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def _bucket(n: int, buckets) -> int:
    for b in buckets:
        if n <= b:
            return b
    return -1


def default_sizes(max_batch: int) -> tuple:
    return tuple(b for b in BATCH_BUCKETS if b <= max_batch) or (max_batch,)


class DecodeGraphs:
    def __init__(self, model, kv_cache, tables, block_size: int, device, batch_sizes):
        """tables: core.block_tables.BlockTables with a scratch row."""
        self.model, self.kv_cache, self.tables = model, kv_cache, tables
        self.block_size, self.device = block_size, torch.device(device)
        self.batch_buckets = tuple(sorted(set(batch_sizes)))
        nb, self.block_buckets = 1, []
        while nb < tables.max_blocks:
            self.block_buckets.append(nb)
            nb *= 2
        self.block_buckets.append(tables.max_blocks)
        self.graphs: dict = {}
        self.pool = None
        self.num_replays = 0

    def covers(self, batch: int, blocks: int) -> bool:
        return _bucket(batch, self.batch_buckets) > 0 and _bucket(blocks, self.block_buckets) > 0

    def capture_all(self, progress: bool = True) -> int:
        """Capture every bucket now (at engine start-up); returns the bytes the graphs' pool holds."""
        keys = [(b, nb) for b in self.batch_buckets for nb in self.block_buckets]
        before = torch.cuda.memory_allocated(self.device)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(keys), desc="capturing CUDA graphs", unit="graph", dynamic_ncols=True)
        for key in keys:
            if key not in self.graphs:
                self._capture(*key)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return torch.cuda.memory_allocated(self.device) - before

    def _capture(self, B: int, NB: int):
        bs, dev, tables = self.block_size, self.device, self.tables
        # Every tensor the graph reads must outlive it: a graph holds raw pointers, so a tensor freed after
        # capture (say, one only a closure referenced) would be reused by the allocator under the graph.
        st = {
            "ids": torch.zeros(B, dtype=torch.long, device=dev),
            "pos": torch.zeros(B, dtype=torch.long, device=dev),
            "rows": torch.full((B,), tables.scratch_row, dtype=torch.long, device=dev),
            "q_index": torch.arange(B, device=dev)[:, None],
            "q_valid": torch.ones(B, 1, dtype=torch.bool, device=dev),
            "kv_pos": torch.arange(NB * bs, device=dev),
            "cu_q": torch.arange(B + 1, dtype=torch.int32, device=dev),
        }

        def forward():
            bt = tables.table[st["rows"], :NB]  # [B, NB]
            pos, kv_pos = st["pos"], st["kv_pos"]
            slot = bt.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
            kv_slots = bt[:, kv_pos // bs] * bs + kv_pos % bs  # [B, NB * bs]
            meta = AttnMetadata(positions=pos, slot_mapping=slot, seq_lens=pos + 1, q_index=st["q_index"],
                                q_valid=st["q_valid"], kv_slots=kv_slots, q_pos=pos[:, None], block_table=bt,
                                block_size=bs, cu_q=st["cu_q"], max_q=1, num_decodes=B, state_rows=st["rows"],
                                replay_rows=tables.cuts[0, st["rows"]], swa_cut_rows=tables.cuts[1, st["rows"]])
            return self.model(st["ids"], meta, self.kv_cache)  # hidden [B, d]

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

    def run(self, ids: list, positions: list, slots: list, num_blocks: int, future=None) -> torch.Tensor:
        """One decode step for len(ids) rows whose sequences hold state ``slots`` (their block tables synced,
        at most ``num_blocks`` blocks each); returns the final hidden states [rows, d]. Negative ids are pending
        tokens, read from ``future`` on the device (overlap scheduling)."""
        n = len(ids)
        B, NB = _bucket(n, self.batch_buckets), _bucket(num_blocks, self.block_buckets)
        graph, st, out = self.graphs.get((B, NB)) or self._capture(B, NB)
        pad = B - n
        host = [list(ids) + [0] * pad, list(positions) + [0] * pad, list(slots) + [self.tables.scratch_row] * pad]
        dev = to_device(host, torch.long, self.device)
        st["ids"].copy_(resolve_future(dev[0], future) if min(ids) < 0 else dev[0])
        st["pos"].copy_(dev[1])
        st["rows"].copy_(dev[2])
        graph.replay()
        self.num_replays += 1
        return out[:n].clone()  # the static output is overwritten by the next replay


def capture_sizes(sizes: Optional[list], max_batch: int) -> tuple:
    """The batch sizes to capture: ``cuda_graph_sizes`` (capped at max_num_seqs) or the default buckets."""
    if sizes is None:
        return default_sizes(max_batch)
    return tuple(sorted({min(int(s), max_batch) for s in sizes}))
