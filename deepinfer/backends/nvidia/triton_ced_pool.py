"""The decoder's candidate pool (models/ced/functional.py ``pool_candidates``) in three launches, no sort.

pool_candidates runs as ~20 small torch kernels per decoder full layer and step (mask, pad, block max, cumsum,
argmax, scatter, sort, gathers, repeat, a second sort). Here, for scores [Tq, J] float32 of which the first
num_visible[t] entries are visible (CED's visibility is a prefix of the entry ids):

1. ``_block_max_kernel``: each block of ``block`` entries scored by its max visible score (-inf when it has
   none), the newest visible block forced to +inf (always kept); also each query's count of visible blocks;
2. triton_ced_indexer.topk_select keeps the best ``nblocks`` blocks (ties to the lower block id, as the
   reference's stable sort; a -inf block is never kept), block ids ascending, -1 after;
3. ``_expand_kernel`` writes each kept block's visible entry ids in order. Every kept block but the newest is
   wholly visible, and the newest is the highest kept id, so the ids come out ascending, then -1: the
   reference's layout [Tq, min(nblocks, ceil(J / block)) * block], exactly (block maxima are exact).

``entry_rows``: table[q_rows[t], ids[t, k]] for ids >= 0, else -1, in one launch (the cache rows of chosen
entries, or a reindex layer's candidates' rows and back; a where, a clamp and an index in torch), with each
row's count of ids >= 0 on request.

Capture-safe: shapes decide the grids, nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ced_indexer import topk_select
from .triton_pdl import launch_kw, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _block_max_kernel(scores_ptr, nvis_ptr, bmax_ptr, nbv_ptr, stride_s, stride_b, J, NB,
                      BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    i = tl.arange(0, BLOCK_P)
    nvis = tl.minimum(tl.load(nvis_ptr + t), J)
    j = b[:, None] * BLOCK + i[None, :]  # [BLOCK_B, BLOCK_P] entry ids
    ok = (j < nvis) & (i < BLOCK)[None, :]
    s = tl.load(scores_ptr + t * stride_s + j, mask=ok, other=float("-inf"))
    m = tl.max(s, axis=1)
    newest = (nvis - 1) // BLOCK
    m = tl.where((b == newest) & (nvis > 0), float("inf"), m)
    tl.store(bmax_ptr + t * stride_b + b, m, mask=b < NB)
    if tl.program_id(1) == 0:
        tl.store(nbv_ptr + t, (nvis + BLOCK - 1) // BLOCK)


@triton.jit
def _expand_kernel(kept_ptr, nvis_ptr, out_ptr, stride_k, stride_o, J, KEEP,
                   BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.arange(0, BLOCK_P)
    nvis = tl.minimum(tl.load(nvis_ptr + t), J)
    blk = tl.load(kept_ptr + t * stride_k + r, mask=r < KEEP, other=-1)
    j = blk[:, None] * BLOCK + i[None, :]
    ids = tl.where((blk[:, None] >= 0) & (j < nvis), j, -1)
    at = r[:, None] * BLOCK + i[None, :]
    tl.store(out_ptr + t * stride_o + at, ids.to(tl.int64), mask=(r < KEEP)[:, None] & (i < BLOCK)[None, :])


@triton.jit
def _entry_rows_kernel(table_ptr, qrows_ptr, ids_ptr, out_ptr, count_ptr, stride_t, stride_i, stride_o, K,
                       BLOCK_K: tl.constexpr, COUNT: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + t * stride_i + k, mask=k < K, other=-1)
    ok = ids >= 0
    row = tl.load(qrows_ptr + t).to(tl.int64)
    v = tl.load(table_ptr + row * stride_t + ids, mask=ok, other=-1)
    tl.store(out_ptr + t * stride_o + k, tl.where(ok, v, -1).to(tl.int64), mask=k < K)
    if COUNT:
        tl.store(count_ptr + t, tl.sum(ok.to(tl.int32), axis=0).to(tl.int64))


MAX_K = 16384


def supports_entry_rows(table: torch.Tensor, q_rows: torch.Tensor, ids: torch.Tensor) -> bool:
    return table.dim() == 2 and table.dtype == torch.int64 and (table.stride(1) == 1 or table.shape[1] <= 1) \
        and ids.dim() == 2 and ids.dtype == torch.int64 and ids.shape[1] <= MAX_K \
        and q_rows.shape == ids.shape[:1] and q_rows.dtype in (torch.int32, torch.int64)


def entry_rows(table: torch.Tensor, q_rows: torch.Tensor, ids: torch.Tensor, count: bool = False):
    """table [R, J] int64, q_rows [Tq], ids [Tq, K] int64 (-1 = none; else < J) -> table[q_rows[t], ids[t, k]]
    [Tq, K] int64, -1 where ids is; with count, also [Tq] int64 the number of ids >= 0 per row."""
    if not supports_entry_rows(table, q_rows, ids):
        raise ValueError(f"entry_rows: table must be int64 [R, J], ids int64 [Tq, K <= {MAX_K}], q_rows an int "
                         f"[Tq]; got {table.dtype} {tuple(table.shape)}, {ids.dtype} {tuple(ids.shape)}, "
                         f"{q_rows.dtype} {tuple(q_rows.shape)}")
    Tq, K = ids.shape
    out = torch.empty(Tq, K, dtype=torch.int64, device=ids.device)
    cnt = torch.empty(Tq if count else 0, dtype=torch.int64, device=ids.device)
    if Tq and (K or count):
        ids_c = ids if ids.stride(-1) == 1 or K <= 1 else ids.contiguous()
        _entry_rows_kernel[(Tq,)](table, q_rows.contiguous(), ids_c, out, cnt if count else out,
                                  table.stride(0), ids_c.stride(0), out.stride(0), K,
                                  BLOCK_K=max(1, next_pow2(K)), COUNT=count, **launch_kw(ids.device))
    return (out, cnt) if count else out


def supports(scores: torch.Tensor, num_visible: torch.Tensor) -> bool:
    return scores.dim() == 2 and scores.dtype == torch.float32 and scores.stride(1) == 1 \
        and num_visible.shape == scores.shape[:1] and num_visible.dtype in (torch.int32, torch.int64)


def pool_candidates(scores: torch.Tensor, num_visible: torch.Tensor, block: int, nblocks: int) -> torch.Tensor:
    """scores [Tq, J] float32, num_visible [Tq] -> the candidate pool's entry ids [Tq, min(nblocks,
    ceil(J / block)) * block] int64, ascending, then -1 (functional.pool_candidates with visible = j <
    num_visible[t])."""
    if not supports(scores, num_visible):
        raise ValueError(f"pool_candidates: scores must be float32 [Tq, J] with unit column stride and num_visible "
                         f"an int tensor [Tq]; got {scores.dtype} {tuple(scores.shape)} stride {scores.stride()}, "
                         f"{num_visible.dtype} {tuple(num_visible.shape)}")
    for name, v in (("block", block), ("nblocks", nblocks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"pool_candidates: {name} must be a positive int, got {v!r}")
    Tq, J = scores.shape
    dev = scores.device
    if J == 0:
        return torch.full((Tq, 0), -1, dtype=torch.long, device=dev)
    nb = -(-J // block)
    keep = min(nblocks, nb)
    out = torch.empty(Tq, keep * block, dtype=torch.long, device=dev)
    if Tq == 0:
        return out
    nvis = num_visible.contiguous()
    bmax = torch.empty(Tq, nb, dtype=torch.float32, device=dev)
    nbv = torch.empty(Tq, dtype=torch.int32, device=dev)
    bp = next_pow2(block)
    bb = max(1, min(next_pow2(nb), (16 if INTERPRET else 4096) // bp))
    _block_max_kernel[(Tq, cdiv(nb, bb))](scores, nvis, bmax, nbv, scores.stride(0), bmax.stride(0), J, nb,
                                          BLOCK=block, BLOCK_B=bb, BLOCK_P=bp, **launch_kw(dev))
    kept = topk_select(bmax, nbv, keep)
    br = max(1, min(next_pow2(keep), (16 if INTERPRET else 4096) // bp))
    _expand_kernel[(Tq, cdiv(keep, br))](kept, nvis, out, kept.stride(0), out.stride(0), J, keep,
                                         BLOCK=block, BLOCK_R=br, BLOCK_P=bp, **launch_kw(dev))
    return out
