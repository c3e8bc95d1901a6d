"""CED decode on the device alone: every row is one token that samples, and nothing is read on the host.

The host path (engine_path.Pass) lays a step out from the metadata's host lists. A decode step needs none
of them: each row queries its one position, its state slot (``meta.state_rows``) names its SWA ring and
compressor tail, its SWA cuts (``meta.replay_rows``: the decoder's replay start; ``meta.swa_cut_rows``: a
prefix hit's replay start, which cuts every layer) bound its windows, and its block table
(``meta.block_table``) places its entries. So the step is a fixed sequence of kernels over device tensors,
with no host synchronisation, and can be captured in a CUDA graph (backends/cuda_graph.py pads a bucket
with rows on the scratch slot; the cache keeps a scratch row of every per-sequence buffer for them).

Compression without branching on the host: each row's token goes to slot ``pos % m`` of its compressor
tail, then every row compresses its tail as group ``pos // m``. Only rows whose token completes the group
(``pos % m == m - 1``) produce a real entry; the others write a partial one into the slot of that same
entry, which no query sees (entry j is visible from position (j + 1) m - 1 on, the step that rewrites it
whole) and which lies in the row's own last block (a block holds whole groups), never a shared one.

A padded verify batch (backends/cuda_graph.py's verify graphs: ``meta.q_nums`` set) runs the same kernels
with Q = ``meta.max_q`` tokens a row: row r's tokens r Q .. r Q + Q - 1 at positions pos_r .. pos_r + Q - 1,
its first ``q_nums[r]`` real (its last token and its drafts), the rest padding. Each token's SWA key comes
fresh for the row's own positions and from the ring before them, as in the host path. Padding never writes
real state: its SWA ring, compressor-tail and encoder-output writes go to the scratch state slot, and an
entry is written to the row's cache row only by the real token that completes its group (the others, partial
or padding, write the scratch block's rows), so the caches end byte for byte as the eager ragged forward
leaves them. Writing the chunk's keys and tail inputs before attention is safe because Q - 1 drafts fit the
rings' and tails' speculative allowance (a write never lands on a slot a real query still reads).
"""

from __future__ import annotations

import contextlib

import torch

from . import engine_path
from .model import model_ops


