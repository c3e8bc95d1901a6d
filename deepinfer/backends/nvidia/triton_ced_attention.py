"""CED sparse attention in Triton: sliding window + top-K compressed entries + sink, one softmax, one pass.

Each CED query attends one shared latent (MQA, K = V, head dim D) over
- its window keys: positions max(pos - W + 1, cut, 0) .. pos. Positions computed in this pass are rows of
  the fresh KV ``kv`` (row fresh_start + p - fresh_lo for p >= fresh_lo); older ones live in the sequence's
  FP8 ring (``fp8_e4m3_pow2``: E4M3 codes with a power-of-two scale per 32 channels, slot p % ring);
- its selected global entries: cache rows ``entry_slots[t]`` (-1 = none) of the paged FP4 KV cache
  (``fp4_e2m1_e4m3``, E2M1 nibbles with an E4M3 scale per 16 channels, or ``mxfp4``), or of a bf16 table
  (``bf16``: unquantized entries, or FP4 ones decoded once for many queries: Ops.ced_entry_table);
- a per-head sink logit, which joins only the softmax denominator.

A program owns one (query, head tile, split). It walks its share of the window tiles, then of the entry
tiles, BLOCK_N keys at a time: it loads codes and scales, dequantises them in registers (exact: the
products fit bf16; bf16 entries at latents of 256 and wider through triton_fp4.fp4_bf16_pair, a few integer
operations a byte: a 2048-query prefill chunk at the bench latent 944 -> 681 us on the H200; narrower ones
spilled registers with it; the FP8 ring only for tiles that reach below the fresh rows) and keeps an online
softmax in float32 (running max, denominator, unnormalised output). The heads form the M side of both
products (padded to 16 rows), so each key is read once per head tile, and since K = V the tile loaded for the
scores also serves the values. A tile with no visible key leaves the state untouched (no branch: the max is
guarded against -inf). Where a thread's share of a code tile is small (prefetch_entries), the entry loop is
software-pipelined: the next tile's codes and the one after's slots are loaded before this tile is decoded, the
first tile's before the window (the same tiles in the same order, so the same bits; 3-5% at decode on the H100).
When the grid would be too small to fill the GPU (decode), the keys are split (flash-decoding) and
triton_attention's merge kernel combines the partials and the sink. Split counts depend on shapes only, never
on values, so the launch is safe inside a CUDA graph capture. The entry loop's bound does too, unless the launch
is dynamic (DYNAMIC_ENTRIES, launch key "dynamic"): a program then reads its split's slots first and walks only
the tiles up to its last valid one (read on the device, so still capture-safe). A step whose top-K lists are
mostly -1 (contexts with fewer than K visible entries: the indexer pads its list at the end) then skips them; the
skipped tiles would have left the state untouched, so the bits are the same.

The launch key "trans" (1) computes both products transposed (_online_step): scores as keys x heads, the output
as latent x heads. The keys are then the first product's M side and the latent the second's, so both products
read the key tile in its own orientation (the heads-first form stores each tile to shared memory twice, once
transposed, and holds all of q's operand fragment in every warp: 128 registers a thread at the bench latent);
the second product (M = the latent) is a Hopper warp-group MMA, and from 64 keys a tile on 4 warps the first too.
Window tiles of fresh rows and raw entry tiles are plain row loads, which Triton's pipeline (2 stages) copies
straight into shared memory; the window's tiles that reach the FP8 ring are decoded in registers 16 keys a step,
in a loop of their own before the fresh-only tiles. wide_launch takes it for raw-entry prefills (RAW_TRANS);
decode, whose window tiles all come from the ring, keeps the heads-first form, which measured faster there.

Compiled code: the dequantised tiles pass an opaque identity (``triton_fp4.mma_operand``) before the products,
since Triton 3.6 otherwise widens the MMA operands' kWidth for their 8-bit origin and miscomputes dots with
small K (BLOCK_N = 16 at D = 512: half the keys counted twice, the rest dropped). tests/test_triton_ced.py
checks the compiled kernels for such dots.

Precision: as triton_attention: bf16/fp16 operands with float32 accumulation (float32 inputs use the
"ieee" dot), probabilities rounded to q's dtype for the second product. Expect a relative error of a few
1e-3 in bf16 and ~1e-7 in float32 against the reference op (which computes in float32).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_attention import LOG2E, _dot, finish_softmax, merge_splits, sm_count
from .triton_ced_fused import rope_pairs
from .triton_fp4 import GROUPS, e4m3_value, e8m0_value, fast_decode, fp4_decode, fp4_load, fp4_operand, mma_operand
from .triton_norm import cast_rne, to_f32
from .triton_pdl import launch_kw, pdl_signal, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, check_knob, merge_launch, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
RING_FMT = "fp8_e4m3_pow2"
RING_GROUP = 32
# Entries stored unquantized (reference.lowbit's "bf16": the values' bytes, no scales): read as they are, in bf16
# or float32 queries (fp16 would round them).
RAW_FMT = "bf16"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 1024
# Entry tiles software-pipelined (the kernel's PREFETCH): the next tile's slots and codes are loaded before this
# one is decoded, where prefetch_entries allows it. The launch key "prefetch" (0 / 1) overrides it per call
# (benchmarks/ced_attn_sweep.py).
PREFETCH = True
PREFETCH_MAX_BYTES = 32  # code bytes a thread holds for the next tile (the sm_90 compile test: 64 spilled)
# The entry loop bounded on the device by each split's last valid slot (the module doc); the launch key "dynamic"
# (0 / 1) overrides it per call. Off: on the H100 (25th session) the attention's share of a batch-64 decode step fell
# only 0.526 -> 0.496 ms and a batch-1 step got 0.013 ms slower.
DYNAMIC_ENTRIES = False
# Launches on raw bf16 entries (a prefill's entry table, the default since the 28th session) take wide_launch's
# choice, except where these are set (0: that choice): BLOCK_N, num_warps, num_stages (ced_attn_sweep.py --raw 1
# sweeps them; profile_cold_prefill.py --knob triton_ced_attention.RAW_STAGES=3 times one in the 16K prefill).
RAW_BLOCK_N = 0
RAW_WARPS = 0
RAW_STAGES = 0
# The transposed products (the launch key "trans", _online_step) on raw launches of 32 queries or more, with 2 stages
# (the key tiles then land in shared memory by cp.async): on the H100 (31st session) a 2048-query chunk at 16K took
# 486 us against 570, the 16K bounded prefill's attention 22.9 ms against 28.4. 0: off (the RAW_* above still
# apply). The latent split over warps that came before it lost there (687 us at best).
RAW_TRANS = 1
# The transposed choice's register cap (the launch key "maxnreg"; 0: the compiler's 255). At 168 three 4-warp blocks
# fit an SM instead of two; ptxas spills more in the ring tiles' loop, which ~6% of a chunk's queries run. On the H100
# (32nd session) the 2048-query chunk took 434 us against 484 uncapped (128: 656), the 16K bounded prefill's attention
# 19.9 ms against 23.0, wall 64.9-65.0 against 68.3-68.6 in one call. A copy of the ring decoded beforehand (read as
# rows, no spills) lost with the cap as without it (467 us; 31st session: 25.1 ms against 23.1) and was removed.
RAW_MAXNREG = 168
# A launch override's bounds (merge_launch: lo, hi, power of two), shared by sparse_attention's ``launch`` and the
# RAW_* knobs; BLOCK_D is the latent's own width, added per call.
_LAUNCH_BOUNDS = {"BLOCK_H": (16, 64, True), "BLOCK_N": (16, 128, True), "num_warps": (1, 16, True),
                  "num_stages": (1, 8, False), "prefetch": (0, 1, False), "dynamic": (0, 1, False),
                  "trans": (0, 1, False), "maxnreg": (64, 255, False)}


@triton.jit
def _online_step(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, TRANS: tl.constexpr = False):
    """Fold keys kv [BLOCK_N, BLOCK_D] (valid [BLOCK_N]) into the online softmax of q [BLOCK_H, BLOCK_D] (acc
    [BLOCK_H, BLOCK_D]). TRANS: the products transposed, q [BLOCK_D, BLOCK_H] and acc [BLOCK_D, BLOCK_H]: the keys
    are the first product's M side and the latent the second's, so both read the key tile in its own orientation
    (one shared-memory copy; see the module doc)."""
    if TRANS:
        s = _dot(kv, q, DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_H], log2 units
    else:
        s = _dot(q, tl.trans(kv), DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
    KEYS: tl.constexpr = 0 if TRANS else 1  # the axis of s that runs over the keys
    HEADS: tl.constexpr = 1 - KEYS
    s = tl.where(tl.expand_dims(valid, HEADS), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=KEYS))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: keep l = acc = 0, no NaN
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - tl.expand_dims(m_use, KEYS))
    l_i = l_i * alpha + tl.sum(p, axis=KEYS)
    if TRANS:
        acc = acc * alpha[None, :] + _dot(tl.trans(kv), cast_rne(p, kv.dtype), DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + _dot(cast_rne(p, kv.dtype), kv, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _window_tile(kv_ptr, rc_row, rs_row, p_first, p, pos, fresh_lo, fresh_start, stride_kv, stride_rr, stride_rsr,
                 RING, NG, BLOCK_G: tl.constexpr, DT: tl.constexpr):
    """Window keys at positions p = p_first + 0.. [BLOCK_N] (those <= pos): fresh rows of kv, or slots of the
    sequence's FP8 ring (codes at rc_row, scales at rs_row; NG groups of 32 channels) -> ([BLOCK_N, BLOCK_G * 32]
    in DT, valid). The ring is decoded only for a tile that reaches below fresh_lo (a prefill chunk's first
    window, every decode tile)."""
    g = tl.arange(0, BLOCK_G)
    ch = g[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BLOCK_G, 32] channels, grouped as the ring's scales
    valid = p <= pos
    fresh = valid & (p >= fresh_lo)
    fmask = fresh[:, None] & (g < NG)[None, :]
    frow = (fresh_start + p - fresh_lo).to(tl.int64)
    f = tl.load(kv_ptr + frow[:, None, None] * stride_kv + ch[None, :, :], mask=fmask[:, :, None], other=0.0)
    kv = f.to(DT)  # [BLOCK_N, BLOCK_G, 32]
    if p_first < fresh_lo:
        ring = valid & (p < fresh_lo)
        slot = (p % RING).to(tl.int64)
        rmask = ring[:, None] & (g < NG)[None, :]
        c = tl.load(rc_row + slot[:, None, None] * stride_rr + ch[None, :, :], mask=rmask[:, :, None], other=0)
        sb = tl.load(rs_row + slot[:, None] * stride_rsr + g[None, :], mask=rmask, other=0).to(tl.int32)
        r = mma_operand(e4m3_value(c.to(tl.int32)) * e8m0_value(sb)[:, :, None], DT)  # exact product, rounded once
        kv = tl.where(fresh[:, None, None], kv, r)
    return tl.reshape(kv, [p.shape[0], BLOCK_G * 32]), valid


@triton.jit
def _ced_attn_kernel(
    q_ptr, kv_ptr, rc_ptr, rs_ptr, ec_ptr, es_ptr, sel_ptr, sinks_ptr,
    pos_ptr, cut_ptr, flo_ptr, fst_ptr, rslot_ptr, cos_ptr, sin_ptr,
    out_ptr, mid_m_ptr, mid_l_ptr, mid_o_ptr,
    stride_qt, stride_qh, stride_kv,
    stride_rs, stride_rr, stride_rss, stride_rsr,
    stride_ec, stride_es, stride_sel,
    stride_ot, stride_oh, stride_cs,
    qk_scale, H, D, K, RING, NUM_SPLITS, WINDOW, HALF,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WIN_TILES: tl.constexpr, SEL_TILES: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr,
    HAS_ENTRIES: tl.constexpr, HAS_SINKS: tl.constexpr, DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FAST_FP4: tl.constexpr, UNROPE: tl.constexpr, BLOCK_R: tl.constexpr, PREFETCH: tl.constexpr = False,
    DYN: tl.constexpr = False, SEL_POW2: tl.constexpr = 1, RAW: tl.constexpr = False, TRANS: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    pdl_start(PDL, True)
    t = tl.program_id(0).to(tl.int64)
    ht = tl.program_id(1)
    split = tl.program_id(2)
    heads = ht * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    if TRANS:  # q and the output transposed, [BLOCK_D, BLOCK_H] (_online_step)
        q = tl.load(q_ptr + t * stride_qt + heads[None, :] * stride_qh + d[:, None],
                    mask=h_mask[None, :] & d_mask[:, None], other=0.0)
    else:
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    DT = q.dtype

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros(q.shape, dtype=tl.float32)

    # Window: this split's tiles of positions lo .. pos, lo = max(pos - W + 1, cut, 0).
    pos = tl.load(pos_ptr + t)
    lo = tl.maximum(tl.maximum(pos - (WINDOW - 1), tl.load(cut_ptr + t)), 0)
    fresh_lo = tl.load(flo_ptr + t)
    fresh_start = tl.load(fst_ptr + t)
    ring_row = tl.load(rslot_ptr + t).to(tl.int64)
    rc_row = rc_ptr + ring_row * stride_rs
    rs_row = rs_ptr + ring_row * stride_rss
    n_off = tl.arange(0, BLOCK_N)
    sel_row = sel_ptr + t * stride_sel
    e0 = split * SEL_TILES * BLOCK_N + n_off
    n_sel = SEL_TILES
    if HAS_ENTRIES and DYN:  # this split's tiles up to its last valid slot (none: 0)
        j = tl.arange(0, SEL_POW2)
        e_all = split * SEL_TILES * BLOCK_N + j
        s_all = tl.load(sel_row + e_all, mask=(j < SEL_TILES * BLOCK_N) & (e_all < K), other=-1)
        n_sel = (tl.max(tl.where(s_all >= 0, j, -1), axis=0) + BLOCK_N) // BLOCK_N
    if HAS_ENTRIES and PREFETCH:  # the first entry tile's loads, in flight during the window
        lim = tl.minimum(K, (split + 1) * SEL_TILES * BLOCK_N)  # the end of this split's entries
        slot = tl.load(sel_row + e0, mask=e0 < lim, other=-1)
        nxt = tl.load(sel_row + e0 + BLOCK_N, mask=e0 + BLOCK_N < lim, other=-1)
        byte, sb = fp4_load(ec_ptr, es_ptr, slot, slot >= 0, stride_ec, stride_es, D // GROUP,
                            BLOCK_D // GROUP, GROUP, FAST_FP4)
    if TRANS:  # the tiles that reach below fresh_lo (ring slots) first, then the fresh-only ones as plain row loads,
        # which the compiler's pipeline copies straight into shared memory like the entry rows (the interpreter,
        # which cannot range over a device value, walks every tile in both loops and masks the other loop's)
        # The ring tiles are decoded in registers, 16 keys a step: a whole tile's two register operands spilled more.
        base = lo + split * WIN_TILES * BLOCK_N
        n_mixed = tl.minimum(tl.maximum((fresh_lo - base + BLOCK_N - 1) // BLOCK_N, 0), WIN_TILES)
        SUB: tl.constexpr = BLOCK_N // 16
        r_off = tl.arange(0, 16)
        for j in range(WIN_TILES * SUB if _INTERP else n_mixed * SUB):
            p_first = base + j * 16
            kv, valid = _window_tile(kv_ptr, rc_row, rs_row, p_first, p_first + r_off, pos, fresh_lo, fresh_start,
                                     stride_kv, stride_rr, stride_rsr, RING, D // 32, BLOCK_D // 32, DT)
            if _INTERP:
                valid = valid & (j < n_mixed * SUB)
            m_i, l_i, acc = _online_step(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION, TRANS)
        for i in range(0 if _INTERP else n_mixed, WIN_TILES):
            p = base + i * BLOCK_N + n_off
            valid = p <= pos
            if _INTERP:
                valid = valid & (i >= n_mixed)
            frow = (fresh_start + p - fresh_lo).to(tl.int64)
            kv = tl.load(kv_ptr + frow[:, None] * stride_kv + d[None, :], mask=valid[:, None] & d_mask[None, :],
                         other=0.0)
            m_i, l_i, acc = _online_step(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION, TRANS)
    else:
        for i in range(WIN_TILES):
            p_first = lo + (split * WIN_TILES + i) * BLOCK_N
            kv, valid = _window_tile(kv_ptr, rc_row, rs_row, p_first, p_first + n_off, pos, fresh_lo, fresh_start,
                                     stride_kv, stride_rr, stride_rsr, RING, D // 32, BLOCK_D // 32, DT)
            m_i, l_i, acc = _online_step(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION, TRANS)

    if HAS_ENTRIES:  # selected entries: this split's tiles of entry_slots[t]
        # (a dynamic bound: the interpreter, which cannot range over a device value, walks every tile and masks
        # those past it, so its tests see a bound that drops a valid tile)
        if PREFETCH:  # tile i + 1's codes and tile i + 2's slots are in flight while tile i is decoded and used
            for i in range(SEL_TILES if _INTERP or not DYN else n_sel):
                e2 = e0 + (i + 2) * BLOCK_N
                after = tl.load(sel_row + e2, mask=e2 < lim, other=-1)
                byte_n, sb_n = fp4_load(ec_ptr, es_ptr, nxt, nxt >= 0, stride_ec, stride_es, D // GROUP,
                                        BLOCK_D // GROUP, GROUP, FAST_FP4)
                kv = fp4_decode(byte, sb, GROUP, E8M0, DT, FAST_FP4)
                valid = slot >= 0
                if DYN:
                    valid = valid & (i < n_sel)
                m_i, l_i, acc = _online_step(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION, TRANS)
                slot, nxt, byte, sb = nxt, after, byte_n, sb_n
        else:
            for i in range(SEL_TILES if _INTERP or not DYN else n_sel):
                e = e0 + i * BLOCK_N
                slot = tl.load(sel_row + e, mask=e < K, other=-1)
                valid = slot >= 0
                if DYN:
                    valid = valid & (i < n_sel)
                if RAW:
                    kv = tl.load(ec_ptr + slot[:, None] * stride_ec + d[None, :], mask=valid[:, None] & d_mask[None, :],
                                 other=0.0).to(DT)
                else:
                    kv = fp4_operand(ec_ptr, es_ptr, slot, valid, stride_ec, stride_es, D // GROUP,
                                     BLOCK_D // GROUP, GROUP, E8M0, DT, FAST_FP4)
                m_i, l_i, acc = _online_step(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION, TRANS)

    pdl_signal(PDL)
    if TRANS:
        acc = tl.trans(acc)  # [BLOCK_H, BLOCK_D]
    if DIRECT:  # one split: add the sink and finish here
        o = finish_softmax(acc, m_i, l_i, sinks_ptr + heads, h_mask, HAS_SINKS)
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 cast_rne(o, out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
        if UNROPE:
            unrope_stored(out_ptr + t * stride_ot + heads * stride_oh, h_mask, cos_ptr + t * stride_cs,
                          sin_ptr + t * stride_cs, D, HALF, BLOCK_R)
    else:  # partials [T, H, NUM_SPLITS] (m, l) and [T, H, NUM_SPLITS, BLOCK_D] (acc), as _merge_kernel reads them
        ml = (t * H + heads) * NUM_SPLITS + split
        tl.store(mid_m_ptr + ml, m_i, mask=h_mask)
        tl.store(mid_l_ptr + ml, l_i, mask=h_mask)
        tl.store(mid_o_ptr + ml[:, None] * BLOCK_D + d[None, :], acc, mask=h_mask[:, None])


@triton.jit
def _ced_merge_kernel(mid_m_ptr, mid_l_ptr, mid_o_ptr, sinks_ptr, out_ptr, cos_ptr, sin_ptr, stride_ot, stride_oh,
                      stride_cs, H, D, NUM_SPLITS, HALF, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                      HAS_SINKS: tl.constexpr, UNROPE: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = 0):
    """The splits' partials of one (query, head) combined with the sink (triton_attention.merge_splits), and
    with UNROPE the output's inverse RoPE (as the DIRECT epilogue)."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    o = merge_splits(mid_m_ptr, mid_l_ptr, mid_o_ptr, sinks_ptr, (t * H + h) * NUM_SPLITS, h, NUM_SPLITS,
                     BLOCK_S, BLOCK_D, HAS_SINKS)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, cast_rne(o, out_ptr.dtype.element_ty), mask=d < D)
    if UNROPE:
        one = tl.arange(0, 1)
        unrope_stored(out_ptr + t * stride_ot + h * stride_oh + one, one == 0, cos_ptr + t * stride_cs,
                      sin_ptr + t * stride_cs, D, HALF, BLOCK_R)


