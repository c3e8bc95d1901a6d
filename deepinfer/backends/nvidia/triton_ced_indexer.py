"""The CED indexer in Triton: scores against FP4 index keys read from the paged cache, then the top-K.

score(t, j) = sum_h w[t, h] * relu(q[t, h] . k(j)) for the entries j of query t's sequence; the top-K
of the visible (and allowed) entries are chosen, ties going to the lower entry id, as
``models.ced.functional.select_topk`` chooses them (an entry scored -inf is never chosen: fewer than K
eligible entries leave -1 at the end).

Two kernels:
- ``_score_kernel``, one program per (query, tile of BLOCK_J entries): finds each entry's cache row
  through the sequence's entry-slot table, dequantises the keys in registers (MXFP4 or FP4-E4M3, exact),
  and computes the heads' dots on the tensor cores (all index heads form the M side). Tiles past the
  query's visible entries store -inf without computing. The [Tq, J] float32 scores go to global memory
  (4 bytes per entry against the 68 bytes of a key at dh = 128), which the decoder's candidate pool also
  reads.
- ``_topk_kernel``, one program per query: a threshold search instead of a sort. Scores are mapped to
  int32 keys with the order of floats (-0.0 folded into +0.0); counting passes find the K-th largest key T,
  by interpolation between the counts of a shrinking bracket of keys (TOPK_SEARCH 1, the default; bisection
  after INTERP_PROBES probes) or bit by bit from the top (TOPK_SEARCH 0, at most 32 passes); either stops early
  where exactly K keys reach a probe (they are the set; TOPK_EARLY). One more pass writes the entries above T
  and then the lowest-id entries equal to T (a prefix sum of the ties only where some must be left out:
  TOPK_LAZY_TIES), in ascending id order, and -1 after the last. Rows up to BLOCK entries (16K) are read
  once and kept in registers; longer rows are re-read per pass (from L2).

So the selected set is exactly the reference's for the same scores. Scores computed here differ from the
reference's float32 einsum in the last bits (summation order), so the set can differ where two entries'
scores are within a few ulp of each other at the K-th place (exact ties, e.g. repeated keys, still agree).
Ids come in ascending order, not by descending score as the reference returns them.

Launch is capture-safe: shapes only decide the grid and loop counts, nothing is read back to the host.
Scores must not be NaN.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_attention import _dot
from .triton_fp4 import GROUPS, fast_decode, fp4_operand, fp4_tile
from .triton_norm import cast_rne, to_f32
from .triton_pdl import launch_kw, pdl_signal, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, merge_launch, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADS = 128
MAX_HEAD_DIM = 512
# topk_select's threshold search: bits of the threshold settled a pass (1 or 2: three counts packed in one int64
# reduction), and whether a row stops once exactly K keys reach its prefix. Both leave the set unchanged. On the H100
# (ced_prefill_kernels.py, a 16K prefill chunk's top-K): 370.6 us shipped, 267.3 with the early stop, 397.6 / 291.8
# at two bits a pass without / with it; so one bit, early stop on. A radix digit of 4 / 8 bits a pass from a histogram
# (tl.histogram; 36th session, s36a on the H100) took 293.4 / 354.7 us against 251.6 for the shipped search (whose
# count now sums in int32 and skips rows of at most K visible entries): the ballots a bin cost more than the passes
# they save; removed.
TOPK_DIGIT = 1
TOPK_EARLY = True
# Two more choices (they leave the set unchanged): TOPK_SEARCH 1 finds the threshold by interpolation in the scores
# (Illinois' regula falsi on the count of keys >= a probe, then bisection; after one pass for the row's extremes);
# TOPK_LAZY_TIES skips the ties' prefix sum where every key at the threshold is taken (always after an early stop).
# On the H100 (37th session, s37a; a 2048-query chunk over 8K entries): bit search 251.9 us, lazy ties 229.3,
# interpolation 226.0, both 204.2, both on 4 warps 167.5; the 16K bounded prefill's top-K 4.22 -> 3.44 ms with both
# (8 warps). Both on, rows up to 8K entries on 4 warps (topk_select).
TOPK_SEARCH = 1
TOPK_LAZY_TIES = True
# Interpolation probes before the search bisects. benchmarks/topk_search_sim.py (a numpy port of both searches, 40
# rows each, K = 512): 8K normal or relu-sum scores 11.5 / 11.4 counts a row against the bit search's 18.3 / 19.0;
# lognormal 17.4 against 16.5; 8 distinct values 9 against 32 (at 2K: 32.2 against 30.9). A guard that bisected
# wherever two probes had not halved the key bracket bisected too early (20-27 counts at 8K).
INTERP_PROBES = tl.constexpr(24)


@triton.jit
def _head_scores(q, w, k, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q [BLOCK_Q * BLOCK_H, BLOCK_D] (query-major rows), w [same rows] float32, keys k [BLOCK_J, BLOCK_D] in q's
    dtype -> sum_h w * relu(q . k) per query: [BLOCK_Q, BLOCK_J]."""
    dots = _dot(q, tl.trans(k), DOT_PRECISION)  # [BLOCK_Q * BLOCK_H, BLOCK_J]
    s = w[:, None] * tl.maximum(dots, 0.0)
    return tl.sum(tl.reshape(s, [BLOCK_Q, BLOCK_H, k.shape[0]]), axis=1)


