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

Verify steps (speculative decoding: every row its last token and k_r drafted tokens, k_r in [0, K]) are
captured too, when ``enable_verify(K + 1)`` was called: a bucket (B, NB, Q) with Q = K + 1 gives every row
exactly Q query tokens, a row with fewer padded after its own (they write their KV into the scratch block and
their outputs are dropped; being after the row's real tokens, causal attention hides them from those). Every
row then looks to the attention kernels like a Q-token chunk ending at position start + Q, so a verify step
is one regular batch; ``verify_metadata`` builds its metadata on the device from four small tensors, and the
eager ragged forward (core/inputs.py) is its oracle (tests/test_verify_graphs.py).

Only models whose decode forward has no host sync can be captured (``model.supports_cuda_graphs``); the
forward stage falls back to the eager forward for the others, for mixed steps and for rows the buckets
don't cover.
"""

from __future__ import annotations

import gc
from typing import Optional

import torch

from .base import AttnMetadata, resolve_future, to_device

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Overlap scheduling hands a replay pending token references (-1 - i: the step in flight's i-th sampled token, in the
# engine's future buffer). Off: the host resolves them before the replay (resolve_future: four eager kernels and
# their host time a step). On: graphs captured after the engine set ``DecodeGraphs.future`` resolve them inside the
# graph from that buffer (the same formula, read at replay time in stream order, as the eager kernels read it); a
# replay handed another buffer resolves on the host as before. Off until timed on a GPU (benchmarks/profile_decode.py
# --knob backends.cuda_graph.RESOLVE_IN_GRAPH=1).
RESOLVE_IN_GRAPH = False


def _bucket(n: int, buckets) -> int:
    for b in buckets:
        if n <= b:
            return b
    return -1


def resolve_in_graph(ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """resolve_future's result from a graph's static ids and the engine's future buffer (flat), with no host step:
    references past the buffer read its last entry (the eager path raises there; a graph cannot)."""
    return torch.where(ids < 0, future[(-1 - ids).clamp(0, future.numel() - 1)], ids)


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
        self.graphs: dict = {}  # (B, NB) decode, (B, NB, Q) verify -> (graph, static inputs, static output)
        self.pool = None
        self.num_replays = 0
        self.last_key = None  # the (batch, blocks) buckets of the last decode replay (benchmarks/profile_decode.py)
        self.verify_width = 0  # Q of the verify graphs (K + 1); 0: verify steps run eagerly
        self.max_len = tables.max_blocks * block_size  # positions a padded verify token may reach
        self.num_verify_replays = 0
        self.hidden_width = 0  # with kept hidden states in the output: the hidden states' columns
        self.future = None  # the engine's future buffer (RESOLVE_IN_GRAPH), set before capture

    def enable_verify(self, width: int, max_len: int) -> None:
        """Capture verify steps of up to width - 1 drafts per row (padded to ``width`` tokens), for a model of
        max_len positions."""
        self.verify_width, self.max_len = int(width), int(max_len)

    def covers(self, batch: int, blocks: int) -> bool:
        return _bucket(batch, self.batch_buckets) > 0 and _bucket(blocks, self.block_buckets) > 0

    def covers_verify(self, nums: list, starts: list) -> bool:
        """Whether a verify step of rows computing nums[r] tokens from starts[r] has a bucket."""
        Q = self.verify_width
        if not Q or max(nums) > Q or max(starts) + Q > self.max_len:
            return False
        return self.covers(len(nums), self._verify_blocks(starts))

    def _verify_blocks(self, starts: list) -> int:
        """Blocks the longest row of a verify step spans: positions up to max(starts) + Q (its padding too)."""
        return -(-(max(starts) + self.verify_width) // self.block_size)

    def capture_all(self, progress: bool = True) -> int:
        """Capture every bucket now (at engine start-up); returns the bytes the graphs' pool holds."""
        keys = [(b, nb) for b in self.batch_buckets for nb in self.block_buckets]
        if self.verify_width:
            keys += [(b, nb, self.verify_width) for b, nb in keys]
        gc.collect()  # an earlier engine's graphs freed now, not during a capture (_record)
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

    def _capture(self, B: int, NB: int, Q: int = 1):
        if Q > 1:
            return self._capture_verify(B, NB, Q)
        bs, dev, tables = self.block_size, self.device, self.tables
        # Every tensor the graph reads must outlive it: a graph holds raw pointers, so a tensor freed after
        # capture (say, one only a closure referenced) would be reused by the allocator under the graph.
        inp = torch.zeros(3, B, dtype=torch.long, device=dev)  # ids, positions, state rows: one copy a replay
        inp[2].fill_(tables.scratch_row)
        st = {
            "in": inp, "ids": inp[0], "pos": inp[1], "rows": inp[2], "future": self._graph_future(),
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
            meta = AttnMetadata(positions=pos, slot_mapping=slot, seq_lens=pos + Q, q_index=st["q_index"],
                                q_valid=st["q_valid"], kv_slots=kv_slots, q_pos=pos[:, None], block_table=bt,
                                block_size=bs, cu_q=st["cu_q"], max_q=1, num_decodes=B, state_rows=st["rows"],
                                replay_rows=tables.cuts[0, st["rows"]], swa_cut_rows=tables.cuts[1, st["rows"]])
            return self.model(_graph_ids(st), meta, self.kv_cache)  # hidden [B, d]

        return self._record((B, NB), st, self._with_kept(forward))

    def _capture_verify(self, B: int, NB: int, Q: int):
        tables = self.tables
        st = verify_inputs(B, NB, Q, self.block_size, tables.scratch_row, self.device)
        st["future"] = self._graph_future()

        def forward():
            meta = verify_metadata(st, tables, self.block_size)
            return self.model(_graph_ids(st), meta, self.kv_cache)  # hidden [B * Q, d]

        return self._record((B, NB, Q), st, self._with_kept(forward))

    def _graph_future(self):
        """The flat future buffer a graph captured now resolves pending ids from, or None (RESOLVE_IN_GRAPH off, or
        no buffer set)."""
        return self.future.reshape(-1) if RESOLVE_IN_GRAPH and self.future is not None else None

    def _with_kept(self, forward):
        """forward, with the model's kept hidden states (``captured_hidden``: the last ``capture_last`` decoder
        layers', which a DSpark drafter reads) appended to its output's columns, so they are a static output of
        the graph too; ``_split`` takes them apart after a replay."""
        if not getattr(self.model, "capture_last", 0):
            return forward

        def both():
            h = forward()
            self.hidden_width = h.shape[-1]
            return torch.cat([h, self.model.captured_hidden], dim=-1)
        return both

    def _split(self, rows: torch.Tensor) -> torch.Tensor:
        """rows of a graph's output (a copy) -> the hidden states; the kept ones become model.captured_hidden."""
        d = self.hidden_width
        if not d or rows.shape[-1] == d:
            if getattr(self.model, "capture_last", 0):  # the drafter would read a context from an older step
                raise RuntimeError("CUDA graphs captured before the model was asked to keep hidden states "
                                   "(capture_last): capture after building the drafter")
            return rows
        self.model.captured_hidden = rows[:, d:]
        return rows[:, :d]

    def _record(self, key: tuple, st: dict, forward):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, out = capture_graph(forward, self.device, self.pool)  # (the warm-up writes only the scratch block)
        self.graphs[key] = (graph, st, out)
        return self.graphs[key]

    def run(self, ids: list, positions: list, slots: list, num_blocks: int, future=None) -> torch.Tensor:
        """One decode step for len(ids) rows whose sequences hold state ``slots`` (their block tables synced,
        at most ``num_blocks`` blocks each); returns the final hidden states [rows, d]. Negative ids are pending
        tokens, read from ``future`` on the device (overlap scheduling)."""
        n = len(ids)
        B, NB = _bucket(n, self.batch_buckets), _bucket(num_blocks, self.block_buckets)
        graph, st, out = self.graphs.get((B, NB)) or self._capture(B, NB)
        pad = B - n
        host = [list(ids) + [0] * pad, list(positions) + [0] * pad, list(slots) + [self.tables.scratch_row] * pad]
        dev = to_device(host, torch.long, self.device).view(3, B)
        if min(ids) < 0 and not _resolves(st, future, self.future):  # resolved by eager kernels before the replay
            st["ids"].copy_(resolve_future(dev[0], future))
            st["in"][1:].copy_(dev[1:])
        else:
            st["in"].copy_(dev)
        graph.replay()
        self.num_replays += 1
        self.last_key = (B, NB)
        return self._split(out[:n].clone())  # the static output is overwritten by the next replay

    def run_verify(self, ids: list, starts: list, slots: list, future=None) -> torch.Tensor:
        """One verify step: row r computes the len(ids[r]) tokens ids[r] from position starts[r] (its sequence
        holds state slot slots[r], block table synced). Returns the final hidden states of every real token,
        rows in order, [sum of lengths, d]: the eager forward's stream layout."""
        Q, n = self.verify_width, len(ids)
        B, NB = _bucket(n, self.batch_buckets), _bucket(self._verify_blocks(starts), self.block_buckets)
        graph, st, out = self.graphs.get((B, NB, Q)) or self._capture(B, NB, Q)
        keep = fill_verify(st, ids, starts, slots, self.tables.scratch_row, future,
                           in_graph=_resolves(st, future, self.future))
        graph.replay()
        self.num_replays += 1
        self.num_verify_replays += 1
        return self._split(out.index_select(0, keep))  # a copy: the next replay overwrites out


def capture_graph(forward, device, pool, warmup: bool = True, error_mode: str = "global") -> tuple:
    """(graph, output) of ``forward`` captured in a new CUDA graph in ``pool``, after one warm-up run on a side
    stream (allocator, lazy inits; ``warmup=False``: the caller has just run it eagerly, and a second run would
    repeat its side effects). No garbage collection inside the capture: collecting an unreachable engine
    destroys its graphs and events, CUDA calls a global-mode capture forbids (the capture fails, e.g. as a cuBLAS
    error mid-model). ``error_mode`` "thread_local" (a capture while serving): other threads' CUDA calls stay
    legal meanwhile."""
    if warmup:
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode):
            out = forward()
    finally:
        if enabled:
            gc.enable()
    return graph, out


def _resolves(st: dict, future, engine_future) -> bool:
    """Whether the graph of st resolves pending ids itself: it was captured with the engine's buffer, and this
    replay's references point into that buffer."""
    return st.get("future") is not None and future is not None and future is engine_future


def _graph_ids(st: dict) -> torch.Tensor:
    """A graph's input ids: the static ids, pending references resolved in the graph where it was captured so."""
    return st["ids"] if st.get("future") is None else resolve_in_graph(st["ids"], st["future"])


def fill_verify(st: dict, ids: list, starts: list, slots: list, scratch_row: int, future=None,
                in_graph: bool = False) -> torch.Tensor:
    """Write a verify step's rows into a graph's static inputs (st: verify_inputs; rows past len(ids) padded)
    with one host-to-device copy; returns the stream index [T] of every real token (rows in order). in_graph: the
    graph resolves pending references itself (RESOLVE_IN_GRAPH), so they are copied as they are."""
    B, Q = st["pos"].shape[0], st["j"].shape[0]
    pad = B - len(ids)
    flat, keep = [], []
    for r, row in enumerate(ids):
        flat.extend(row)
        flat.extend([0] * (Q - len(row)))
        keep.extend(range(r * Q, r * Q + len(row)))
    host = flat + [0] * (pad * Q) + list(starts) + [0] * pad + [len(r) for r in ids] + [0] * pad \
        + list(slots) + [scratch_row] * pad + keep
    dev = to_device(host, torch.long, st["pos"].device)
    tok, o = dev[:B * Q], B * Q
    st["ids"].copy_(resolve_future(tok, future) if min(flat) < 0 and not in_graph else tok)
    st["pos"].copy_(dev[o:o + B])
    st["nums"].copy_(dev[o + B:o + 2 * B])
    st["rows"].copy_(dev[o + 2 * B:o + 3 * B])
    return dev[o + 3 * B:]


def verify_inputs(B: int, NB: int, Q: int, block_size: int, scratch_row: int, device) -> dict:
    """The static tensors of a (B, NB, Q) verify graph: what a replay writes ("ids" [B*Q], "pos" [B] each row's
    first position, "nums" [B] its real tokens <= Q, "rows" [B] its state slot; padded rows: the scratch row
    and no real tokens) and constants (made before capture, so they outlive the graph that reads them)."""
    dev = torch.device(device)
    return {"ids": torch.zeros(B * Q, dtype=torch.long, device=dev),
            "pos": torch.zeros(B, dtype=torch.long, device=dev),
            "nums": torch.zeros(B, dtype=torch.long, device=dev),
            "rows": torch.full((B,), scratch_row, dtype=torch.long, device=dev),
            "j": torch.arange(Q, device=dev),
            "q_index": torch.arange(B * Q, device=dev).view(B, Q),
            "q_valid": torch.ones(B, Q, dtype=torch.bool, device=dev),
            "kv_pos": torch.arange(NB * block_size, device=dev),
            "cu_q": torch.arange(0, (B + 1) * Q, Q, dtype=torch.int32, device=dev)}


def verify_metadata(st: dict, tables, block_size: int) -> AttnMetadata:
    """The attention metadata of a padded verify batch (st: verify_inputs), on the device. Row r's Q queries
    sit at positions pos[r] .. pos[r] + Q - 1 (tokens r*Q .. r*Q + Q - 1 of the stream) and its context ends
    at pos[r] + Q; its real tokens write their KV into the row's blocks, the padding into the scratch block."""
    bs, pos, rows, j, kv_pos = block_size, st["pos"], st["rows"], st["j"], st["kv_pos"]
    Q, NB = j.shape[0], kv_pos.shape[0] // bs
    bt = tables.table[rows, :NB]  # [B, NB]
    q_pos = pos[:, None] + j  # [B, Q]
    real = j[None, :] < st["nums"][:, None]  # [B, Q]
    block = torch.where(real, bt.gather(1, (q_pos // bs).clamp(max=NB - 1)), tables.table[tables.scratch_row, 0])
    return AttnMetadata(positions=q_pos.reshape(-1), slot_mapping=(block * bs + q_pos % bs).reshape(-1),
                        seq_lens=pos + Q, q_index=st["q_index"], q_valid=st["q_valid"],
                        kv_slots=bt[:, kv_pos // bs] * bs + kv_pos % bs, q_pos=q_pos, block_table=bt,
                        block_size=bs, cu_q=st["cu_q"], max_q=Q, num_decodes=0, state_rows=rows,
                        replay_rows=tables.cuts[0, rows], swa_cut_rows=tables.cuts[1, rows], q_nums=st["nums"])


def capture_sizes(sizes: Optional[list], max_batch: int) -> tuple:
    """The batch sizes to capture: ``cuda_graph_sizes`` (capped at max_num_seqs) or the default buckets."""
    if sizes is None:
        return default_sizes(max_batch)
    return tuple(sorted({min(int(s), max_batch) for s in sizes}))