@triton.jit
def unrope_stored(row_ptr, row_mask, cos_ptr, sin_ptr, D, HALF, BLOCK_R: tl.constexpr):
    """The inverse RoPE of output rows this block has just stored (row_ptr [ROWS] their starts, D channels):
    their last 2 HALF channels and those channels' pair partners read back after a barrier (the block's own
    stores are then visible), rotated (rope_pairs), and written after a second barrier (no thread overwrites a
    channel another still reads as a partner). A tile of its own keeps the wide output tile's registers free."""
    tl.debug_barrier()
    c = (D - 2 * HALF) + tl.arange(0, 2 * BLOCK_R)
    m = row_mask[:, None] & (c < D)[None, :]
    x = to_f32(tl.load(row_ptr[:, None] + c[None, :], mask=m, other=0.0))
    xp = to_f32(tl.load(row_ptr[:, None] + (c ^ 1)[None, :], mask=m, other=0.0))
    r = rope_pairs(x, xp, c, cos_ptr, sin_ptr, D, HALF, True)
    tl.debug_barrier()
    tl.store(row_ptr[:, None] + c[None, :], cast_rne(r, row_ptr.dtype.element_ty), mask=m)


def supports(q: torch.Tensor, kv: torch.Tensor, ring: tuple, entries: Optional[tuple], entry_slots: torch.Tensor,
             ring_fmt: str, entry_fmt: str, sinks: Optional[torch.Tensor] = None) -> bool:
    """Whether sparse_attention can run these inputs (otherwise use the reference op)."""
    if ring_fmt != RING_FMT or q.dim() != 3 or kv.dim() != 2 or entry_slots.dim() != 2:
        return False
    T, H, D = q.shape
    if q.dtype not in SUPPORTED_DTYPES or kv.dtype != q.dtype or kv.shape != (T, D) or not 0 < D <= MAX_HEAD_DIM:
        return False
    if D % RING_GROUP or q.stride(2) != 1 or kv.stride(1) != 1:
        return False
    rc, rs = ring
    if rs is None or rc.dtype != torch.uint8 or rs.dtype != torch.uint8 or rc.dim() != 3 or rs.dim() != 3:
        return False
    if rc.shape[2] != D or rs.shape != (*rc.shape[:2], D // RING_GROUP) or rc.stride(2) != 1 or rs.stride(2) != 1:
        return False
    if entry_slots.shape[0] != T or entry_slots.dtype != torch.int64:
        return False
    if entries is not None and entry_fmt == RAW_FMT:  # raw bf16 bytes [N, 2 D], no scales
        ec, es = entries
        if es is not None or q.dtype == torch.float16 or ec.dtype != torch.uint8 or ec.dim() != 2:
            return False
        if ec.shape[1] != 2 * D or ec.stride(1) != 1 or ec.stride(0) % 2 or ec.storage_offset() % 2:
            return False
    elif entries is not None:
        ec, es = entries
        if entry_fmt not in GROUPS or es is None or ec.dtype != torch.uint8 or es.dtype != torch.uint8:
            return False
        if ec.dim() != 2 or ec.shape[1] != D // 2 or es.shape != (ec.shape[0], D // GROUPS[entry_fmt]):
            return False
        if ec.stride(1) != 1 or es.stride(1) != 1:
            return False
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != H):
        return False
    return True