@triton.jit
def _query_rows(q_ptr, w_ptr, t0, stride_qt, stride_qh, stride_wt, stride_wh, Tq, NH, DH, BLOCK_Q: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Queries t0 .. t0 + BLOCK_Q - 1 as MMA rows (query r // BLOCK_H, head r % BLOCK_H; zeros past Tq, NH, DH):
    q [BLOCK_Q * BLOCK_H, BLOCK_D] and the heads' weights w [same rows] in float32."""
    r = tl.arange(0, BLOCK_Q * BLOCK_H)
    rt = t0 + r // BLOCK_H
    h = r % BLOCK_H
    r_ok = (rt < Tq) & (h < NH)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + rt[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=r_ok[:, None] & (d < DH)[None, :], other=0.0)
    return q, to_f32(tl.load(w_ptr + rt * stride_wt + h * stride_wh, mask=r_ok, other=0.0))


@triton.jit
def _key_tile(codes_ptr, scales_ptr, slot, vis, stride_c, stride_s, DH, DT: tl.constexpr, BLOCK_D: tl.constexpr,
              GROUP: tl.constexpr, E8M0: tl.constexpr, FAST: tl.constexpr):
    """The keys of cache rows ``slot`` (masked by vis) as an MMA operand in DT."""
    if FAST or BLOCK_D < 64:
        # FP4 values are exact in bf16/fp16. Below K = BLOCK_D = 64 the Triton 3.6 kWidth bug (see mma_operand)
        # applies; from 64 up the direct cast is right and cheaper (fp4_operand's fast decoder is opaque to it).
        return fp4_operand(codes_ptr, scales_ptr, slot, vis, stride_c, stride_s, DH // GROUP, BLOCK_D // GROUP,
                           GROUP, E8M0, DT, FAST)
    else:
        return cast_rne(fp4_tile(codes_ptr, scales_ptr, slot, vis, stride_c, stride_s, DH // GROUP,
                                 BLOCK_D // GROUP, GROUP, E8M0), DT)


@triton.jit
def _score_kernel(q_ptr, w_ptr, codes_ptr, scales_ptr, slots_ptr, rows_ptr, nvis_ptr, out_ptr,
                  stride_qt, stride_qh, stride_wt, stride_wh, stride_c, stride_s, stride_sr, stride_ot,
                  Tq, NH, DH, J,
                  BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
                  GROUP: tl.constexpr, E8M0: tl.constexpr, FAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  PDL: tl.constexpr = 0):
    pdl_start(PDL, True)
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_Q
    j0 = tl.program_id(1) * BLOCK_J
    j = j0 + tl.arange(0, BLOCK_J)
    tq = t0 + tl.arange(0, BLOCK_Q)  # this program's queries
    t_ok = tq < Tq
    nvis = tl.minimum(tl.load(nvis_ptr + tq, mask=t_ok, other=0), J)  # [BLOCK_Q]
    s = tl.full([BLOCK_Q, BLOCK_J], float("-inf"), dtype=tl.float32)
    if j0 < tl.max(nvis, axis=0):
        q, w = _query_rows(q_ptr, w_ptr, t0, stride_qt, stride_qh, stride_wt, stride_wh, Tq, NH, DH, BLOCK_Q, BLOCK_H,
                           BLOCK_D)
        rows = tl.load(rows_ptr + tq, mask=t_ok, other=-1)
        row0 = tl.load(rows_ptr + t0)
        if tl.sum((t_ok & (rows != row0)).to(tl.int32), axis=0) == 0:
            # One sequence (a prefill chunk): its keys are decoded once for all the block's queries.
            vis = j < tl.max(nvis, axis=0)
            slot = tl.load(slots_ptr + row0 * stride_sr + j, mask=vis, other=0)
            k = _key_tile(codes_ptr, scales_ptr, slot, vis, stride_c, stride_s, DH, q.dtype, BLOCK_D, GROUP, E8M0,
                          FAST)
            s = _head_scores(q, w, k, BLOCK_Q, BLOCK_H, DOT_PRECISION)
        else:  # queries of several sequences: each one's keys, its rows of the product
            for i in range(BLOCK_Q):
                row_i = tl.sum(tl.where(tl.arange(0, BLOCK_Q) == i, rows, 0), axis=0)
                vis = (j < tl.sum(tl.where(tl.arange(0, BLOCK_Q) == i, nvis, 0), axis=0)) & (row_i >= 0)
                slot = tl.load(slots_ptr + row_i * stride_sr + j, mask=vis, other=0)
                k = _key_tile(codes_ptr, scales_ptr, slot, vis, stride_c, stride_s, DH, q.dtype, BLOCK_D, GROUP,
                              E8M0, FAST)
                s_i = _head_scores(q, w, k, BLOCK_Q, BLOCK_H, DOT_PRECISION)
                s = tl.where((tl.arange(0, BLOCK_Q) == i)[:, None], s_i, s)
        s = tl.where(j[None, :] < nvis[:, None], s, float("-inf"))
    pdl_signal(PDL)
    tl.store(out_ptr + tq[:, None] * stride_ot + j[None, :], s, mask=t_ok[:, None] & (j < J)[None, :])


@triton.jit
def _keys(scores_ptr, allowed_ptr, t, stride_st, stride_at, j, nvis, HAS_ALLOWED: tl.constexpr):
    """int32 keys with the order of the float scores of entries j, and whether each may be chosen: visible,
    allowed and scored above -inf (select_topk's rule)."""
    valid = j < nvis
    if HAS_ALLOWED:
        valid &= tl.load(allowed_ptr + t * stride_at + j, mask=valid, other=0) != 0
    s = tl.load(scores_ptr + t * stride_st + j, mask=valid, other=0.0)
    valid &= s != float("-inf")
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties with +0.0, as in the reference's sort
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b), valid


@triton.jit
def _tile_keys(scores_ptr, allowed_ptr, t, stride_st, stride_at, i, offs, nvis, key0, valid0,
               HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr):
    """Tile i's keys and validity: the row's registers when it is one tile, else loaded again."""
    if NUM_TILES == 1:
        return key0, valid0
    return _keys(scores_ptr, allowed_ptr, t, stride_st, stride_at, i * BLOCK + offs, nvis, HAS_ALLOWED)


@triton.jit
def _count_at_least(scores_ptr, allowed_ptr, t, stride_st, stride_at, offs, nvis, key0, valid0, prefix, shift,
                    HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr, DIGIT: tl.constexpr,
                    FIELD: tl.constexpr):
    """For each next digit value c = 1 .. 2^DIGIT - 1: how many chosen keys are >= prefix | c << shift (in the
    unsigned order of key + 2^31), packed into one int64, FIELD bits a count: one reduction a pass."""
    if DIGIT == 1:  # one count: summed in int32 (half the reduction's shuffles of an int64)
        ck = ((prefix | (tl.full([], 1, dtype=tl.int64) << shift)) - 2147483648).to(tl.int32)
        return _count_ge(scores_ptr, allowed_ptr, t, stride_st, stride_at, offs, nvis, key0, valid0, ck,
                         HAS_ALLOWED, BLOCK, NUM_TILES).to(tl.int64)
    total = tl.full([], 0, dtype=tl.int64)
    for i in range(NUM_TILES):
        key, valid = _tile_keys(scores_ptr, allowed_ptr, t, stride_st, stride_at, i, offs, nvis, key0, valid0,
                                HAS_ALLOWED, BLOCK, NUM_TILES)
        packed = tl.zeros([BLOCK], dtype=tl.int64)
        for c in tl.static_range(1, 1 << DIGIT):
            ck = ((prefix | (tl.full([], c, dtype=tl.int64) << shift)) - 2147483648).to(tl.int32)
            packed += ((key >= ck) & valid).to(tl.int64) << (FIELD * (c - 1))
        total += tl.sum(packed, axis=0)
    return total


@triton.jit
def _count_ge(scores_ptr, allowed_ptr, t, stride_st, stride_at, offs, nvis, key0, valid0, ck,
              HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr):
    """How many chosen keys of the row are >= ck (int32)."""
    c = tl.full([], 0, dtype=tl.int32)
    for i in range(NUM_TILES):
        key, valid = _tile_keys(scores_ptr, allowed_ptr, t, stride_st, stride_at, i, offs, nvis, key0, valid0,
                                HAS_ALLOWED, BLOCK, NUM_TILES)
        c += tl.sum(((key >= ck) & valid).to(tl.int32), axis=0)
    return c


@triton.jit
def _key_value(k):
    """The float32 score of int32 keys (the inverse of _keys' order-preserving map)."""
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)


@triton.jit
def _value_key(v):
    b = v.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _interp_threshold(scores_ptr, allowed_ptr, t, stride_st, stride_at, offs, nvis, key0, valid0, K,
                      HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr, EARLY: tl.constexpr):
    """The threshold key by interpolation (TOPK_SEARCH 1): a bracket lo < hi of keys with count(>= lo) >= K >
    count(>= hi), from the row's extremes; each probe interpolates the scores between lo and hi - 1 for K + 1/2 keys
    above it (Illinois: an end kept twice has its count pulled halfway to the target), or bisects the keys once
    INTERP_PROBES probes have run (so at most INTERP_PROBES + 32) or where the scores are not finite. Ends where the
    bracket is one key (lo is then the K-th largest key) or, with EARLY, where a probe has exactly K keys at or above
    it. INT32_MIN where at most K keys may be chosen (all are), as the bit search."""
    n = tl.full([], 0, dtype=tl.int32)
    kmin = tl.full([], 2147483647, dtype=tl.int32)
    kmax = tl.full([], -2147483648, dtype=tl.int32)
    for i in range(NUM_TILES):
        key, valid = _tile_keys(scores_ptr, allowed_ptr, t, stride_st, stride_at, i, offs, nvis, key0, valid0,
                                HAS_ALLOWED, BLOCK, NUM_TILES)
        n += tl.sum(valid.to(tl.int32), axis=0)
        kmin = tl.minimum(kmin, tl.min(tl.where(valid, key, 2147483647), axis=0))
        kmax = tl.maximum(kmax, tl.max(tl.where(valid, key, -2147483648), axis=0))
    lo = kmin.to(tl.int64)
    hi = kmax.to(tl.int64) + 1
    c_lo = n.to(tl.float32)
    c_hi = tl.full([], 0.0, dtype=tl.float32)
    target = K + 0.5
    side = tl.full([], 0, dtype=tl.int32)
    probes = tl.full([], 0, dtype=tl.int32)
    go = (n > K) & (nvis > K)
    while go & (hi - lo > 1):
        lv = _key_value(lo.to(tl.int32))
        hv = _key_value((hi - 1).to(tl.int32))
        v = lv + (c_lo - target) / (c_lo - c_hi) * (hv - lv)
        finite = tl.abs(v) < float("inf")  # (false for NaN too)
        p = tl.where(finite, _value_key(tl.where(finite, v, 0.0)).to(tl.int64), lo)
        p = tl.where((~finite) | (probes >= INTERP_PROBES), lo + (hi - lo) // 2, p)
        p = tl.minimum(tl.maximum(p, lo + 1), hi - 1)
        probes += 1
        c = _count_ge(scores_ptr, allowed_ptr, t, stride_st, stride_at, offs, nvis, key0, valid0, p.to(tl.int32),
                      HAS_ALLOWED, BLOCK, NUM_TILES)
        up = c >= K
        c_hi = tl.where(up & (side == 1), target + (c_hi - target) * 0.5, c_hi)
        c_lo = tl.where((not up) & (side == -1), target + (c_lo - target) * 0.5, c_lo)
        lo = tl.where(up, p, lo)
        c_lo = tl.where(up, c.to(tl.float32), c_lo)
        hi = tl.where(up, hi, p)
        c_hi = tl.where(up, c_hi, c.to(tl.float32))
        side = tl.where(up, 1, -1)
        go = (c != K) | (not EARLY)
    return tl.where((n > K) & (nvis > K), lo, -2147483648).to(tl.int32)


@triton.jit
def _topk_kernel(scores_ptr, nvis_ptr, allowed_ptr, out_ptr, stride_st, stride_at, stride_ot, J, K,
                 HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_KT: tl.constexpr, DIGIT: tl.constexpr = 1, EARLY: tl.constexpr = False,
                 SEARCH: tl.constexpr = 0, LAZY_TIES: tl.constexpr = False, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    nvis = tl.minimum(tl.load(nvis_ptr + t), J)
    offs = tl.arange(0, BLOCK)
    key0 = tl.zeros([BLOCK], dtype=tl.int32)
    valid0 = offs < 0
    if NUM_TILES == 1:  # the whole row stays in registers
        key0, valid0 = _keys(scores_ptr, allowed_ptr, t, stride_st, stride_at, offs, nvis, HAS_ALLOWED)
    # The K-th largest key, DIGIT bits a pass from the top, in the unsigned order of key + 2^31: prefix is the
    # largest value whose count of keys >= it is still >= K. cnt is that count where a pass found it (0: unknown);
    # with EARLY a row stops as soon as it is exactly K, since the keys >= prefix are then the chosen set.
    if SEARCH == 1:
        thr = _interp_threshold(scores_ptr, allowed_ptr, t, stride_st, stride_at, offs, nvis, key0, valid0, K,
                                HAS_ALLOWED, BLOCK, NUM_TILES, EARLY)
    else:
        FIELD: tl.constexpr = 21 if DIGIT > 1 else 63
        prefix = tl.full([], 0, dtype=tl.int64)
        # A row of at most K visible entries takes all it may choose: prefix 0, no pass (with EARLY).
        cnt = tl.where(nvis <= K, K, 0).to(tl.int64)
        b = tl.full([], 0, dtype=tl.int64)
        while (b < 32) & ((cnt != K) | (not EARLY)):
            shift = 32 - DIGIT - b
            total = _count_at_least(scores_ptr, allowed_ptr, t, stride_st, stride_at, offs, nvis, key0, valid0,
                                    prefix, shift, HAS_ALLOWED, BLOCK, NUM_TILES, DIGIT, FIELD)
            best = tl.full([], 0, dtype=tl.int64)
            for c in tl.static_range(1, 1 << DIGIT):  # counts fall as c grows: the last one still >= K wins
                n_c = (total >> (FIELD * (c - 1))) & ((1 << FIELD) - 1)
                best = tl.where(n_c >= K, c, best)
                cnt = tl.where(n_c >= K, n_c, cnt)
            prefix = prefix | (best << shift)
            b += DIGIT
        # INT32_MIN (below every key) when fewer than K may be chosen. Where a row stopped early, the keys at thr
        # are all chosen (ties by budget: exactly K keys reach it), so the set is the full search's.
        thr = (prefix - 2147483648).to(tl.int32)
    # Entries above the threshold, then ties at it by ascending id while the budget lasts.
    above = tl.full([], 0, dtype=tl.int32)
    n_eq = tl.full([], 0, dtype=tl.int32)
    for i in range(NUM_TILES):
        key, valid = _tile_keys(scores_ptr, allowed_ptr, t, stride_st, stride_at, i, offs, nvis, key0, valid0,
                                HAS_ALLOWED, BLOCK, NUM_TILES)
        above += tl.sum(((key > thr) & valid).to(tl.int32), axis=0)
        if LAZY_TIES:
            n_eq += tl.sum(((key == thr) & valid).to(tl.int32), axis=0)
    budget = K - above
    every_tie = False  # (a compile-time False unless LAZY_TIES: the shipped launch has no branch here)
    if LAZY_TIES:
        every_tie = n_eq <= budget  # all keys at thr are taken: no prefix sum of the ties
    taken = tl.full([], 0, dtype=tl.int32)
    ties = tl.full([], 0, dtype=tl.int32)
    for i in range(NUM_TILES):
        j = i * BLOCK + offs
        key, valid = _tile_keys(scores_ptr, allowed_ptr, t, stride_st, stride_at, i, offs, nvis, key0, valid0,
                                HAS_ALLOWED, BLOCK, NUM_TILES)
        eq = (valid & (key == thr)).to(tl.int32)
        if every_tie:
            take = valid & (key >= thr)
        else:
            take = (valid & (key > thr)) | ((eq != 0) & (ties + tl.cumsum(eq, axis=0) <= budget))
        at = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + t * stride_ot + at, j.to(tl.int64), mask=take)
        taken += tl.sum(take.to(tl.int32), axis=0)
        ties += tl.sum(eq, axis=0)
    for i in range(NUM_KT):
        kk = i * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + t * stride_ot + kk, tl.full([BLOCK_K], -1, dtype=tl.int64), mask=(kk >= taken) & (kk < K))


def _check_visibility(Tq: int, J: int, num_visible, allowed) -> None:
    if not torch.is_tensor(num_visible) or num_visible.shape != (Tq,) \
            or num_visible.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"num_visible must be an int32/int64 tensor [Tq={Tq}], got "
                         f"{getattr(num_visible, 'dtype', type(num_visible))} "
                         f"{tuple(getattr(num_visible, 'shape', ()))}")
    if allowed is not None and (allowed.dtype != torch.bool or allowed.shape != (Tq, J)):
        raise ValueError(f"allowed must be a bool tensor [Tq={Tq}, J={J}] or None, got {allowed.dtype} "
                         f"{tuple(allowed.shape)}")


def topk_select(scores: torch.Tensor, num_visible: torch.Tensor, k: int,
                allowed: Optional[torch.Tensor] = None, block: Optional[int] = None,
                num_warps: Optional[int] = None, digit: Optional[int] = None,
                early: Optional[bool] = None, search: Optional[int] = None,
                lazy_ties: Optional[bool] = None) -> torch.Tensor:
    """Top-k entry ids per row of scores [Tq, J] float32 among entries j < num_visible[t] (and allowed[t, j])
    scored above -inf: [Tq, k] int64 in ascending id order, -1 after the last. The same set as select_topk
    (ties to the lower id). digit / early / search / lazy_ties: TOPK_DIGIT / TOPK_EARLY / TOPK_SEARCH /
    TOPK_LAZY_TIES for this call."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [Tq, J], got {scores.dtype} {tuple(scores.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    digit = TOPK_DIGIT if digit is None else digit
    if digit not in (1, 2) or isinstance(digit, bool):
        raise ValueError(f"digit must be 1 or 2, got {digit!r}")
    search = TOPK_SEARCH if search is None else search
    if search not in (0, 1) or isinstance(search, bool):
        raise ValueError(f"search must be 0 (bits) or 1 (interpolation), got {search!r}")
    Tq, J = scores.shape
    _check_visibility(Tq, J, num_visible, allowed)
    out = torch.empty((Tq, k), dtype=torch.int64, device=scores.device)
    if Tq == 0:
        return out
    if J == 0:
        return out.fill_(-1)
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    if allowed is not None and allowed.stride(1) != 1:
        allowed = allowed.contiguous()
    if block is None:
        # Whole rows in registers up to 16K entries (the 33 passes re-read a longer row from L2 each time): a
        # 16K prefill's 2048-query chunk over 8192 entries took 335 us in one tile against 727 in two of 4096.
        block = 32 if INTERPRET else min(16384, max(128, next_pow2(J)))
    if num_warps is None:
        # 4 warps up to 8K (64 keys a thread: 37th session, H100, an 8K row's chunk 167.5 us against 204.2 on 8 warps
        # with the interpolation search and lazy ties), 8 for 16K (64 a thread again)
        num_warps = 4 if block <= 8192 else 8
    num_tiles = cdiv(J, block)
    if J >= 1 << 21:  # a count no longer fits the packed 21-bit fields
        digit = 1
    block_k = min(next_pow2(k), 16 if INTERPRET else 1024)
    al = allowed.view(torch.uint8) if allowed is not None else scores
    _topk_kernel[(Tq,)](scores, num_visible.contiguous(), al, out, scores.stride(0),
                        al.stride(0) if allowed is not None else 0, out.stride(0), J, k,
                        HAS_ALLOWED=allowed is not None, BLOCK=block, NUM_TILES=num_tiles, BLOCK_K=block_k,
                        NUM_KT=cdiv(k, block_k), DIGIT=digit, EARLY=TOPK_EARLY if early is None else bool(early),
                        SEARCH=search, LAZY_TIES=TOPK_LAZY_TIES if lazy_ties is None else bool(lazy_ties),
                        num_warps=num_warps, **launch_kw(scores.device))
    return out


def supports(q: torch.Tensor, weights: torch.Tensor, codes: torch.Tensor, scales, fmt: str,
             entry_slots: torch.Tensor) -> bool:
    """Whether indexer_topk can run these inputs (otherwise use the reference op)."""
    if fmt not in GROUPS or scales is None or q.dim() != 3 or weights.dim() != 2 or entry_slots.dim() != 2:
        return False
    Tq, nh, dh = q.shape
    if q.dtype not in SUPPORTED_DTYPES or weights.dtype not in SUPPORTED_DTYPES or weights.shape != (Tq, nh):
        return False
    if not 0 < nh <= MAX_HEADS or not 0 < dh <= MAX_HEAD_DIM or dh % GROUPS[fmt] or q.stride(2) != 1:
        return False
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or codes.dim() != 2 or scales.dim() != 2:
        return False
    if codes.shape[1] != dh // 2 or scales.shape != (codes.shape[0], dh // GROUPS[fmt]):
        return False
    return codes.stride(1) == 1 and scales.stride(1) == 1 and entry_slots.dtype == torch.int64


def blocked(Tq: int, dtype: torch.dtype) -> bool:
    """Whether a call is prefill-sized for the score kernels (several queries a program)."""
    return Tq >= 64 and (INTERPRET or dtype != torch.float32)


def launch_config(nh: int, dh: int, Tq: int = 1, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The score kernel's tiles: BLOCK_Q queries' heads on the MMA's M side (at least 16 rows), BLOCK_J keys per
    program. From 64 queries (prefill, verify) a program takes as many queries as make 64 rows, so a key tile is
    decoded once for them (queries of one sequence; a block that spans sequences decodes each one's keys);
    decode keeps a query a program, for the grid's width. Compiled float32 keeps one (its FMA product would
    spill at 64 rows); the interpreter takes the 16-bit choice, so CPU tests run the blocked path."""
    BLOCK_H = max(16, next_pow2(nh))
    return {"BLOCK_Q": max(1, 64 // BLOCK_H) if blocked(Tq, dtype) else 1, "BLOCK_H": BLOCK_H,
            "BLOCK_D": max(32, next_pow2(dh)), "BLOCK_J": 16 if INTERPRET else (64 if dh <= 128 else 32),
            "num_warps": 4}


def launch_bounds(cfg: dict) -> dict:
    """What a caller's launch override may set on a score kernel's launch ``cfg`` (merge_launch's bounds): the
    query and key tiles, the warps; the head and channel tiles only at cfg's own (narrower would drop some)."""
    return {"BLOCK_Q": (1, 64, True), "BLOCK_H": (cfg["BLOCK_H"], cfg["BLOCK_H"], True),
            "BLOCK_D": (cfg["BLOCK_D"], cfg["BLOCK_D"], True), "BLOCK_J": (16, 256, True), "num_warps": (1, 16, True)}


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: str,
                 entry_slots: torch.Tensor, q_rows: torch.Tensor, num_visible: torch.Tensor, k: int,
                 allowed: Optional[torch.Tensor] = None, return_scores: bool = False,
                 launch: Optional[dict] = None, table: Optional[bool] = None):
    """CED indexer over FP4 keys in the paged cache.

    q [Tq, nh, dh] and weights [Tq, nh] (bf16/fp16/fp32); codes uint8 [N, dh // 2] and scales uint8
    [N, dh // G] the index-key cache in ``fmt`` ("mxfp4" or "fp4_e2m1_e4m3"); entry_slots [R, J] int64 the
    cache row of sequence r's entry j; q_rows [Tq] int64 each query's sequence; num_visible [Tq] entries
    0 .. n-1 are visible; allowed [Tq, J] bool or None narrows them further. Returns (ids [Tq, k] int64
    ascending, -1 after the last; scores [Tq, J] float32 with -inf past num_visible, or None). ``table``: the
    scores from a decoded key table (triton_ced_scores) or not; None lets triton_ced_scores.wanted decide.
    ``launch`` overrides the chosen score kernel's launch keys (tests and benchmarks/ced_prefill_kernels.py).
    """
    if not supports(q, weights, codes, scales, fmt, entry_slots):
        raise ValueError(f"indexer_topk: unsupported inputs: q {q.dtype} {tuple(q.shape)}, weights "
                         f"{weights.dtype} {tuple(weights.shape)}, codes {codes.dtype} {tuple(codes.shape)}, "
                         f"scales {getattr(scales, 'dtype', None)} {tuple(getattr(scales, 'shape', ()))}, "
                         f"fmt {fmt!r}, entry_slots {entry_slots.dtype} {tuple(entry_slots.shape)}")
    Tq, nh, dh = q.shape
    J = entry_slots.shape[1]
    if q_rows.shape != (Tq,) or q_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"q_rows must be an int tensor [Tq={Tq}], got {q_rows.dtype} {tuple(q_rows.shape)}")
    _check_visibility(Tq, J, num_visible, allowed)
    scores = torch.empty((Tq, J), dtype=torch.float32, device=q.device)
    if Tq and J:
        if entry_slots.stride(1) != 1:
            entry_slots = entry_slots.contiguous()
        from . import triton_ced_scores as tcs  # (it imports this module's _head_scores)

        if tcs.wanted(Tq, entry_slots.shape[0], J, dh, q.dtype, blocked(Tq, q.dtype)) if table is None else table:
            keys = tcs.key_table(codes, scales, fmt, entry_slots, q.dtype)
            tcs.scores(q, weights, keys, J, q_rows.contiguous(), num_visible.contiguous(), scores, launch)
        else:
            cfg = launch_config(nh, dh, Tq, q.dtype)
            cfg = merge_launch("indexer_topk", cfg, launch, launch_bounds(cfg))
            BQ, BJ, BD = cfg["BLOCK_Q"], cfg["BLOCK_J"], cfg["BLOCK_D"]
            _score_kernel[(cdiv(Tq, BQ), cdiv(J, BJ))](
                q, weights, codes, scales, entry_slots, q_rows.contiguous(), num_visible.contiguous(), scores,
                q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), codes.stride(0), scales.stride(0),
                entry_slots.stride(0), scores.stride(0), Tq, nh, dh, J,
                BLOCK_Q=BQ, BLOCK_H=cfg["BLOCK_H"], BLOCK_D=BD, BLOCK_J=BJ, GROUP=GROUPS[fmt], E8M0=fmt == "mxfp4",
                FAST=fast_decode(q.dtype, BJ * BD // 2, cfg["num_warps"]),
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=cfg["num_warps"],
                **launch_kw(q.device))
    ids = topk_select(scores, num_visible, k, allowed)
    return ids, (scores if return_scores else None)
