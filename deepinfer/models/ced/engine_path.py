"""The CED engine path: ragged rows of many sequences over the paged FP4 global KV and the FP8 SWA rings.

Per row (a sequence computing positions [a, b) this step, replay start s):
- the encoder runs over every token of the chunk;
- every full layer compresses the groups that complete in the chunk (with the tail left over from the
  previous chunk) and writes them to the paged cache before attention (visibility does the causality);
- the decoder runs only over positions >= s, with its SWA cut at s (bounded replay; s = 0 is exact).
  The decoder's full layer still compresses every chunk token from the final encoder state.
Queries gather their SWA keys from this chunk's fresh KV and, for older positions, from the ring.
"""

from __future__ import annotations

import torch

from . import functional as fn


class Pass:
    """One part (encoder or decoder) of the step: which tokens query and where their SWA keys live."""

    def __init__(self, meta, lo: list, T: int, device, cut: list):
        self.rows, self.local, pos = [], [], []
        self.lo, self.cut = lo, cut  # [R] first queried position, SWA cut
        self.lstart = []  # [R] offset of the row's first query in this pass
        n = 0
        for r, (a, k) in enumerate(zip(meta.starts, meta.nums)):
            self.lstart.append(n)
            q = max(0, a + k - lo[r])
            self.rows += [r] * q
            pos += range(lo[r], a + k)
            n += q
        self.n = n
        self.rows_t = torch.tensor(self.rows, dtype=torch.long, device=device)
        self.pos = torch.tensor(pos, dtype=torch.long, device=device)
        # Index of each query among the step's T tokens.
        qs = [0]
        for k in meta.nums:
            qs.append(qs[-1] + k)
        self.tok = torch.tensor([qs[r] + (p - meta.starts[r]) for r, p in zip(self.rows, pos)], dtype=torch.long,
                                device=device)


def _swa_keys(model, layer, P: Pass, kv, cache, meta, device):
    """[Tq, W, D] keys of each query and their mask, from fresh KV (this pass) or the ring."""
    c = model.config
    W = c.n_win
    p = P.pos[:, None] - (W - 1) + torch.arange(W, device=device)[None, :]  # [Tq, W]
    lo = torch.tensor(P.lo, device=device)[P.rows_t][:, None]
    cut = torch.tensor(P.cut, device=device)[P.rows_t][:, None]
    valid = (p >= cut) & (p >= 0)
    fresh = p >= lo
    lst = torch.tensor(P.lstart, device=device)[P.rows_t][:, None]
    fresh_idx = (lst + p - lo).clamp(0, max(P.n - 1, 0))
    keys = kv[fresh_idx] if P.n else kv.new_zeros(0, W, c.head_dim)
    from_ring = valid & ~fresh  # older positions: only these are read (and dequantized) from the ring
    if bool(from_ring.any()):
        slots = torch.tensor(meta.state_slots, device=device)[P.rows_t][:, None].expand_as(p)
        keys = keys.clone()
        keys[from_ring] = cache.ring_read(layer.i, slots[from_ring], p[from_ring])
    return keys, valid


def _write_ring(layer, P: Pass, kv, cache, meta, device):
    c = layer.c
    keep = []
    for r in range(len(meta.starts)):
        n_r = (P.lstart[r + 1] if r + 1 < len(P.lstart) else P.n) - P.lstart[r]
        keep += range(P.lstart[r] + max(0, n_r - c.ring_size), P.lstart[r] + n_r)
    if keep:
        idx = torch.tensor(keep, dtype=torch.long, device=device)
        slots = torch.tensor(meta.state_slots, device=device)[P.rows_t[idx]]
        cache.ring_write(layer.i, slots, P.pos[idx], kv[idx])


def _compress_chunk(model, layer, xs, meta, cache, device):
    """Compress the groups completing in this step for every row; xs [T, d] normed input of all tokens."""
    m = layer.m
    chunks, ids, rows = [], [], []
    qs = 0
    for r, (a, k) in enumerate(zip(meta.starts, meta.nums)):
        b = a + k
        x_row = xs[qs:qs + k]
        qs += k
        pend = a % m
        if m > 1:
            tail = cache.pending[layer.i][meta.state_slots[r], :pend]
            x_row = torch.cat([tail, x_row], dim=0)  # tokens from (a // m) * m
        j0, j1 = a // m, b // m
        if j1 > j0:
            chunks.append(x_row[: (j1 - j0) * m])
            ids.append(torch.arange(j0, j1, device=device))
            rows.append((r, j0, j1))
        if m > 1:
            rest = x_row[(j1 - j0) * m:]
            if rest.shape[0]:
                cache.pending[layer.i][meta.state_slots[r], : rest.shape[0]] = rest
    if not chunks:
        return
    e, k = layer.entries(torch.cat(chunks), torch.cat(ids))
    off = 0
    for r, j0, j1 in rows:
        n = j1 - j0
        slots = cache.entry_slots(layer.i, meta.block_tables[r], torch.arange(j0, j1, device=device))
        cache.write_entries(layer.i, slots, e[off:off + n], k[off:off + n])
        off += n