def supports_unrope(q: torch.Tensor, unrope) -> bool:
    """Whether sparse_attention takes ``unrope`` = (cos, sin) for q [T, H, D]: float32 [T, R/2] on q's device,
    alike in shape and strides, unit stride along the angles, 0 < R <= D."""
    if not isinstance(unrope, (tuple, list)) or len(unrope) != 2 \
            or not all(isinstance(t, torch.Tensor) for t in unrope):
        return False
    cos, sin = unrope
    return cos.dim() == 2 and cos.shape[0] == q.shape[0] and cos.dtype == sin.dtype == torch.float32 \
        and cos.device == sin.device == q.device and sin.shape == cos.shape and sin.stride() == cos.stride() \
        and 0 < 2 * cos.shape[1] <= q.shape[-1] and cos.stride(1) == 1


def launch_config(H: int, D: int, dtype: torch.dtype) -> dict:
    """Heads on the MMA's M side (16 rows at least; fewer rows per tile for wide heads so the float32
    accumulator fits the registers), BLOCK_N keys per step. Chosen from ptxas' sm_90 spill report: none in
    bf16 up to D = 512 (the bench latent, where q's operand fragment alone takes 128 registers per thread) and
    float32 at D = 128. BLOCK_N = 16 is safe only because mma_operand keeps the operands' kWidth at 2."""
    BLOCK_D = next_pow2(D)
    if INTERPRET:
        BLOCK_N, num_warps = 16, 4
    elif dtype == torch.float32:  # no tensor cores: keep the FMA products small
        BLOCK_N, num_warps = 16, 8
    else:
        BLOCK_N = 64 if BLOCK_D <= 64 else (32 if BLOCK_D <= 256 else 16)
        num_warps = 4 if BLOCK_D <= 64 else 8
    return {"BLOCK_H": max(16, min(next_pow2(H), 64 if BLOCK_D <= 128 else 16)), "BLOCK_D": BLOCK_D,
            "BLOCK_N": BLOCK_N, "num_warps": num_warps}


