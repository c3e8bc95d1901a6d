"""Paged decode attention in Triton: one query per row, read straight from the paged KV cache.

Each program owns one (row, KV head, head tile, context split). It walks its share of the row's visible
keys BLOCK_N tokens at a time, finding every token's cache slot through the block table (so any block
size works and nothing is gathered into a copy), and keeps an online softmax in float32: the running
max ``m``, the running denominator ``l`` and the unnormalised output ``acc``. The query heads that share
a KV head (GQA) form the M side of the two small matrix products, padded up to 16 rows, so each key and
value row is read once per KV head, not once per query head.

When the grid would be too small to fill the GPU (few rows, long contexts), the context is split
(flash-decoding): every split writes its (m, l, acc) partials and a second kernel merges them. The split
count depends on shapes only (never on values), so the launch is safe inside a CUDA graph capture.

Supports GQA/MQA (H a multiple of Hk), a sliding window, per-head sinks (a logit that joins only the
softmax denominator), head dims that are not powers of two, Dv != D, and arbitrary strides on the cache's
slot and head dims (MLA passes V as a strided prefix view of K's storage). bf16/fp16/fp32 inputs.
With a window only the window's keys are read.

Precision: scores come from the tensor cores with float32 accumulation (products of bf16/fp16 operands
are exact; float32 inputs use the "ieee" dot, not tf32); the probabilities are rounded to V's dtype for
the second product (as flash attention does), everything else is float32. Expect a relative error of a
few 1e-3 in bf16 and ~1e-7 in float32 against a float64 oracle.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_norm import cast_rne, to_f32
from .triton_pdl import launch_kw, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b with float32 accumulation. Triton's interpreter multiplies bf16 operands as their raw uint16
    bits, so there they are upcast first (exact: a bf16 product fits in float32)."""
    if _INTERP:
        return tl.dot(to_f32(a), to_f32(b))
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def finish_softmax(acc, m_i, l_i, sink_ptrs, row_mask, HAS_SINKS: tl.constexpr):
    """acc / l for a tile of rows at the end of an online softmax (log2 domain), each row's sink logit (loaded
    from ``sink_ptrs`` when HAS_SINKS) joining only the denominator; rows that saw no key give 0."""
    if HAS_SINKS:
        sink = to_f32(tl.load(sink_ptrs, mask=row_mask, other=0.0)) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        scale_old = tl.exp2(m_i - m_f)
        l_i = l_i * scale_old + tl.exp2(sink - m_f)
        acc = acc * scale_old[:, None]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    return acc / l_safe[:, None]