class DecodePass(engine_path.Shared):
    """engine_path.Pass's contract for a decode step, from device tensors: query t is row t. What depends on
    the compression ratio alone (group members, entry rows, visibility) is built once per step and ratio and
    shared by that ratio's layers."""

    score = False

    def __init__(self, meta, cut: torch.Tensor, starts: list, cache, ops, like: "DecodePass" = None):
        """``like``: a pass of the same step (the encoder's, for the decoder's), whose per-token layout, the same
        for every pass of the step but for the cut, this one takes instead of building it again."""
        self.meta = meta
        self.ops = ops  # the model's backend ops (model_ops): the index plans and the compressor's cache writes
        self.n = meta.positions.shape[0]
        self.pos = meta.positions
        self.min_pos = min(starts) if starts else None  # host-known on the eager path only
        self._kept = {}
        self.Q = Q = max(1, meta.max_q)
        self.real = None  # [n] bool: the token is real (None: every token is, a decode step)
        if like is not None:
            for name in ("tok", "rows_t", "lstart_t", "lo_t", "real", "ring_slot"):
                setattr(self, name, getattr(like, name))
            self.cut_t = cut if meta.q_nums is None else cut[self.rows_t]
            return
        if meta.q_nums is None:  # decode: one token a row
            self.rows_t = torch.arange(self.n, device=self.pos.device)
            self.tok = self.lstart_t = self.rows_t
            self.lo_t, self.cut_t, self.ring_slot = self.pos, cut, meta.state_rows
            return
        if Q - 1 > cache.c.swa_allowance:
            raise ValueError(f"a padded verify batch of {Q} tokens a row exceeds the SWA rings' speculative "
                             f"allowance ({cache.c.swa_allowance} drafts)")
        self.tok = torch.arange(self.n, device=self.pos.device)
        self.rows_t = self.tok // Q  # each token's row
        self.lstart_t = self.rows_t * Q  # the row's first token in the stream
        self.lo_t = meta.q_pos[:, 0][self.rows_t]  # the row's first position: fresh keys from there on
        self.cut_t = cut[self.rows_t]
        self.real = self.tok - self.lstart_t < meta.q_nums[self.rows_t]
        # Reads and writes of per-sequence state: the row's slot, padding the scratch slot (the last one).
        self.ring_slot = torch.where(self.real, meta.state_rows[self.rows_t], cache.scratch_slot)

    def _plan(self, m: int, size: int, cache):
        """(tail slot of each token, tail slots of its group's members [n, m], its group's entry id and cache
        row): where every full layer of ratio m reads and writes (Ops.ced_compress_plan; in a padded verify batch
        only a real token completing its group writes the row's entry, the rest the scratch block)."""
        padded = self.real is not None
        return self._once(("compress", m, size), lambda: self.ops.ced_compress_plan(
            self.pos, self.meta.block_table, m, size, cache.block_size // m, rows=self.rows_t if padded else None,
            real=self.real, scratch_block=cache.scratch_block if padded else 0))

    def compress(self, model, layer, xs, cache) -> None:
        m, d = layer.m, xs.shape[-1]
        slots = self.ring_slot
        tail = cache.pending[layer.i] if m > 1 else None  # [S, m + allowance, d]: position p in slot p % size
        at, members, j, rows = self._plan(m, tail.shape[1] if m > 1 else 0, cache)
        if m > 1:
            tail[slots, at] = xs.to(tail.dtype)
            group = tail[slots[:, None], members].reshape(self.n * m, d)
        else:
            group = xs
        layer.entries_to_cache(group, j, rows, cache, self.ops)

    def entry_slots(self, m: int, cache) -> torch.Tensor:
        """[R, J] cache row of every entry id the block tables can hold (queries see only their visible ones;
        Ops.ced_block_slots)."""
        return self._once(("slots", m), lambda: self.ops.ced_block_slots(self.meta.block_table,
                                                                         cache.block_size // m))

    def swa_kv(self, layer, x, cache, ops, y=None):
        """The queries' SWA keys, written to the rings at once (one op with the norm, RoPE and quantisation):
        attention reads a query's own key from the fresh kv, never from the ring slot it takes (the ring
        holds more than the window). y: the projection W_kv x when the caller has it."""
        y = layer.swa_proj(x) if y is None else y
        return layer.swa_kv_rows(y, self.pos, cache.rings(False)[layer.i], self.ring_slot, ops)

    def write_ring(self, layer, kv, cache, ops) -> None:
        """Done by ``swa_kv``."""


def forward_decode(model, input_ids, meta, cache):
    """input_ids [B] (one token per row), meta with state_rows, replay_rows and block_table -> hidden [B, d];
    or a padded verify batch (meta.q_nums, max_q = Q): input_ids [B Q] -> hidden [B Q, d]. The layers' expert-load
    records are counted together at the end (ExpertLoad.batched: two kernels a step, not one a layer)."""
    load = getattr(model, "expert_load", None)
    with load.batched() if load is not None else contextlib.nullcontext():
        return _forward_decode(model, input_ids, meta, cache)


def _forward_decode(model, input_ids, meta, cache):
    c = model.config
    stats = model.counters
    starts = list(meta.starts)
    enc_cut = meta.swa_cut_rows if meta.swa_cut_rows is not None else torch.zeros_like(meta.positions)
    ops = model_ops(model)
    enc = DecodePass(meta, enc_cut, starts, cache, ops)
    dec = DecodePass(meta, meta.replay_rows, starts, cache, ops, like=enc)
    dec.share_rope_angles(enc, c)  # (both passes' queries are at meta.positions)
    h = model.embed(input_ids)
    ctx: dict = {}
    pending = None  # each layer's MoE output, added by the next layer's norm op (layer_engine's defer)
    for layer in model.layers[: c.num_encoder_layers]:
        h, pending = engine_path.layer_engine(model, layer, h, enc, None, cache, ctx, stats, pending, defer=True)
    h = h_enc = engine_path.finish(h, pending, model)
    if cache.henc is not None:  # an encoder-SWA pool snapshots these (core/swa_pool.py)
        cache.henc[enc.ring_slot, enc.pos % cache.henc.shape[1]] = h_enc.to(cache.henc.dtype)
    kept = []
    pending = None
    for layer in model.layers[c.num_encoder_layers:]:
        h, pending = engine_path.layer_engine(model, layer, h, dec, h_enc, cache, ctx, stats, pending, defer=True)
        if layer.i >= c.num_layers - getattr(model, "capture_last", 0):
            h, pending = engine_path.finish(h, pending, model), None
            kept.append(h)
    h = engine_path.finish(h, pending, model)
    if kept:  # the last capture_last decoder layers' outputs, per row (a DSpark drafter reads them)
        model.captured_hidden = torch.cat(kept, dim=-1)
    return h
