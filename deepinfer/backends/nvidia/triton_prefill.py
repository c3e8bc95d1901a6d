"""Ragged paged prefill attention in Triton: flash attention (FA2-style online softmax) over the paged cache.

One call serves a whole step's rows: prefill chunks with or without a cached prefix, and decode rows
mixed in. Row b's queries are rows cu_q[b] .. cu_q[b+1]-1 of q; query i of a row with n queries sits at
position seq_len - n + i and sees the keys at positions <= its own (and, with a window, > pos - window).

Tiling. The query heads that share a KV head (GQA/MQA) are packed into the M side of the tile with the
queries: packed row r of a row is (query r // G, head r % G), so each key and value row is read once per
KV head and tile, and decode rows (one query) still fill G rows of the tile. Each program owns one
(row, M tile) of BLOCK_M packed rows and one KV head. The grid is sized from shapes only,
min(B * cdiv(max_q * G, BLOCK_M), cdiv(T * G, BLOCK_M) + B) tiles by Hk: at the start every program
scans cu_q (a prefix sum of the rows' tile counts) to find its row, and programs past the last tile exit;
so a mixed batch of many decode rows and one long prefill launches no sea of empty programs. Within a
row the M tiles run last-first (the longest, most causal work starts first), which shortens the tail.

Each program walks the keys [lo, hi) its tile can see, BLOCK_N at a time, finding every key's cache slot
through the block table (any block size; nothing is gathered into a copy). Tiles wholly inside every
query's visible range (below the causal diagonal and inside the window) take a loop without masks; only
the diagonal tiles and the window's leading edge compute the mask. Key tiles above the diagonal and
before the window are never read. Head dims that are not powers of two are split in two power-of-two
parts (192 = 128 + 64, 576 = 512 + 64, 96 = 64 + 32) rather than padded, so MLA's shapes waste no MMA
work; when V is exactly the first K part (MLA's absorbed latent: V = K[..., :512]) that K tile is reused
as V instead of being loaded again.

Supports GQA/MQA (H a multiple of Hk), a sliding window, per-head sinks (a logit that joins only the
softmax denominator), Dv != D, and arbitrary strides on the caches' slot and head dims (MLA passes V as a
strided prefix view of K's storage). bf16/fp16/fp32 inputs. No host sync: the launch can be captured in
a CUDA graph (max_q is a host int bound, and only shapes pick the grid and the tile sizes). Rows of q past
cu_q[B] belong to no row and are left unwritten in the output.

Precision: as the decode kernel. Scores come from the tensor cores with float32 accumulation (float32
inputs use the "ieee" dot, not tf32); the probabilities are rounded to V's dtype for the second product;
the softmax state and the output accumulator are float32. Expect a relative error of a few 1e-3 in bf16
and ~1e-7 in float32 against a float64 oracle.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_attention import LOG2E, finish_softmax
from .triton_norm import cast_rne, to_f32
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 1024  # beyond 576/512 the accumulator spills; correct, not tuned
MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dim (the KV heads)


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in float32, the accumulator handed to the MMA (wgmma accumulates in place). Triton's
    interpreter multiplies bf16 as raw bits, so there the operands are upcast first (exact: a bf16 product
    fits in float32)."""
    if _INTERP:
        return tl.dot(to_f32(a), to_f32(b), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _load_cols(row_ptrs, COL0: tl.constexpr, WIDTH: tl.constexpr, NCOL: tl.constexpr, row_mask,
               MASK_ROWS: tl.constexpr):
    """[R, WIDTH] columns COL0 .. COL0 + WIDTH - 1 of the rows starting at row_ptrs [R]. Columns >= NCOL,
    and with MASK_ROWS the rows outside row_mask, read as 0; the masks are left out where they are all true."""
    cols = COL0 + tl.arange(0, WIDTH)
    ptrs = row_ptrs[:, None] + cols[None, :]
    if COL0 + WIDTH <= NCOL:
        if MASK_ROWS:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        if MASK_ROWS:
            x = tl.load(ptrs, mask=row_mask[:, None] & (cols < NCOL)[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=(cols < NCOL)[None, :], other=0.0)
    return x


@triton.jit
def _attend_tile(acc, m_i, l_i, q1, q2, t0, hi, pos, window, k_base, v_base, bt_row, stride_ks, stride_vs,
                 qk_scale, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HEAD_D: tl.constexpr,
                 HEAD_DV: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr,
                 BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, V_FROM_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One online-softmax step over keys t0 .. t0 + BLOCK_N - 1. Unmasked tiles hold only keys every packed
    row sees; masked ones apply causality, the window and the tile's end ``hi`` per row. V_FROM_K: V is
    exactly K's first block of columns (MLA's latent), so the K tile already loaded serves as V."""
    toks = t0 + tl.arange(0, BLOCK_N)
    k_valid = toks < hi
    if MASKED:
        block_id = tl.load(bt_row + toks // BLOCK_SIZE, mask=k_valid, other=0)
    else:
        block_id = tl.load(bt_row + toks // BLOCK_SIZE)
    slot = block_id.to(tl.int64) * BLOCK_SIZE + toks % BLOCK_SIZE  # [BLOCK_N] cache rows
    k_rows = k_base + slot * stride_ks
    k1 = _load_cols(k_rows, 0, BLOCK_D1, HEAD_D, k_valid, MASKED)  # [BLOCK_N, BLOCK_D1]
    s = _mma(q1, tl.trans(k1), tl.zeros([q1.shape[0], BLOCK_N], dtype=tl.float32), DOT_PRECISION)
    if BLOCK_D2 > 0:
        k2 = _load_cols(k_rows, BLOCK_D1, BLOCK_D2, HEAD_D, k_valid, MASKED)
        s = _mma(q2, tl.trans(k2), s, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        vis = (toks[None, :] <= pos[:, None]) & k_valid[None, :]
        if HAS_WINDOW:
            vis = vis & (toks[None, :] > pos[:, None] - window)
        s = tl.where(vis, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row may see none of this tile's keys (and none before it, at the window's edge): keep it at 0/0.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # qk_scale > 0, log2 units
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if V_FROM_K:
        v = k1
    else:
        v = _load_cols(v_base + slot * stride_vs, 0, BLOCK_DV, HEAD_DV, k_valid, MASKED)  # [BLOCK_N, BLOCK_DV]
    acc = _mma(cast_rne(p, v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _scan_rows(cu_q_ptr, c0, tile, row, skip, total, B, G, BLOCK_M: tl.constexpr, SCAN: tl.constexpr):
    """Rows c0 .. c0 + SCAN - 1 of the tile prefix sum: counts the rows (and their tiles) that end at or
    before ``tile``."""
    idx = c0 + tl.arange(0, SCAN)
    in_b = idx < B
    start = tl.load(cu_q_ptr + idx, mask=in_b, other=0)
    stop = tl.load(cu_q_ptr + idx + 1, mask=in_b, other=0)
    tiles = tl.cdiv((stop - start) * G, BLOCK_M).to(tl.int32)
    ends = tl.cumsum(tiles, axis=0) + total
    done = in_b & (ends <= tile)
    row += tl.sum(done.to(tl.int32), axis=0)
    skip += tl.sum(tl.where(done, tiles, 0), axis=0)
    total += tl.sum(tiles, axis=0)
    return row, skip, total


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_q_ptr, lens_ptr, sinks_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    qk_scale, window, B, G,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, SCAN: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, V_FROM_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERP_LOOP: tl.constexpr, SCAN_ITERS: tl.constexpr, MAX_TILES: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)

    # Find this program's row: the rows whose tiles all come before ``tile``, and how many tiles they hold.
    row = tile * 0
    skip = tile * 0
    total = tile * 0
    if INTERP_LOOP:
        # Triton's interpreter cannot take tensor loop bounds under numpy >= 2.4 (triton-lang/triton#9171):
        # walk host-side constant bounds instead (here and in the key loop below).
        for c in range(0, SCAN_ITERS):
            row, skip, total = _scan_rows(cu_q_ptr, c * SCAN, tile, row, skip, total, B, G, BLOCK_M, SCAN)
    else:
        for c0 in range(0, B, SCAN):
            row, skip, total = _scan_rows(cu_q_ptr, c0, tile, row, skip, total, B, G, BLOCK_M, SCAN)
    if row >= B:
        return  # past the last tile

    # Index math in int32 (positions and token rows fit; 64-bit vectors cost registers that a head dim of
    # 512 cannot spare); offsets are widened to 64 bits only where they become pointers.
    q_start = tl.load(cu_q_ptr + row).to(tl.int32)
    n = tl.load(cu_q_ptr + row + 1).to(tl.int32) - q_start
    seq_len = tl.load(lens_ptr + row).to(tl.int32)
    packed = n * G
    mt = tl.cdiv(packed, BLOCK_M) - 1 - (tile - skip)  # the row's M tiles, last (most work) first
    r = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    r_valid = r < packed
    qi = r // G
    ctx0 = seq_len - n  # position of the row's first query
    pos = ctx0 + qi  # [BLOCK_M]

    # Keys [lo, hi) are visible to some packed row of the tile; [full_lo, pos_first] to all of them.
    pos_first = ctx0 + (mt * BLOCK_M) // G
    pos_last = ctx0 + (tl.minimum((mt + 1) * BLOCK_M, packed) - 1) // G
    hi = pos_last + 1
    if HAS_WINDOW:
        lo = tl.maximum(pos_first - window + 1, 0)
        full_lo = tl.maximum(pos_last - window + 1, 0)
    else:
        lo = hi * 0
        full_lo = lo
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    j_a = tl.cdiv(full_lo - lo, BLOCK_N)  # tiles [0, j_a): the window's leading edge, masked
    j_b = tl.maximum((pos_first + 1 - lo) // BLOCK_N, j_a)  # [j_a, j_b): unmasked; [j_b, n_tiles): diagonal

    q_rows = q_ptr + (q_start + qi).to(tl.int64) * stride_qt + (kvh * G + r % G).to(tl.int64) * stride_qh
    q1 = _load_cols(q_rows, 0, BLOCK_D1, HEAD_D, r_valid, True)  # [BLOCK_M, BLOCK_D1]
    if BLOCK_D2 > 0:
        q2 = _load_cols(q_rows, BLOCK_D1, BLOCK_D2, HEAD_D, r_valid, True)
    else:
        q2 = q1  # unused

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    bt_row = bt_ptr + row.to(tl.int64) * stride_bt

    if INTERP_LOOP:
        for j in range(0, MAX_TILES):
            if j < n_tiles:
                if (j < j_a) | (j >= j_b):
                    acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q1, q2, lo + j * BLOCK_N, hi, pos, window, k_base,
                                                 v_base, bt_row, stride_ks, stride_vs, qk_scale, True, HAS_WINDOW,
                                                 HEAD_D, HEAD_DV, BLOCK_SIZE, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV,
                                                 V_FROM_K, DOT_PRECISION)
                else:
                    acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q1, q2, lo + j * BLOCK_N, hi, pos, window, k_base,
                                                 v_base, bt_row, stride_ks, stride_vs, qk_scale, False, HAS_WINDOW,
                                                 HEAD_D, HEAD_DV, BLOCK_SIZE, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV,
                                                 V_FROM_K, DOT_PRECISION)
    else:
        if HAS_WINDOW:
            for j in range(0, j_a):
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q1, q2, lo + j * BLOCK_N, hi, pos, window, k_base,
                                             v_base, bt_row, stride_ks, stride_vs, qk_scale, True, HAS_WINDOW,
                                             HEAD_D, HEAD_DV, BLOCK_SIZE, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV,
                                             V_FROM_K, DOT_PRECISION)
        for j in range(j_a, j_b):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q1, q2, lo + j * BLOCK_N, hi, pos, window, k_base,
                                         v_base, bt_row, stride_ks, stride_vs, qk_scale, False, HAS_WINDOW,
                                         HEAD_D, HEAD_DV, BLOCK_SIZE, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV,
                                         V_FROM_K, DOT_PRECISION)
        for j in range(j_b, n_tiles):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q1, q2, lo + j * BLOCK_N, hi, pos, window, k_base,
                                         v_base, bt_row, stride_ks, stride_vs, qk_scale, True, HAS_WINDOW,
                                         HEAD_D, HEAD_DV, BLOCK_SIZE, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV,
                                         V_FROM_K, DOT_PRECISION)

    heads = kvh * G + r % G  # recomputed rather than held through the loops
    o = finish_softmax(acc, m_i, l_i, sinks_ptr + heads, r_valid, HAS_SINKS)
    dv_off = tl.arange(0, BLOCK_DV)
    out_rows = out_ptr + (q_start + qi).to(tl.int64) * stride_ot + heads.to(tl.int64) * stride_oh
    out_ptrs = out_rows[:, None] + dv_off[None, :]
    tl.store(out_ptrs, cast_rne(o, out_ptr.dtype.element_ty), mask=r_valid[:, None] & (dv_off < HEAD_DV)[None, :])


def split_head_dim(D: int) -> tuple:
    """(BLOCK_D1, BLOCK_D2): D as one power-of-two block, or as two (192 = 128 + 64) where two waste less
    of the MMA's K side than padding to the next power of two. BLOCK_D2 = 0: one block."""
    p = next_pow2(max(D, 16))
    if D == p or D <= 16:
        return p, 0
    first = p // 2
    rest = next_pow2(max(D - first, 16))
    return (first, rest) if first + rest < p else (p, 0)


def launch_config(D: int, Dv: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch options from shapes only (deterministic, capture-safe; no autotuning).

    bf16/fp16 on sm_90: 128 packed rows with 8 warps (two warpgroups of wgmma, 64 rows each) and a
    3-stage cp.async pipeline; 64 keys per step up to D = 192 / Dv = 128 (189 registers at 128/128, 216 at
    192/128), 32 keys at 256/256; MLA's absorbed 576/512 takes 64 rows by 16 keys (acc [64, 512] float32
    alone is 128 registers a thread). float32 (the ieee dot: no tensor cores; tests and small models) uses
    small tiles. Numbers read from ptxas for sm_90 (tests/test_triton_prefill.py compiles these configs
    and checks that no loop spills). Under the interpreter, tiny tiles so that small tests cross edges."""
    d1, d2 = split_head_dim(D)
    dv = next_pow2(max(Dv, 16))
    cfg = {"BLOCK_D1": d1, "BLOCK_D2": d2, "BLOCK_DV": dv}
    if INTERPRET:
        return {**cfg, "BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    dk = d1 + d2
    big = max(dk, dv)
    if dtype == torch.float32:
        bm, bn, warps, stages = (32, 16, 4, 2) if big <= 128 else (16, 16, 4, 2)
    elif big <= 256:
        bm, bn, warps, stages = 128, (64 if dk + dv <= 320 else 32), 8, 3
    else:
        bm, bn, warps, stages = 64, 16, 8, 3
    return {**cfg, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table, block_size: int,
             cu_q, seq_lens, sinks: Optional[torch.Tensor] = None) -> bool:
    """Whether paged_prefill can run these inputs (otherwise use the reference op)."""
    if block_table is None or cu_q is None or seq_lens is None or block_size <= 0:
        return False
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        return False
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    T, H, D = q.shape
    Hk, Dv = k_cache.shape[1], v_cache.shape[2]
    if Hk == 0 or H % Hk or k_cache.shape[2] != D or v_cache.shape[:2] != k_cache.shape[:2]:
        return False
    if not (0 < D <= MAX_HEAD_DIM and 0 < Dv <= MAX_HEAD_DIM) or Hk > MAX_GRID_Y or T * (H // Hk) >= 2**31:
        return False
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        return False
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        return False
    B = block_table.shape[0]
    if cu_q.dim() != 1 or cu_q.shape[0] != B + 1 or cu_q.dtype not in (torch.int32, torch.int64):
        return False
    if seq_lens.dim() != 1 or seq_lens.shape[0] != B or seq_lens.dtype not in (torch.int32, torch.int64):
        return False
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != H):
        return False
    return True


def _check(q, k_cache, v_cache, block_table, block_size, cu_q, seq_lens, max_q, scale, window, sinks) -> None:
    """ValueError naming the first bad argument."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache/v_cache dtype must match q ({q.dtype}), got {k_cache.dtype}/{v_cache.dtype}")
    T, H, D = q.shape
    Hk = k_cache.shape[1]
    if Hk == 0 or H % Hk:
        raise ValueError(f"q's heads ({H}) must be a multiple of k_cache's KV heads ({Hk})")
    if k_cache.shape[2] != D:
        raise ValueError(f"k_cache head dim {k_cache.shape[2]} != q head dim {D}")
    if v_cache.shape[:2] != k_cache.shape[:2]:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)} "
                         f"on slots and heads")
    if not (0 < D <= MAX_HEAD_DIM and 0 < v_cache.shape[2] <= MAX_HEAD_DIM):
        raise ValueError(f"head dims must be in 1..{MAX_HEAD_DIM}, got D={D}, Dv={v_cache.shape[2]}")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("k_cache and v_cache must have unit stride on the head dim")
    if Hk > MAX_GRID_Y:
        raise ValueError(f"k_cache has {Hk} KV heads; at most {MAX_GRID_Y} are supported")
    if T * (H // Hk) >= 2**31:
        raise ValueError(f"q has too many rows for 32-bit tile indexing: T={T} x {H // Hk} heads per KV head")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be a 2-D int32/int64 tensor, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    B = block_table.shape[0]
    if int(block_size) <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if cu_q.dim() != 1 or cu_q.shape[0] != B + 1 or cu_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_q must be an int32/int64 tensor of shape [{B + 1}] (block_table rows + 1), got "
                         f"{cu_q.dtype} {tuple(cu_q.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != B or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be an int32/int64 tensor of shape [{B}], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if int(max_q) < 0 or (T > 0 and B > 0 and int(max_q) == 0):
        raise ValueError(f"max_q must be >= 1 (the most queries of any row), got {max_q}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if window is not None and int(window) < 1:
        raise ValueError(f"window must be None or >= 1, got {window}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != H):
        raise ValueError(f"sinks must have shape [{H}], got {tuple(sinks.shape)}")
    devs = {t.device for t in (q, k_cache, v_cache, block_table, cu_q, seq_lens, sinks) if t is not None}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  block_size: int, cu_q: torch.Tensor, seq_lens: torch.Tensor, max_q: int, scale: float,
                  window: Optional[int] = None, sinks: Optional[torch.Tensor] = None, *,
                  block_m: Optional[int] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """Causal attention of ragged queries over a paged cache (prefill chunks, decode rows, or a mix).

    q [T, H, D]: row b's queries are rows cu_q[b] .. cu_q[b+1]-1 (cu_q [B+1], non-decreasing, cu_q[0] = 0);
    k_cache [slots, Hk, D], v_cache [slots, Hk, Dv] (any strides on the first two dims); block_table
    [B, NB] block ids; seq_lens [B] context lengths after this step (the keys are already in the cache);
    max_q: a host int >= every row's query count (sizes the grid without a host sync). Query i of row b
    sits at position seq_lens[b] - n_b + i and sees keys at positions <= its own (with ``window``, also
    > pos - window); sinks [H] or None. block_m / block_n override the tile sizes (tests). Returns
    [T, H, Dv] in q's dtype.
    """
    _check(q, k_cache, v_cache, block_table, block_size, cu_q, seq_lens, max_q, scale, window, sinks)
    T, H, D = q.shape
    Hk, Dv = k_cache.shape[1], v_cache.shape[2]
    G = H // Hk
    B = block_table.shape[0]
    out = torch.empty((T, H, Dv), dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    # Small per-row tensors the kernel indexes with unit stride (no-ops when already so).
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    cu_q = cu_q.contiguous()
    seq_lens = seq_lens.contiguous()
    if sinks is not None:
        sinks = sinks.contiguous()
    cfg = launch_config(D, Dv, q.dtype)
    bm = int(block_m) if block_m is not None else cfg["BLOCK_M"]
    bn = int(block_n) if block_n is not None else cfg["BLOCK_N"]
    least = 8 if INTERPRET else 16  # tl.dot's K side (BLOCK_N in P @ V) is at least 16 when compiled
    for name, v in (("block_m", bm), ("block_n", bn)):
        if v < least or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {v}")
    # Every row holds cdiv(n_b * G, bm) tiles; both bounds below hold, from shapes alone.
    tiles = min(B * cdiv(int(max_q) * G, bm), cdiv(T * G, bm) + B)
    scan = 16 if INTERPRET else 128
    has_sinks = sinks is not None
    # MLA: V is the first Dv channels of K's own rows; when those are exactly K's first tile, reuse it.
    v_from_k = (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride()[:2] == k_cache.stride()[:2]
                and Dv == cfg["BLOCK_D1"])
    _prefill_kernel[(tiles, Hk)](
        q, k_cache, v_cache, block_table, cu_q, seq_lens, sinks if has_sinks else q, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        float(scale) * LOG2E, int(window) if window is not None else 0, B, G,
        HEAD_D=D, HEAD_DV=Dv, BLOCK_SIZE=int(block_size), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_D1=cfg["BLOCK_D1"], BLOCK_D2=cfg["BLOCK_D2"], BLOCK_DV=cfg["BLOCK_DV"], SCAN=scan,
        HAS_WINDOW=window is not None, HAS_SINKS=has_sinks, V_FROM_K=v_from_k,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERP_LOOP=INTERPRET, SCAN_ITERS=cdiv(B, scan) if INTERPRET else 0,
        MAX_TILES=cdiv(block_table.shape[1] * int(block_size), bn) + 1 if INTERPRET else 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