def _row_entries(layer_i, m, cache, meta, device):
    """All entries complete after this step, per row: ([R, Jmax, D], [R, Jmax, dh], J per row)."""
    J = [(a + k) // m for a, k in zip(meta.starts, meta.nums)]
    Jmax = max(J) if J else 0
    ids = torch.arange(Jmax, device=device)
    slots = []
    for r in range(len(J)):
        per = cache.block_size // m
        bt = torch.tensor(meta.block_tables[r] or [0], dtype=torch.long, device=device)
        jj = ids.clamp(max=max(J[r] - 1, 0))
        slots.append(bt[(jj // per).clamp(max=bt.numel() - 1)] * per + jj % per)
    slots = torch.stack(slots) if slots else torch.zeros(0, 0, dtype=torch.long, device=device)
    e, k = cache.read_entries(layer_i, slots)
    return e, k, J


def _row_scores(iq, iw, iks, P: Pass):
    """Indexer scores [Tq, Jmax] of each query against its own sequence's keys, one row at a time, so no
    [Tq, Jmax, dh] per-query copy of the keys is ever made (quadratic memory at long prompts)."""
    out = iq.new_zeros(P.n, iks.shape[1], dtype=torch.float32)
    bounds = P.lstart + [P.n]
    for r in range(len(P.lstart)):
        a, b = bounds[r], bounds[r + 1]
        if b > a:
            out[a:b] = fn.index_scores(iq[a:b], iw[a:b], iks[r])
    return out


def layer_engine(model, layer, h, P: Pass, src, meta, cache, ctx, stats):
    """h [Tq, d] hidden of this pass's queries; src [T, d] hidden of all step tokens (full-layer input)."""
    c = model.config
    device = h.device
    x = fn.rms(h, layer.attn_norm, c.rms_norm_eps)
    stats["layer_tokens"][layer.i] += P.n
    if P.n:
        stats["min_pos"][layer.i] = min(stats["min_pos"][layer.i], int(P.pos.min()))
    q, cq = layer.query(x, P.pos)
    kv = layer.swa_kv(x, P.pos)
    swa, swa_mask = _swa_keys(model, layer, P, kv, cache, meta, device)
    if layer.mode == "swa":
        glob, gmask = kv.new_zeros(P.n, 0, c.head_dim), torch.zeros(P.n, 0, dtype=torch.bool, device=device)
    else:
        m = layer.m
        src_l = c.source_full(layer.i)
        if layer.mode == "full":
            xs = x if src is None else fn.rms(src, layer.attn_norm, c.rms_norm_eps)
            _compress_chunk(model, layer, xs, meta, cache, device)
            ctx[("kv", layer.i)] = _row_entries(layer.i, m, cache, meta, device)
        ents, iks, J = ctx[("kv", src_l)]
        Jmax = ents.shape[1]
        visible = torch.arange(Jmax, device=device)[None, :] < ((P.pos + 1) // m)[:, None]
        if layer.mode in ("full", "reindex"):
            stats["indexer_calls"][layer.i] += 1
            iq, iw = layer.index_query(x, cq)
            topk = layer.choose_entries(_row_scores(iq, iw, iks, P), visible, ctx)
        else:
            topk = ctx[("topk", c.source_topk(layer.i))]
        valid = topk >= 0
        if P.n and Jmax:
            glob = ents[P.rows_t[:, None], topk.clamp(min=0)]
        else:  # no query, or no complete entry yet in any row (topk is all -1)
            glob = ents.new_zeros(P.n, topk.shape[1], c.head_dim)
        gmask = valid
    if P.n:
        o = fn.attend(q, swa, swa_mask, glob, gmask, layer.sink, c.head_dim ** -0.5)
        h = h + layer.out_proj(o, P.pos)
        y, ids = layer.moe(fn.rms(h, layer.ffn_norm, c.rms_norm_eps))
        model.record_expert_load(layer.i, ids)
        h = h + y
    _write_ring(layer, P, kv, cache, meta, device)
    return h


def forward_engine(model, input_ids, meta, cache):
    c = model.config
    device = input_ids.device
    stats = model.counters
    h = model.embed(input_ids)  # [T, d]
    T = h.shape[0]
    ctx: dict = {}
    enc = Pass(meta, list(meta.starts), T, device, cut=[0] * len(meta.starts))
    for layer in model.layers[: c.num_encoder_layers]:
        h = layer_engine(model, layer, h, enc, None, meta, cache, ctx, stats)
    h_enc = h
    lo = [max(a, s) for a, s in zip(meta.starts, meta.replay_starts)]
    dec = Pass(meta, lo, T, device, cut=list(meta.replay_starts))
    hd = h_enc[dec.tok]
    for layer in model.layers[c.num_encoder_layers:]:
        hd = layer_engine(model, layer, hd, dec, h_enc, meta, cache, ctx, stats)
    out = torch.zeros_like(h_enc)
    out[dec.tok] = hd
    return out
