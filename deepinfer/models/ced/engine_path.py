"""The CED engine path: ragged rows of many sequences over the paged FP4 global KV and the FP8 SWA rings.

Per row (a sequence computing positions [a, b) this step, replay start s):
- the encoder runs over every token of the chunk;
- every full layer compresses the groups that complete in the chunk (with the tail left over from the
  previous chunk) and writes them to the paged cache before attention (visibility does the causality);
- the decoder runs only over positions >= s, with its SWA cut at s (bounded replay; s = 0 is exact).
  The decoder's full layer still compresses every chunk token from the final encoder state. A row whose
  encoder window state was just restored from the encoder-SWA pool (``meta.enc_restored``; core/swa_pool.py)
  starts its decoder at s even before its chunk: those positions' encoder outputs come from the cache's
  ``henc`` (the snapshot's), the rest from this step's encoder;
- a row whose replay start is a ``ReplayStart`` (a request that scores its prompt) then runs the decoder a
  second time, over its chunk's positions < score_end with no cut and its own scoring rings: exact replay's
  logits for prompt logprobs, without touching the state it generates from.
Queries take their SWA keys from this chunk's fresh KV and, for older positions, from the ring.

A decoder reindex layer scores only its full layer's candidate pool (``model.pool_impl`` "gather": each
query's pool as entry ids, passed to the indexer op as ``candidates``), or, as the slow twin ("mask"), every
entry masked by the pool. Indexer calls go in chunks of queries so no [queries, entries] score matrix
exceeds INDEX_CHUNK elements.

Attention (window + selected entries + sink), the indexer's scores and top-K, and the caches' quantisation
go through the model's ops (``ced_sparse_attention``, ``ced_indexer_topk``, ``quantize_kv``), which read the
low-bit caches in place: the reference ops dequantize what they read, kernels dequantize in registers.
"""

from __future__ import annotations

import numpy as np
import torch

from ...backends.base import to_device
from ...staging import staged_copy
from . import functional as fn
from .model import model_ops


# finish adds the last layer's deferred MoE output in one launch where the ops offer it (Ops.ced_add); False: the
# torch adds, for A/B runs (the same bits).
FINISH_ONE_LAUNCH = True
# forward_engine lays the compression plans out (_plan_step) once the SWA-only layers before the first full layer are
# queued, so the device runs them while the host plans (False: before the first layer, for A/B runs).
PLAN_AFTER_SWA = True


def _on_device(lists: list, device) -> list:
    """Host int lists (or numpy arrays) on the device in one copy: [tensor] views of one int64 buffer, one per list."""
    arrays = [_ints(lst) for lst in lists]
    buf = staged_copy(arrays, device)  # (joined into reused pinned memory on CUDA)
    out, a = [], 0
    for arr in arrays:
        out.append(buf[a:a + arr.size])
        a += arr.size
    return out


def _segments(counts) -> tuple:
    """Rows of the given lengths laid end to end: (each element's row, its index within its row), numpy int64.
    The host layouts below are built from these, so a 16K-token prefill costs numpy calls, not 16K Python steps
    (the 15th session's profile: ~50 ms of Python per 16K prefill with the device idle)."""
    counts = np.asarray(counts, dtype=np.int64)
    rows = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    return rows, np.arange(rows.size, dtype=np.int64) - (np.cumsum(counts) - counts)[rows]


def _ints(xs) -> np.ndarray:
    """A host int list (or range, or numpy array) as a flat numpy int64 array."""
    return np.asarray(xs, dtype=np.int64).reshape(-1)


class Upload:
    """The step's host index lists on the device in few host-to-device copies. While forward_engine lays the
    step out (its passes, every compression ratio's plan, the entry rows), each piece ``add``s its lists; a
    ``get`` copies every list added since the last copy at once (one pinned int64 buffer, ``_on_device``) and
    hands out [len] views. forward_engine lays the passes out first and the compression plans once the SWA-only
    layers it starts with are queued (``_plan_step``), so a prefill takes two copies and the device has work while
    the host plans."""

    def __init__(self, device):
        self.device, self.lists, self.views = device, [], []

    def add(self, *lists) -> int:
        """Register lists; returns the index of the first (the others follow it)."""
        self.lists += lists
        return len(self.lists) - len(lists)

    def get(self, i: int) -> torch.Tensor:
        if i >= len(self.views):  # every list added since the last copy, in one copy
            self.views += _on_device(self.lists[len(self.views):], self.device)
        return self.views[i]


