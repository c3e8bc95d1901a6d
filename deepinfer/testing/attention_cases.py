"""Inputs of the CED sparse attention and MLA decode ops, built on the device in vectorised torch, for kernel tests
and benchmarks (small drawn shapes and the bench shapes alike).

``ced_attention_case`` builds one engine-like CED attention step: per sequence, a run of this pass's queries
(fresh KV rows) after a ring of older positions, a replay cut, a paged FP4 global KV cache and each query's
selection of its rows (-1 anywhere), plus a sink per head. ``mla_decode_case`` builds a decode batch over a
shuffled paged latent cache. With ``poison`` every ring slot, cache row and scale that no query may read is NaN,
so a kernel that loads one (and multiplies it by a zero probability) shows NaN in its output.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..backends.base import AttnMetadata
from ..backends.reference import lowbit

NAN_SCALE = {"fp4_e2m1_e4m3": 0x7F, "mxfp4": 0xFF, "fp8_e4m3_pow2": 0xFF}  # a scale byte that decodes to NaN


def _randn(shape, g, device, dtype=torch.float32):
    return torch.randn(shape, generator=g, device=device, dtype=dtype)


def ced_attention_case(rows: Sequence[tuple], *, window: int, ring_size: int, heads: int, dim: int, topk: int,
                       fmt: str, dtype: torch.dtype, sinks: bool, seed: int = 0, device="cpu",
                       n_entries: Optional[int] = None, full_selection: bool = False,
                       poison: bool = True) -> tuple[tuple, dict]:
    """(args, kwargs) of ``ced_sparse_attention`` for ``rows`` = [(fresh_lo, n_queries, cut)] per sequence:
    positions fresh_lo .. fresh_lo + n - 1 are this pass's queries (fresh KV rows, in row order); the ring of
    ``ring_size`` slots holds the positions before fresh_lo (those >= max(cut, 0)); ``n_entries`` FP4 cache rows
    (default max(2 topk, 4)), each query selecting ``topk`` of them (``full_selection``) or a random number,
    with -1 anywhere. Row 0 of the cache is never selected."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    R, T, D, RING = len(rows), sum(n for _, n, _ in rows), dim, ring_size
    lo_r = torch.tensor([lo for lo, _, _ in rows], device=device)
    n_r = torch.tensor([n for _, n, _ in rows], device=device)
    cut_r = torch.tensor([c for _, _, c in rows], device=device)
    # Ring rows: sequence r owns ring row ring_of[r] of R + 1 (one spare row stays poisoned).
    ring_of = torch.randperm(R + 1, generator=g, device=device)[:R]
    vals = _randn((R + 1, RING, D), g, device)
    rc, rs = lowbit.quantize(vals, "fp8_e4m3_pow2")  # [R + 1, RING, D], [R + 1, RING, D // 32]
    if poison:
        old = lo_r[:, None] - RING + torch.arange(RING, device=device)[None, :]  # [R, RING] positions held
        stale = old < cut_r.clamp(min=0)[:, None]  # never visible: poisoned
        keep = torch.zeros(R + 1, RING, dtype=torch.bool, device=device)
        keep[ring_of[:, None].expand_as(old)[~stale], (old % RING)[~stale]] = True
        rc[~keep] = 0x7F
        rs[~keep] = NAN_SCALE["fp8_e4m3_pow2"]
    # Per query: its sequence, position, cut, fresh_lo, fresh row start, ring row.
    seq = torch.repeat_interleave(torch.arange(R, device=device), n_r)
    first = torch.cumsum(n_r, 0) - n_r
    pos = lo_r[seq] + torch.arange(T, device=device) - first[seq]
    # Entries: random latents at mixed magnitudes, quantised.
    N = n_entries or max(2 * topk, 4)
    ents = _randn((N, D), g, device) * torch.pow(2.0, torch.randint(-3, 4, (N, 1), generator=g, device=device).float())
    ec, es = lowbit.quantize(ents, fmt)
    if topk:
        chosen = torch.rand((T, N - 1), generator=g, device=device).topk(min(topk, N - 1), dim=1).indices + 1
        chosen = torch.cat([chosen, chosen.new_full((T, topk - chosen.shape[1]), -1)], 1)  # [T, topk]
        count = torch.full((T, 1), topk, device=device) if full_selection else torch.randint(
            0, topk + 1, (T, 1), generator=g, device=device)
        chosen = torch.where(torch.arange(topk, device=device)[None, :] < count, chosen, -1)
        order = torch.rand((T, topk), generator=g, device=device).argsort(dim=1)  # -1 anywhere, not only last
        sel = chosen.gather(1, order)
    else:
        sel = torch.zeros((T, 0), dtype=torch.long, device=device)
    if poison:
        used = torch.zeros(N, dtype=torch.bool, device=device)
        used[sel[sel >= 0]] = True
        es[~used] = NAN_SCALE[fmt]
    kv = _randn((T, D), g, device).to(dtype)
    q = _randn((T, heads, D), g, device).to(dtype)
    args = (q, kv, (rc, rs), (ec, es), sel)
    kw = dict(pos=pos, cut=cut_r[seq], fresh_lo=lo_r[seq], fresh_start=first[seq], ring_slot=ring_of[seq],
              window=window, ring_fmt="fp8_e4m3_pow2", entry_fmt=fmt,
              sinks=_randn((heads,), g, device) if sinks else None, scale=D ** -0.5)
    return args, kw