def _switch(name: str, v) -> bool:
    """An on / off module knob (a bool, 0 or 1), else ValueError naming it."""
    check_knob("triton_ced_attention", name, int(v) if isinstance(v, bool) else v, 0, 1, False)
    return bool(v)


def wide_launch(T: int, H: int, D: int, dtype: torch.dtype, window: int, K: int,
                raw: bool = False) -> Optional[tuple]:
    """(launch overrides, splits) for a call of wide latents (BLOCK_D >= 512, bf16 / fp16, compiled), decode or
    prefill, or None (launch_config and choose_splits decide). From benchmarks/ced_attn_sweep.py on the H200 at the
    CED bench config (16 heads x 512, window 128, 512 entries, 16K of context; the old choice in brackets). Decode
    (13th session): 1 query: BLOCK_N 16, 8 warps, 32 splits, 13.3 us [16 splits: 16.9]; 16: BLOCK_N 32, 8 warps,
    8 splits, 22.0 [34.0]; 64: BLOCK_N 32, 4 warps, 4 splits, 45.6 [9 splits: 117.6]. About 256 programs (128 from
    5 to 31 queries), fewer splits as rows grow: each split's partials are written and merged again. Prefill (14th
    session): a 2048-query chunk on BLOCK_N 32, 4 warps, 1 stage, 1 split, 1117 us [launch_config's BLOCK_N 16,
    8 warps, Triton's default stages: 2380]; every 4-warp BLOCK_N 32 setting beat every 8-warp one there, so the
    decode rule's last regime holds on past 64 queries (one split from 256). Batch-invariant mode never takes this
    (its split count must not follow T). ``raw``: the entries are bf16 rows; RAW_BLOCK_N / RAW_WARPS /
    RAW_STAGES replace the choice's tile, warps and stages where set; from 32 queries the choice is the transposed
    products (RAW_TRANS) on 2 stages (31st session, H100: 486 us against 570 at 2048 queries) with registers capped
    at RAW_MAXNREG (32nd session: 434 us against 484)."""
    BLOCK_D = next_pow2(D)
    if INTERPRET or dtype == torch.float32 or BLOCK_D < 512 or T <= 0:
        return None
    BLOCK_H = launch_config(H, D, dtype)["BLOCK_H"]
    rows = T * cdiv(H, BLOCK_H)
    if T <= 4:
        bn, warps, programs, most = 16, 8, 256, 32
    elif T < 32:
        bn, warps, programs, most = 32, 8, 128, 16
    else:
        bn, warps, programs, most = 32, 4, 256, 16
    stages, trans = 1, False
    if raw:
        for name, v, key in (("RAW_BLOCK_N", RAW_BLOCK_N, "BLOCK_N"), ("RAW_WARPS", RAW_WARPS, "num_warps"),
                             ("RAW_STAGES", RAW_STAGES, "num_stages"), ("RAW_MAXNREG", RAW_MAXNREG, "maxnreg")):
            if v:
                check_knob("triton_ced_attention", name, v, *_LAUNCH_BOUNDS[key])
        if _switch("RAW_TRANS", RAW_TRANS) and T >= 32:
            stages, trans = 2, True
        bn, warps, stages = RAW_BLOCK_N or bn, RAW_WARPS or warps, RAW_STAGES or stages
    tiles = max(cdiv(window, bn), cdiv(K, bn), 1)
    launch = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
    if trans:
        launch["trans"] = 1
        if RAW_MAXNREG:
            launch["maxnreg"] = RAW_MAXNREG
    return launch, int(max(1, min(cdiv(programs, rows), tiles, most)))