@triton.jit
def _attend_tile(q, m_i, l_i, acc, t0, end, k_base, v_base, bt_row, stride_ks, stride_vs, qk_scale,
                 d_off, d_mask, dv_off, dv_mask,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over keys t0 .. t0 + BLOCK_N - 1 (those < end)."""
    toks = t0 + tl.arange(0, BLOCK_N)
    t_mask = toks < end
    block_id = tl.load(bt_row + toks // BLOCK_SIZE, mask=t_mask, other=0)
    slot = block_id.to(tl.int64) * BLOCK_SIZE + toks % BLOCK_SIZE  # [BLOCK_N] cache rows
    k = tl.load(k_base + slot[:, None] * stride_ks + d_off[None, :],
                mask=t_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
    s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has at least one visible key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + slot[:, None] * stride_vs + dv_off[None, :],
                mask=t_mask[:, None] & dv_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
    acc = acc * alpha[:, None] + _dot(cast_rne(p, v.dtype), v, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qpos_ptr, sinks_ptr,
    out_ptr, mid_m_ptr, mid_l_ptr, mid_o_ptr,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_bt,
    stride_qpos,
    stride_ot, stride_oh,
    qk_scale, window,
    H, G, D, DV, NUM_SPLITS,
    NUM_GT: tl.constexpr, DIRECT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERP_LOOP: tl.constexpr, MAX_TILES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets throughout
    pid1 = tl.program_id(1)
    split = tl.program_id(2)
    kvh = pid1 // NUM_GT
    gt = pid1 % NUM_GT

    g_off = gt * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g_off < G
    heads = kvh * G + g_off  # query heads of this tile
    d_off = tl.arange(0, BLOCK_D)
    d_mask = d_off < D
    dv_off = tl.arange(0, BLOCK_DV)
    dv_mask = dv_off < DV

    # Visible keys of this row: positions [lo, hi).
    seq_len = tl.load(lens_ptr + b)
    qp = tl.load(qpos_ptr + b * stride_qpos)
    hi = tl.minimum(seq_len, qp + 1)
    if HAS_WINDOW:
        lo = tl.maximum(qp - window + 1, 0)
    else:
        lo = qp * 0
    n = tl.maximum(hi - lo, 0)
    # This split's share, in whole BLOCK_N tiles.
    per_split = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, hi)

    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d_off[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    bt_row = bt_ptr + b * stride_bt

    if INTERP_LOOP:
        # Triton's interpreter cannot take tensor loop bounds under numpy >= 2.4 (triton-lang/triton#9171):
        # walk a host-side upper bound of tiles and skip those past this split's end.
        for it in range(0, MAX_TILES):
            t0 = start + it * BLOCK_N
            if t0 < end:
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, t0, end, k_base, v_base, bt_row, stride_ks,
                                             stride_vs, qk_scale, d_off, d_mask, dv_off, dv_mask, BLOCK_SIZE,
                                             BLOCK_N, DOT_PRECISION)
    else:
        for t0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, t0, end, k_base, v_base, bt_row, stride_ks, stride_vs,
                                         qk_scale, d_off, d_mask, dv_off, dv_mask, BLOCK_SIZE, BLOCK_N,
                                         DOT_PRECISION)

    if DIRECT:  # one split: finish here
        o = finish_softmax(acc, m_i, l_i, sinks_ptr + heads, g_mask, HAS_SINKS)
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + dv_off[None, :],
                 cast_rne(o, out_ptr.dtype.element_ty), mask=g_mask[:, None] & dv_mask[None, :])
    else:
        # Partials laid out [B, H, NUM_SPLITS] (m, l) and [B, H, NUM_SPLITS, BLOCK_DV] (acc).
        ml_off = (b * H + heads) * NUM_SPLITS + split
        tl.store(mid_m_ptr + ml_off, m_i, mask=g_mask)
        tl.store(mid_l_ptr + ml_off, l_i, mask=g_mask)
        tl.store(mid_o_ptr + ml_off[:, None] * BLOCK_DV + dv_off[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _merge_kernel(
    mid_m_ptr, mid_l_ptr, mid_o_ptr, sinks_ptr, out_ptr,
    stride_ot, stride_oh, H, DV, NUM_SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dv_off = tl.arange(0, BLOCK_DV)
    o = merge_splits(mid_m_ptr, mid_l_ptr, mid_o_ptr, sinks_ptr, (b * H + h) * NUM_SPLITS, h, NUM_SPLITS,
                     BLOCK_S, BLOCK_DV, HAS_SINKS)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + dv_off, cast_rne(o, out_ptr.dtype.element_ty),
             mask=dv_off < DV)


@triton.jit
def merge_splits(mid_m_ptr, mid_l_ptr, mid_o_ptr, sinks_ptr, base, h, NUM_SPLITS,
                 BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr):
    """One (row, head)'s output [BLOCK_DV] float32 from its splits' partials (m, l at base + split, acc rows of
    BLOCK_DV) and head h's sink, not rounded."""
    s_off = tl.arange(0, BLOCK_S)
    s_mask = s_off < NUM_SPLITS
    dv_off = tl.arange(0, BLOCK_DV)
    m = tl.load(mid_m_ptr + base + s_off, mask=s_mask, other=float("-inf"))
    l = tl.load(mid_l_ptr + base + s_off, mask=s_mask, other=0.0)
    o = tl.load(mid_o_ptr + (base + s_off)[:, None] * BLOCK_DV + dv_off[None, :], mask=s_mask[:, None],
                other=0.0)  # [BLOCK_S, BLOCK_DV]
    m_max = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = to_f32(tl.load(sinks_ptr + h)) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    # Empty splits have m = -inf and l = acc = 0; guard the all-empty row (m_max = -inf) against NaN.
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_ref))  # [BLOCK_S]
    denom = tl.sum(l * w, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_ref)
    num = tl.sum(o * w[:, None], axis=0)  # [BLOCK_DV]
    denom = tl.where(denom > 0, denom, 1.0)
    return num / denom


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 for the interpreter, small so that tests
    exercise the split paths."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 1024


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table, block_size: int,
             sinks: Optional[torch.Tensor] = None) -> bool:
    """Whether paged_decode can run these inputs (otherwise use the reference op)."""
    if block_table is None or block_size <= 0:
        return False
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        return False
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    T, H, D = q.shape
    Hk = k_cache.shape[1]
    if Hk == 0 or H % Hk or k_cache.shape[2] != D or v_cache.shape[:2] != k_cache.shape[:2]:
        return False
    if D > MAX_HEAD_DIM or v_cache.shape[2] > MAX_HEAD_DIM or D == 0 or v_cache.shape[2] == 0:
        return False
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        return False
    if block_table.dim() != 2 or block_table.shape[0] != T or block_table.dtype not in (torch.int32, torch.int64):
        return False
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != H):
        return False
    return True