class _Uploaded:
    """Device attributes served by the step's Upload on first read: ``_dev`` maps each to its list index."""

    _up: Upload
    _dev: dict

    def __getattr__(self, name):
        dev = self.__dict__.get("_dev")
        if dev is None or name not in dev:
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        t = self._up.get(dev[name])
        setattr(self, name, t)
        return t

    def _register(self, up: Upload, named: dict) -> None:
        first = up.add(*named.values())
        self._up, self._dev = up, {k: first + i for i, k in enumerate(named)}


def _rope_key(c) -> tuple:
    """Where a pass keeps its rope_angles."""
    return ("rope", c.rope_dim, c.rope_theta)


class Shared:
    """What every layer of a pass (``pos`` [n] its queries' positions) reads alike, built on the first layer's
    call and kept for the step (``_kept``): a layer adds no host loop over rows and no host-to-device copy."""

    _kept: dict
    real = None  # [n] bool, a padded verify batch's real queries (decode_path.DecodePass); None: all are

    def _once(self, key, build):
        if key not in self._kept:
            self._kept[key] = build()
        return self._kept[key]

    def visible(self, m: int) -> torch.Tensor:
        """[n] entries of ratio m each query sees: entry j is visible from position (j + 1) m - 1 on."""
        return self._once(("visible", m), lambda: self.pos + 1 if m == 1 else (self.pos + 1) // m)

    def rope_angles(self, c):
        """(cos, sin) [n, R/2] float32 of the queries' rotary angles (functional.rope_cos_sin), once per pass:
        every layer's attention rotates its output back by them."""
        return self._once(_rope_key(c), lambda: fn.rope_cos_sin(self.pos, c.rope_dim, c.rope_theta))

    def share_rope_angles(self, other: "Shared", c) -> None:
        """Take ``other``'s rope_angles: a pass over the same positions (a decode step's encoder and decoder)."""
        self._kept[_rope_key(c)] = other.rope_angles(c)

    def no_entries(self) -> torch.Tensor:
        """[n, 0]: a swa layer's selected entries."""
        return self._once("no_entries", lambda: torch.zeros(self.pos.shape[0], 0, dtype=torch.long,
                                                            device=self.pos.device))


class Pass(_Uploaded, Shared):
    """One part of the step (encoder, decoder, or the decoder's prompt-scoring pass): which tokens query,
    where their SWA keys live (``score``: the scoring rings) and where their window is cut. Built from the
    metadata's host lists, whose device copies come with the step's one copy (``up``, an Upload; without one
    the pass copies its own); decode_path.DecodePass is the same contract on the device alone. The queries
    that write the rings and each ratio's entry rows are built once (``Shared``); so is each ratio's
    compression plan, in ``meta.cache`` (``_compress_chunk``).

    ``ring`` (the pass's rings' slots, and the scratch state slot where the rings have one): each row's last
    that-many queries (``last_queries``) and every query's ring write slot (``ring_dst``: its own ring slot
    for those, the scratch slot for the rest) come with the same copy."""

    def __init__(self, meta, lo: list, hi: list, device, cut: list, score: bool = False, up: Upload = None,
                 ring: tuple = None):
        self.meta, self.device = meta, device
        self.lo, self.cut, self.score = lo, cut, score  # [R] first queried position, SWA cut
        lo_a, cut_a, slots = _ints(lo), _ints(cut), _ints(meta.state_slots)
        starts, nums = _ints(meta.starts), _ints(meta.nums)
        q = np.maximum(0, _ints(hi) - lo_a)  # row r queries positions lo[r] .. lo[r] + q[r] - 1
        rows, local = _segments(q)
        lstart = np.cumsum(q) - q
        self.lstart = lstart.tolist()  # [R] offset of the row's first query in this pass
        self._q, self._rows, self._local = q, rows, local  # (host: each row's last queries, ``_last``)
        self.n = n = int(rows.size)
        pos = lo_a[rows] + local
        self.min_pos = int(pos.min()) if n else None  # host-known: counting it needs no device read
        # Index of each query among the step's T tokens (-1: a position before the row's chunk, whose input
        # the caller supplies: a restored row's decoder, see ``early``).
        first = (np.cumsum(nums) - nums)[rows]  # the row's first token among the step's
        tok = np.where(pos >= starts[rows], first + pos - starts[rows], -1)
        early = np.flatnonzero(tok < 0)
        # Per query: its row, position, token, replay cut, first fresh position, offset of that position's row,
        # and ring (state slot); copied with the step's other lists.
        named = dict(rows_t=rows, pos=pos, tok=tok, cut_t=cut_a[rows], lo_t=lo_a[rows], lstart_t=lstart[rows],
                     ring_slot=slots[rows])
        if early.size:  # [E], [n - E] queries before / inside their row's chunk (None when E = 0)
            named.update(early=early, late=np.flatnonzero(tok >= 0))
        else:
            self.early = self.late = None
        self.ring_size = self.scratch = None
        if ring is not None:
            self.ring_size, self.scratch = ring
            keep = self._last(self.ring_size)
            self.has_last = bool(keep.size)
            named.update(keep=keep, keep_slot=slots[rows[keep]], keep_pos=pos[keep])
            if self.scratch is not None:
                dst = np.full(n, self.scratch, dtype=np.int64)
                dst[keep] = slots[rows[keep]]
                named["ring_dst"] = dst
        self._register(up if up is not None else Upload(device), named)
        self._kept = {}

    def _last(self, size: int) -> np.ndarray:
        """Each row's last ``size`` queries (indices into the pass, ascending)."""
        return np.flatnonzero(self._local >= self._q[self._rows] - size)

    def last_queries(self, size: int):
        """(queries, their state slots, their positions): each row's last ``size`` queries, or None."""
        if size == self.ring_size:  # (copied with the step)
            return (self.keep, self.keep_slot, self.keep_pos) if self.has_last else None
        return self._once(("last", size), lambda: _last_queries(self, size, self.device))

    def compress(self, model, layer, xs, cache) -> None:
        _compress_chunk(model, layer, xs, self.meta, cache, self.device)

    def entry_slots(self, m: int, cache) -> torch.Tensor:
        return _row_slots(m, cache, self.meta, self.device)

    def _fused_swa(self, layer, x, ops) -> bool:
        """The SWA key as one op (``Ops.ced_swa_kv``, decode_path's): on CUDA (where the ops' kernels run), for
        the generation rings (they have a scratch slot), and not in batch-invariant mode (the fused CED ops then
        run the composition, which layer.swa_kv runs cheaper here)."""
        return "ring_dst" in self._dev and layer._kernels(x) is not None and not getattr(ops, "batch_invariant",
                                                                                         False)

    def swa_kv(self, layer, x, cache, ops, y=None):
        """The queries' SWA keys [n, D] (written to the rings by ``write_ring``, after attention: a chunk longer
        than the rings' allowance would overwrite keys its first queries still read). Fused (``_fused_swa``):
        one kernel from the projection y, its ring write sent to the scratch slot; ``write_ring`` runs it
        again on y with the real slots, so the ring holds the codes of the very keys attention read. y: the
        projection W_kv x when the caller has it."""
        if not self._fused_swa(layer, x, ops):
            return layer.swa_kv(x, self.pos, y=y)
        if y is None:
            y = layer.swa_proj(x)  # [n, D]
        self._kept[("swa_y", layer.i)] = y
        return layer.swa_kv_rows(y, self.pos, cache.rings(self.score)[layer.i], self.scratch_slots(), ops)

    def scratch_slots(self) -> torch.Tensor:
        """[n] the scratch state slot: where each query's ring write before attention goes."""
        return self._once("scratch", lambda: torch.full((self.n,), self.scratch, dtype=torch.long,
                                                        device=self.device))

    def write_ring(self, layer, kv, cache, ops) -> None:
        y = self._kept.pop(("swa_y", layer.i), None)
        if y is not None:  # each row's last ring-many queries to their rings, the rest to the scratch slot
            layer.swa_kv_rows(y, self.pos, cache.rings(self.score)[layer.i], self.ring_dst, ops)
            return
        last = self.last_queries(cache.rings(self.score)[layer.i][0].shape[1])
        if last is not None:
            idx, slots, pos = last
            cache.ring_write(layer.i, slots, pos, kv[idx], quantize=ops.quantize_kv, score=self.score)


def _last_queries(P: Pass, size: int, device):
    """(queries, their state slots, their positions): each row's last ``size`` queries of pass P, or None
    when there is none (a size the step's copy did not hold: a copy of its own)."""
    keep = P._last(size)
    if not keep.size:
        return None
    idx = to_device(torch.from_numpy(keep), torch.long, device)
    return idx, P.ring_slot[idx], P.pos[idx]


def _keep_encoder_outputs(enc: Pass, h_enc, cache) -> None:
    """Each row's last ring-many final encoder outputs into the cache's ``henc`` (an encoder-SWA pool keeps them)."""
    size = cache.henc.shape[1]
    last = enc.last_queries(size)
    if last is not None:
        idx, slots, pos = last
        cache.henc[slots, pos % size] = h_enc[enc.tok[idx]].to(cache.henc.dtype)


class _Lists(_Uploaded):
    """Named host lists of the step, on the device with its one copy (``Upload``)."""

    def __init__(self, up: Upload, **named):
        self._register(up, named)


def _block_table(meta, device) -> torch.Tensor:
    """[R, NB] the rows' block ids on the device: the metadata's, or padded from its host lists (with the
    step's copy where the layout registered them, ``_plan_step``)."""
    if meta.block_table is not None:
        return meta.block_table
    if "ced_block_table" not in meta.cache:
        _register_block_table(meta, Upload(device))
    nb, lists = meta.cache["ced_block_table"]
    return lists.bt.view(-1, nb)


def _register_block_table(meta, up: Upload) -> None:
    nb = max([len(t) for t in meta.block_tables] + [1])
    flat = np.zeros((len(meta.block_tables), nb), dtype=np.int64)
    for r, t in enumerate(meta.block_tables):
        flat[r, :len(t)] = t
    meta.cache["ced_block_table"] = (nb, _Lists(up, bt=flat.reshape(-1)))


class _Compression(_Uploaded):
    """Where every full layer of ratio m reads and writes in this step (no layer changes it, so the step builds
    it once): the groups completing in the step, each row's taken from its compressor tail (the pending
    inputs of its last incomplete group, ``size`` slots) followed by its chunk; the entries' ids and cache
    rows; the tail slots the chunk's last tokens go to. A prefix hit's shared blocks are never rewritten
    (``write_floors``). Per layer: one gather of the groups, the projections and one ``ced_compress_write`` per
    kind (``CEDLayer.entries_to_cache``, decode_path's: one kernel each on the nvidia backend), one tail write,
    whatever the number of rows. Its index lists come with the step's one copy (``up``)."""

    def __init__(self, meta, m: int, size: int, cache, device, up: Upload = None):
        self.m, self.device, self.block_size, self.meta = m, device, cache.block_size, meta
        starts, nums, slots = _ints(meta.starts), _ints(meta.nums), _ints(meta.state_slots)
        floors = _ints(meta.write_floors) if meta.write_floors else np.zeros_like(starts)
        ends, first = starts + nums, np.cumsum(nums) - nums  # first: the row's first token among xs
        # Pending rows read (m > 1): each row's a % m inputs of its last incomplete group, from its tail.
        pend = starts % m if m > 1 else np.zeros_like(starts)
        t_rows, t_local = _segments(pend)
        tail_slot, tail_pos = slots[t_rows], (starts - pend)[t_rows] + t_local
        tail_pos = tail_pos % size if m > 1 else tail_pos
        tail_at, n_tail = np.cumsum(pend) - pend, int(pend.sum())
        # Per compressed token: its row in [tails; xs]; per entry: its id and row. A prefix hit's shared blocks'
        # entries are skipped (write_floors).
        j0, j1 = starts // m, ends // m  # the row's tokens from j0 * m on: its tail, then its chunk
        skip = np.minimum(np.maximum(0, floors // m - j0), j1 - j0)
        per_row = j1 - j0 - skip
        s_rows, s_local = _segments(per_row * m)
        i = skip[s_rows] * m + s_local
        src = np.where(i < pend[s_rows], tail_at[s_rows] + i, n_tail + first[s_rows] + i - pend[s_rows])
        e_rows, e_local = _segments(per_row)
        ids, id_rows = (j0 + skip)[e_rows] + e_local, e_rows
        # Tail slots written (m > 1) from rows of xs: the chunk's last tokens, complete groups' too (a rejected
        # draft may roll back into them).
        if m > 1:
            k_from = np.maximum(starts, ends - size)
            k_rows, k_local = _segments(ends - k_from)
            kp = k_from[k_rows] + k_local
            keep_slot, keep_pos, keep_src = slots[k_rows], kp % size, first[k_rows] + kp - starts[k_rows]
        else:
            keep_slot = keep_pos = keep_src = np.zeros(0, dtype=np.int64)
        T = int(nums.sum())
        self.identity = n_tail == 0 and src.size == T and bool((src == np.arange(T)).all())  # the groups are xs
        self.n_tail, self.n_entries, self.n_keep = n_tail, len(ids), len(keep_slot)
        self._register(up if up is not None else Upload(device),
                       dict(tail_slot=tail_slot, tail_pos=tail_pos, src=src, ids=ids, id_rows=id_rows,
                            keep_slot=keep_slot, keep_pos=keep_pos, keep_src=keep_src))
        self._rows = None

    def rows(self) -> torch.Tensor:
        """[n_entries] each entry's cache row: its block (from the row's block table) and its place in it."""
        if self._rows is None:
            per = self.block_size // self.m
            self._rows = _block_table(self.meta, self.device)[self.id_rows, self.ids // per] * per + self.ids % per
        return self._rows

    def run(self, model, layer, xs, cache) -> None:
        """xs [T, d]: the normed input of all the step's tokens."""
        store = cache.pending.get(layer.i) if self.m > 1 else None  # [S, slots, d]: position p in slot p % slots
        if self.n_entries:
            src = xs
            if self.n_tail:
                src = torch.cat([store[self.tail_slot, self.tail_pos], xs], dim=0)
            layer.entries_to_cache(src if self.identity else src[self.src], self.ids, self.rows(), cache,
                                   model_ops(model))
        if self.n_keep:  # (after the tails were read: a row's kept tokens may take its old tail's slots)
            store[self.keep_slot, self.keep_pos] = xs[self.keep_src].to(store.dtype)


def _compress_chunk(model, layer, xs, meta, cache, device):
    """Compress the groups completing in this step for every row; xs [T, d] normed input of all tokens. The
    plan is the step's (``meta.cache``, laid out by ``_plan_step``): every full layer of the same ratio shares it."""
    size = cache.pending[layer.i].shape[1] if layer.m > 1 else 0
    key = ("ced_compression", layer.m, size, cache.block_size)
    if key not in meta.cache:
        meta.cache[key] = _Compression(meta, layer.m, size, cache, device)
    meta.cache[key].run(model, layer, xs, cache)


class _RowSlots(_Uploaded):
    """Cache rows of every row's entries of ratio m complete after this step: [R, Jmax] int64 (a row's ids
    past its own count repeat its last entry's row; queries never see them). One per step and ratio: every
    pass and layer of that ratio reads it."""

    def __init__(self, meta, m: int, cache, device, up: Upload = None):
        self.meta, self.m, self.per, self.device = meta, m, cache.block_size // m, device
        J = [(a + k) // m for a, k in zip(meta.starts, meta.nums)]
        self.jmax = max(J) if J else None
        if J:
            self._register(up if up is not None else Upload(device), dict(last=[max(j - 1, 0) for j in J]))
        self._slots = None

    def slots(self) -> torch.Tensor:
        if self._slots is None:
            if self.jmax is None:
                self._slots = torch.zeros(0, 0, dtype=torch.long, device=self.device)
            else:
                jj = torch.minimum(torch.arange(self.jmax, device=self.device)[None, :], self.last[:, None])
                self._slots = _block_table(self.meta, self.device).gather(1, jj // self.per) * self.per \
                    + jj % self.per
        return self._slots


def _row_slots(m, cache, meta, device):
    """The step's ``_RowSlots`` of ratio m (laid out by ``_plan_step``), its [R, Jmax] cache rows."""
    key = ("ced_row_slots", m, cache.block_size)
    if key not in meta.cache:
        meta.cache[key] = _RowSlots(meta, m, cache, device)
    return meta.cache[key].slots()


def _plan_step(model, meta, cache, device, up: Upload) -> None:
    """Lay out what the step's full layers read alike, before any layer runs, so its index lists join the
    step's one copy: every (ratio, tail size)'s compression plan, every ratio's entry rows, and the block table
    where the metadata has none on the device."""
    if meta.block_table is None and "ced_block_table" not in meta.cache:
        _register_block_table(meta, up)
    for layer in model.layers:
        if layer.mode != "full":
            continue
        m = layer.m
        size = cache.pending[layer.i].shape[1] if m > 1 else 0
        key = ("ced_compression", m, size, cache.block_size)
        if key not in meta.cache:
            meta.cache[key] = _Compression(meta, m, size, cache, device, up)
        key = ("ced_row_slots", m, cache.block_size)
        if key not in meta.cache:
            meta.cache[key] = _RowSlots(meta, m, cache, device, up)


INDEX_CHUNK = 1 << 24  # most (query, entry) scores one indexer call computes; longer passes go in chunks


def _choose_entries(model, ops, layer, iq, iw, keys, slots, P: Pass, num_visible, ctx, stats):
    """CEDLayer.choose_entries through the indexer op, in chunks of queries: a decoder reindex layer scores
    only its full layer's candidate pool (or, pool_impl "mask", every entry masked by it); a decoder full layer
    builds that pool from its own scores."""
    c = layer.c
    pool = ctx[("pool", c.source_full(layer.i))] if layer.is_decoder and layer.mode == "reindex" else None
    gather = model.pool_impl == "gather"
    builds_pool = layer.is_decoder and layer.mode == "full"
    width = pool.shape[1] if pool is not None and gather else slots.shape[1]  # entries scored per query
    step = max(1, INDEX_CHUNK // max(1, width))
    tops, pools = [], []
    for a in range(0, max(P.n, 1), step):
        sl = slice(a, a + step)
        if pool is None:
            narrow = {}
        else:
            narrow = {"candidates": pool[sl]} if gather else {"allowed": pool[sl]}
        topk, scores = ops.ced_indexer_topk(iq[sl], iw[sl], keys, c.index_k_format, slots, P.rows_t[sl],
                                            num_visible[sl], c.index_topk, return_scores=builds_pool, **narrow)
        tops.append(topk)
        if builds_pool and gather:  # (one fused op on the nvidia backend)
            pools.append(ops.ced_pool_candidates(scores, num_visible[sl], c.pool_block, c.pool_blocks))
        elif builds_pool:
            visible = torch.arange(slots.shape[1], device=iq.device)[None, :] < num_visible[sl][:, None]
            pools.append(fn.pool_mask(scores, visible, c.pool_block, c.pool_blocks))
    topk = tops[0] if len(tops) == 1 else torch.cat(tops)
    if builds_pool:
        ctx[("pool", layer.i)] = pools[0] if len(pools) == 1 else torch.cat(pools)
    ctx[("topk", layer.i)] = topk
    stats["index_scores"][layer.i] += P.n * width
    return topk


def layer_engine(model, layer, h, P: Pass, src, cache, ctx, stats, pending=None, defer: bool = False):
    """h [Tq, d] hidden of this pass's queries; src [T, d] hidden of all step tokens (full-layer input).

    ``defer``: return (h, pending) with the MoE's output (routed, shared or None) not yet added; the next layer
    takes it as ``pending`` and adds it with its norm in one op (``finish`` adds the last one), so a decode
    step's residual adds ride on the norms' kernels."""
    c = model.config
    kernels = layer._kernels(h)  # the fused rms on CUDA
    if pending is None:
        x = fn.rms(h, layer.attn_norm, c.rms_norm_eps, ops=kernels)
    else:
        h, x = fn.add_rms(h, pending[0], layer.attn_norm, c.rms_norm_eps, ops=kernels, extra=pending[1])
    stats["layer_tokens"][layer.i] += P.n
    if P.score:
        stats["score_tokens"][layer.i] += P.n
    if P.min_pos is not None:
        stats["min_pos"][layer.i] = min(stats["min_pos"][layer.i], P.min_pos)
    ops = model_ops(model)
    qa, y, iw_raw = layer.project_input(x) or (None, None, None)  # one product where the weights are joined
    q, cq = layer.query(x, P.pos, qa=qa, need_cq=layer.mode in ("full", "reindex"))  # (cq: the indexer's)
    kv = P.swa_kv(layer, x, cache, ops, y=y)
    entries, sel, table = None, P.no_entries(), None  # swa layers: no global branch
    if layer.mode != "swa":
        m = layer.m
        src_l = c.source_full(layer.i)
        if layer.mode == "full" and ("kv", layer.i) not in ctx:  # (the scoring pass reads what was written)
            compress_full(model, layer, P, src, x, cache, ctx)
        slots = ctx[("kv", src_l)]  # [R, Jmax] cache rows of each row's entries
        if layer.mode in ("full", "reindex"):
            stats["indexer_calls"][layer.i] += 1
            iq, iw = layer.index_query(x, cq, iw=iw_raw)
            topk = _choose_entries(model, ops, layer, iq, iw, cache.ik[src_l], slots, P, P.visible(m), ctx, stats)
        else:
            topk = ctx[("topk", c.source_topk(layer.i))]
        # A reuse layer reads the cache rows its top-K layer looked up (same top-K, same full layer's slots).
        # The full layer's entries decoded once for this pass's queries, where the backend finds that pays
        # (Ops.ced_entry_table): then its rows and index stand in for the cache and slots, with the same values.
        tab_key = ("table", src_l)
        if tab_key not in ctx:
            reads = P.n * min(topk.shape[1], slots.shape[1])  # (at most J of a query's K ids are valid)
            ctx[tab_key] = ops.ced_entry_table(cache.kv[src_l], c.global_kv_format, slots, reads, q.dtype) \
                if reads else None
        table = ctx[tab_key]
        sel_key = ("sel", layer.i if layer.mode in ("full", "reindex") else c.source_topk(layer.i))
        sel = ctx.get(sel_key)
        if sel is None:
            if P.n and slots.shape[1]:  # [Tq, K] cache (or table) rows
                sel = ops.ced_entry_rows(slots if table is None else table[1], P.rows_t, topk)
            else:  # no query, or no complete entry yet in any row (topk is all -1)
                sel = torch.full_like(topk, -1)
            ctx[sel_key] = sel
        entries = cache.kv[src_l] if table is None else (table[0], None)
    if P.n:
        o = ops.ced_sparse_attention(q, kv, cache.rings(P.score)[layer.i], entries, sel, pos=P.pos, cut=P.cut_t,
                                     fresh_lo=P.lo_t, fresh_start=P.lstart_t, ring_slot=P.ring_slot,
                                     window=c.n_win, ring_fmt=c.swa_kv_format,
                                     entry_fmt=c.global_kv_format if table is None else "bf16",
                                     sinks=layer.sink, scale=c.head_dim ** -0.5,
                                     unrope=P.rope_angles(c))  # (out_proj's inverse RoPE, in the op)
        h, xf = layer.out_proj_add_rms(o, P.pos, h, unrotated=True)
        routed, shared, ids = layer.moe_parts(xf, pairs=True)  # (the routed rows may be left for add_rms to add)
        # (a padded verify batch's padding is routed too, but is no load)
        model.record_expert_load(layer.i, ids, *(() if P.real is None else (P.real,)))
        pending = (routed, shared)
    elif getattr(layer, "moe_is_collective", False):  # expert-parallel ranks all join every layer's exchange
        layer.moe(h)
        pending = None
    else:
        pending = None
    P.write_ring(layer, kv, cache, ops)
    return (h, pending) if defer else finish(h, pending, model)


def compress_full(model, layer, P, src, x, cache, ctx) -> None:
    """A full layer's compression of every step token (``src``, the pass's full-layer input, normed; the encoder's
    is its own x) into the paged cache, and its entries' cache rows in ``ctx``. A decoder's reads only the final
    encoder state, so pass_graphs.py runs it before the decoder's layers."""
    xs = x if src is None else fn.rms(src, layer.attn_norm, model.config.rms_norm_eps, ops=layer._kernels(src))
    P.compress(model, layer, xs, cache)
    ctx[("kv", layer.i)] = P.entry_slots(layer.m, cache)


def decoder_layers(model, h, P, h_enc, cache, ctx, stats) -> tuple:
    """The decoder's layers over pass P's queries, h [n, d] their inputs -> (outputs [n, d], the last
    capture_last layers' outputs: a DSpark drafter reads them)."""
    c = model.config
    kept, pending = [], None
    for layer in model.layers[c.num_encoder_layers:]:
        h, pending = layer_engine(model, layer, h, P, h_enc, cache, ctx, stats, pending, defer=True)
        if layer.i >= c.num_layers - getattr(model, "capture_last", 0):
            h, pending = finish(h, pending, model), None
            kept.append(h)
    return finish(h, pending, model), kept


def finish(h, pending, model):
    """h plus a deferred MoE output (``layer_engine``'s pending), added as the MoE then the residual add it: one
    kernel where the model's ops offer it on h's device (fn.add_moe; CEDLayer._kernels, as every layer's ops)."""
    if pending is None:
        return h
    kernels = model.layers[0]._kernels(h) if FINISH_ONE_LAUNCH else None
    return fn.add_moe(h, pending[0], kernels, extra=pending[1])


def _rings(cache, score: bool):
    """(slots per ring, scratch state slot or None) of the generation (or scoring) rings, or None if there are none."""
    rings = cache.rings(score)
    if not rings:
        return None
    codes = next(iter(rings.values()))[0]
    return codes.shape[1], (None if score else cache.scratch_slot)


def forward_engine(model, input_ids, meta, cache):
    """input_ids [T] the step's tokens (rows' chunks in order) -> hidden [T, d]. The step's index lists reach
    the device in two host-to-device copies (``Upload``): the passes' before the first layer, the compression
    plans and entry rows' (``_plan_step``) once the SWA-only layers before the first full one are queued; each
    layer's MoE output rides on the next layer's norm (``layer_engine``'s defer), as in a decode step."""
    c = model.config
    device = input_ids.device
    stats = model.counters
    scoring = meta.cache.get("score_pass", False)  # data-parallel attention: another rank's row scores its prompt
    decode = meta.state_rows is not None and meta.num_decodes == input_ids.shape[0] and not scoring \
        and getattr(model, "device_decode", True)  # False: the host path, decode_path's slow twin
    if decode or meta.q_nums is not None:  # (a padded verify batch has no host lists: the device path only)
        from . import decode_path  # every row one token that samples, or a verify graph's Q: no host list needed

        return decode_path.forward_decode(model, input_ids, meta, cache)
    up = Upload(device)
    ends = [a + k for a, k in zip(meta.starts, meta.nums)]
    # The encoder's SWA cut: 0, or where a prefix hit's replay starts (its window state was not cached).
    enc = Pass(meta, list(meta.starts), ends, device, cut=list(meta.swa_cuts or [0] * len(meta.starts)), up=up,
               ring=_rings(cache, False))
    restored = meta.enc_restored or [False] * len(meta.starts)
    lo = [s if back else max(a, s) for a, s, back in zip(meta.starts, meta.replay_starts, restored)]
    # The decoder's cut: its replay start, or a prefix hit's replay start if later (its rings start there).
    dec = Pass(meta, lo, ends, device, cut=[max(s, c) for s, c in zip(meta.replay_starts, enc.cut)], up=up,
               ring=_rings(cache, False))
    # Prompt scoring (ReplayStart rows): the decoder again over positions < score_end, as exact replay runs it.
    score_ends = [min(b, getattr(s, "score_end", 0)) for b, s in zip(ends, meta.replay_starts)]
    sc = None
    if scoring or any(e > a for e, a in zip(score_ends, meta.starts)):
        sc = Pass(meta, list(meta.starts), score_ends, device, cut=[0] * len(meta.starts), score=True, up=up,
                  ring=_rings(cache, True))
    h = model.embed(input_ids)  # [T, d]
    ctx: dict = {}
    pending = None  # each layer's MoE output, added by the next layer's norm op (layer_engine's defer)
    planned = False
    for layer in model.layers[: c.num_encoder_layers]:
        if not planned and (layer.mode != "swa" or not PLAN_AFTER_SWA):
            _plan_step(model, meta, cache, device, up)  # (the SWA-only layers before this one are queued)
            planned = True
        h, pending = layer_engine(model, layer, h, enc, None, cache, ctx, stats, pending, defer=True)
    if not planned:
        _plan_step(model, meta, cache, device, up)
    h = h_enc = finish(h, pending, model)
    if cache.henc is not None:
        _keep_encoder_outputs(enc, h_enc, cache)
    hd = h_enc[dec.tok.clamp(min=0)]
    if dec.early is not None:  # a restored row's positions before its chunk: the snapshot's encoder outputs
        e = dec.early
        hd[e] = cache.henc[dec.ring_slot[e], dec.pos[e] % cache.henc.shape[1]].to(hd.dtype)
    graphs = getattr(cache, "pass_graphs", None)  # bounded replay's decoder pass in a CUDA graph (pass_graphs.py)
    if graphs is not None and graphs.covers(model, meta, dec, hd, scoring):
        hd, kept = graphs.run(model, hd, dec, h_enc, cache, ctx, stats), []
    else:
        hd, kept = decoder_layers(model, hd, dec, h_enc, cache, ctx, stats)
    out = torch.zeros_like(h_enc)
    place = dec.tok if dec.early is None else dec.tok[dec.late]
    pick = slice(None) if dec.early is None else dec.late
    out[place] = hd[pick]
    if kept:
        model.captured_hidden = h_enc.new_zeros(h_enc.shape[0], len(kept) * h_enc.shape[1])
        model.captured_hidden[place] = torch.cat(kept, dim=-1)[pick]
    if sc is not None:
        sctx = {k: v for k, v in ctx.items() if k[0] == "kv"}  # the entries the generation pass wrote
        hs = h_enc[sc.tok]
        pending = None
        for layer in model.layers[c.num_encoder_layers:]:
            hs, pending = layer_engine(model, layer, hs, sc, h_enc, cache, sctx, stats, pending, defer=True)
        out[sc.tok] = finish(hs, pending, model)
    return out