def fast_entries(dtype: torch.dtype, cfg: dict) -> bool:
    """Whether a launch of cfg (BLOCK_N, BLOCK_D, num_warps) decodes its FP4 entries through
    triton_fp4.fp4_bf16_pair: latents of 256 and wider only (at 128 the compiled kernel spilled four registers
    with it; the gain was measured at 512), and where triton_fp4.fast_decode allows it."""
    return cfg["BLOCK_D"] >= 256 and fast_decode(dtype, cfg["BLOCK_N"] * cfg["BLOCK_D"] // 2, cfg["num_warps"])


def prefetch_entries(cfg: dict) -> bool:
    """Whether a launch of cfg (BLOCK_N, BLOCK_D, num_warps; "prefetch" if given decides) pipelines its entry
    tiles: PREFETCH on and the next tile's code bytes at most PREFETCH_MAX_BYTES a thread (the bench latent's
    decode launches; the 4-warp BLOCK_N 32 one of prefills and 64-query decodes spilled registers with it)."""
    if "prefetch" in cfg:
        return bool(cfg["prefetch"])
    return PREFETCH and cfg["BLOCK_N"] * cfg["BLOCK_D"] // 2 <= PREFETCH_MAX_BYTES * 32 * cfg["num_warps"]


def choose_splits(rows: int, head_tiles: int, tiles: int, device: torch.device) -> int:
    """Key splits so the grid fills the GPU (about 4 programs per SM), each split at least one tile.
    Depends on shapes only."""
    want = cdiv(4 * sm_count(device), max(1, rows * head_tiles))
    return int(max(1, min(want, tiles, 16)))


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, ring: tuple, entries: Optional[tuple],
                     entry_slots: torch.Tensor, *, pos: torch.Tensor, cut: torch.Tensor, fresh_lo: torch.Tensor,
                     fresh_start: torch.Tensor, ring_slot: torch.Tensor, window: int, entry_fmt: str,
                     sinks: Optional[torch.Tensor], scale: float, ring_fmt: str = RING_FMT,
                     num_splits: Optional[int] = None, launch: Optional[dict] = None,
                     unrope: Optional[tuple] = None) -> torch.Tensor:
    """One softmax per query over its window keys, its selected FP4 entries and the sink (see the module doc).

    q [T, H, D]; kv [T, D] this pass's fresh latents (q's dtype); ring = (codes [S, RING, D], scales
    [S, RING, D // 32]) uint8; entries = (codes [N, D // 2], scales [N, D // G]) uint8, for entry_fmt "bf16"
    (the values' bytes [N, 2 D], None), or None (no global branch); entry_slots [T, K] int64 cache rows, -1 =
    none; pos, cut, fresh_lo, fresh_start, ring_slot [T] int64 per query; window W; sinks [H] or None. Returns
    [T, H, D] in q's dtype. ``launch`` overrides launch_config's keys (and ``num_stages``):
    benchmarks/ced_attn_sweep.py times the choices. ``unrope``: (cos, sin) [T, R/2] float32, each query's rotary
    angles (functional.rope_cos_sin of pos): the output leaves with the inverse RoPE applied to its last R
    channels (CEDLayer.out_proj's first step), the bits functional.apply_rope gives, in the launch that stores it
    (the DIRECT epilogue or the split merge reads those channels back and rotates them in a tile of their own).
    The query's RoPE stays the caller's: applied as q is loaded it cost the compiled kernel spills at some
    latents (the sm_90 compile test).
    """
    if not supports(q, kv, ring, entries, entry_slots, ring_fmt, entry_fmt, sinks):
        raise ValueError(f"sparse_attention: unsupported inputs: q {q.dtype} {tuple(q.shape)}, kv {kv.dtype} "
                         f"{tuple(kv.shape)}, ring_fmt {ring_fmt!r}, entry_fmt {entry_fmt!r}, entry_slots "
                         f"{entry_slots.dtype} {tuple(entry_slots.shape)} (see triton_ced_attention.supports)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    T, H, D = q.shape
    for name, v in (("pos", pos), ("cut", cut), ("fresh_lo", fresh_lo), ("fresh_start", fresh_start),
                    ("ring_slot", ring_slot)):
        if v.shape != (T,) or v.dtype != torch.int64:
            raise ValueError(f"{name} must be an int64 tensor [T={T}], got {v.dtype} {tuple(v.shape)}")
    if unrope is not None and not supports_unrope(q, unrope):
        got = [(t.dtype, tuple(t.shape), str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
               for t in (unrope if isinstance(unrope, (tuple, list)) else [unrope])]
        raise ValueError(f"sparse_attention: unrope must be (cos, sin) float32 [T={T}, R/2] on {q.device}, alike, "
                         f"with 0 < R <= D={D}; got {got}")
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    rc, rs = ring
    K = entry_slots.shape[1]
    has_entries = entries is not None and K > 0
    ec, es = entries if has_entries else (rc, rs)  # unused when there are no entries
    raw = has_entries and entry_fmt == RAW_FMT
    if raw:
        ec = es = ec.view(torch.bfloat16)  # [N, D] (es: unused)
    if entry_slots.stride(1) != 1:
        entry_slots = entry_slots.contiguous()
    cfg = launch_config(H, D, q.dtype)
    if launch is None and num_splits is None:  # wide latents: the launch the H200 sweeps chose
        launch, num_splits = wide_launch(T, H, D, q.dtype, window, K if has_entries else 0, raw) or (None, None)
        cfg = {**cfg, **(launch or {})}
    else:  # a caller's overrides (tests, benchmarks/ced_attn_sweep.py): checked, the latent tile kept
        cfg = merge_launch("sparse_attention", cfg, launch,
                           {**_LAUNCH_BOUNDS, "BLOCK_D": (cfg["BLOCK_D"], cfg["BLOCK_D"], True)})
        if num_splits is not None:
            check_knob("sparse_attention", "num_splits", num_splits, 1, 256, False)
    BLOCK_H, BLOCK_N, BLOCK_D = cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["BLOCK_D"]
    num_ht = cdiv(H, BLOCK_H)
    win_tiles, sel_tiles = cdiv(window, BLOCK_N), cdiv(K, BLOCK_N) if has_entries else 0
    S = num_splits if num_splits is not None else choose_splits(T, num_ht, max(win_tiles, sel_tiles), q.device)
    S = max(1, int(S))
    if S > 1:
        mid_m = torch.empty((T, H, S), dtype=torch.float32, device=q.device)
        mid_l = torch.empty((T, H, S), dtype=torch.float32, device=q.device)
        mid_o = torch.empty((T, H, S, BLOCK_D), dtype=torch.float32, device=q.device)
    else:
        mid_m = mid_l = mid_o = out  # unused
    pos, cut, fresh_lo, fresh_start, ring_slot = (v.contiguous() for v in (pos, cut, fresh_lo, fresh_start, ring_slot))
    trans = bool(cfg.get("trans", 0))
    has_sinks = sinks is not None
    sinks_arg = sinks.contiguous() if has_sinks else q
    cos, sin, stride_cs, half = (*unrope, unrope[0].stride(0), unrope[0].shape[1]) if unrope is not None \
        else (q, q, 0, 0)  # (q: unused)
    block_r = next_pow2(max(1, half))
    _ced_attn_kernel[(T, num_ht, S)](
        q, kv, rc, rs, ec, es, entry_slots, sinks_arg,
        pos, cut, fresh_lo, fresh_start, ring_slot,
        cos, sin, out, mid_m, mid_l, mid_o,
        q.stride(0), q.stride(1), kv.stride(0),
        rc.stride(0), rc.stride(1), rs.stride(0), rs.stride(1),
        ec.stride(0), es.stride(0), entry_slots.stride(0),
        out.stride(0), out.stride(1), stride_cs,
        float(scale) * LOG2E, H, D, K, rc.shape[1], S, window, half,
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        WIN_TILES=cdiv(win_tiles, S), SEL_TILES=cdiv(sel_tiles, S),
        GROUP=GROUPS.get(entry_fmt, 16), E8M0=entry_fmt == "mxfp4", HAS_ENTRIES=has_entries,
        HAS_SINKS=has_sinks, DIRECT=S == 1, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FAST_FP4=has_entries and not raw and fast_entries(q.dtype, cfg), UNROPE=unrope is not None,
        BLOCK_R=block_r, PREFETCH=has_entries and not raw and prefetch_entries(cfg), RAW=raw,
        DYN=has_entries and bool(cfg.get("dynamic", DYNAMIC_ENTRIES)),
        SEL_POW2=next_pow2(max(1, cdiv(sel_tiles, S) * BLOCK_N)), TRANS=trans,
        num_warps=cfg["num_warps"], **({"num_stages": cfg["num_stages"]} if "num_stages" in cfg else {}),
        **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg and not INTERPRET else {}), **launch_kw(q.device),
    )
    if S > 1:
        _ced_merge_kernel[(T, H)](mid_m, mid_l, mid_o, sinks_arg, out, cos, sin, out.stride(0), out.stride(1),
                                  stride_cs, H, D, S, half, BLOCK_S=next_pow2(S), BLOCK_D=BLOCK_D,
                                  HAS_SINKS=has_sinks, UNROPE=unrope is not None, BLOCK_R=block_r, num_warps=4,
                                  **launch_kw(q.device))
    return out