def mla_decode_case(lens: Sequence[int], *, block_size: int, heads: int, rank: int, rope: int, dtype: torch.dtype,
                    seed: int = 0, device="cpu", bt_dtype: torch.dtype = torch.int64, extra_blocks: int = 0,
                    form: str = "3d", poison: bool = True):
    """A decode batch over a shuffled paged latent cache: (q [B, H, r + rope], cache for the kernel, clean cache
    [slots, 1, r + rope] for the reference, meta). Row b's query sits at position lens[b] - 1. ``form`` "3d"
    ([slots, 1, D]), "2d" ([slots, D]) or "strided" (each slot padded by 8 values); with ``poison`` the kernel's
    cache is NaN in every row no visible key uses (and in the padding)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    B, D, bs = len(lens), rank + rope, block_size
    lens_t = torch.tensor(list(lens), device=device)
    need = (lens_t + bs - 1) // bs
    width = max(1, int(need.max()) if B else 1) + extra_blocks
    total = int(need.sum()) + 3
    perm = torch.randperm(total, generator=g, device=device)
    j = torch.arange(width, device=device)[None, :]
    start = torch.cumsum(need, 0) - need
    bt = torch.where(j < need[:, None], perm[(start[:, None] + j).clamp(max=total - 1)], 0)  # [B, width]
    slots = total * bs
    rows = _randn((slots, D), g, device).to(dtype)
    kv_pos = torch.arange(width * bs, device=device)
    kv_slots = bt[:, kv_pos // bs] * bs + kv_pos % bs  # [B, max_kv]
    clean = rows[:, None]
    if poison:
        visible = torch.zeros(slots, dtype=torch.bool, device=device)
        visible[kv_slots[kv_pos[None, :] < lens_t[:, None]]] = True
        rows = rows.masked_fill(~visible[:, None], float("nan"))
    if form == "strided":
        buf = torch.full((slots, 1, D + 8), float("nan"), dtype=dtype, device=device)
        buf[:, 0, :D] = rows
        cache = buf[:, :, :D]
    elif form == "2d":
        cache = rows
    else:
        cache = rows[:, None]
    q_pos = (lens_t - 1).clamp(min=0)[:, None]
    meta = AttnMetadata(positions=q_pos[:, 0], slot_mapping=kv_slots.gather(1, q_pos)[:, 0], seq_lens=lens_t,
                        q_index=torch.arange(B, device=device)[:, None],
                        q_valid=torch.ones(B, 1, dtype=torch.bool, device=device), kv_slots=kv_slots, q_pos=q_pos,
                        block_table=bt.to(bt_dtype), block_size=bs)
    q = _randn((B, heads, D), g, device).to(dtype)
    return q, cache, clean, meta