def launch_config(G: int, D: int, Dv: int) -> dict:
    """Tile sizes of the decode kernel. The query heads of one KV head fill the MMA's M side (at least 16
    rows, the smallest tensor-core tile; up to 32, then more head tiles); BLOCK_N keys per step. Chosen by
    reading ptxas' register/spill report for sm_90 (no spills at D 64/128/256 in bf16 and float32)."""
    BLOCK_D = next_pow2(max(D, 16))
    BLOCK_DV = next_pow2(max(Dv, 16))
    big = max(BLOCK_D, BLOCK_DV)
    return {
        "BLOCK_G": max(16, min(next_pow2(G), 32 if big <= 128 else 16)),
        "BLOCK_D": BLOCK_D,
        "BLOCK_DV": BLOCK_DV,
        "BLOCK_N": 16 if INTERPRET else (64 if big <= 128 else (32 if big <= 256 else 16)),
        "num_warps": 4 if big <= 64 else 8,
    }


def choose_splits(rows: int, kv_heads: int, head_tiles: int, max_ctx: int, device: torch.device,
                  block_n: int) -> int:
    """Context splits so the grid fills the GPU: about 4 programs per SM, each split at least one tile.
    Depends on shapes only (rows, heads, the block table's width), never on values."""
    programs = max(1, rows * kv_heads * head_tiles)
    want = cdiv(4 * sm_count(device), programs)
    most = max(1, max_ctx // block_n)
    return int(max(1, min(want, most, 64)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 block_size: int, seq_lens: torch.Tensor, q_pos: torch.Tensor, scale: float,
                 window: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
                 num_splits: Optional[int] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """Decode attention over a paged cache.

    q [B, H, D] (row b is sequence b's one query); k_cache [slots, Hk, D]; v_cache [slots, Hk, Dv] (any
    strides on the first two dims); block_table [B, NB] block ids; seq_lens [B] context lengths; q_pos [B]
    query positions (keys at positions <= q_pos and < seq_len are visible; with ``window`` also
    > q_pos - window); sinks [H] or None. Returns [B, H, Dv] in q's dtype.
    """
    B, H, D = q.shape
    Hk, Dv = k_cache.shape[1], v_cache.shape[2]
    G = H // Hk
    out = torch.empty((B, H, Dv), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    # Small per-row tensors the kernel indexes with unit stride (no-ops when already so).
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    if sinks is not None:
        sinks = sinks.contiguous()
    cfg = launch_config(G, D, Dv)
    BLOCK_G, BLOCK_D, BLOCK_DV = cfg["BLOCK_G"], cfg["BLOCK_D"], cfg["BLOCK_DV"]
    num_gt = cdiv(G, BLOCK_G)
    if block_n is None:
        block_n = cfg["BLOCK_N"]
    max_ctx = block_table.shape[1] * block_size
    if window is not None:
        max_ctx = min(max_ctx, int(window))
    S = num_splits if num_splits is not None else choose_splits(B, Hk, num_gt, max_ctx, q.device, block_n)
    S = max(1, int(S))
    if S > 1:
        mid_m = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
        mid_l = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
        mid_o = torch.empty((B, H, S, BLOCK_DV), dtype=torch.float32, device=q.device)
    else:
        mid_m = mid_l = mid_o = out  # unused
    has_sinks = sinks is not None
    sinks_arg = sinks if has_sinks else q
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    num_warps = cfg["num_warps"]
    _decode_kernel[(B, Hk * num_gt, S)](
        q, k_cache, v_cache, block_table, seq_lens, q_pos, sinks_arg,
        out, mid_m, mid_l, mid_o,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0),
        q_pos.stride(0),
        out.stride(0), out.stride(1),
        float(scale) * LOG2E, int(window) if window is not None else 0,
        H, G, D, Dv, S,
        NUM_GT=num_gt, DIRECT=S == 1, BLOCK_SIZE=int(block_size),
        BLOCK_G=BLOCK_G, BLOCK_N=block_n, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        HAS_WINDOW=window is not None, HAS_SINKS=has_sinks, DOT_PRECISION=dot_precision,
        INTERP_LOOP=INTERPRET, MAX_TILES=cdiv(max_ctx, block_n) + 1 if INTERPRET else 0,
        num_warps=num_warps,
    )
    if S > 1:
        _merge_kernel[(B, H)](
            mid_m, mid_l, mid_o, sinks_arg, out,
            out.stride(0), out.stride(1), H, Dv, S,
            BLOCK_S=next_pow2(S), BLOCK_DV=BLOCK_DV, HAS_SINKS=has_sinks,
            num_warps=4, **launch_kw(out.device),
        )
    return out
