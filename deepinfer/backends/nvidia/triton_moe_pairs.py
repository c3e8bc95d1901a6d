"""SwiGLU experts for a few (token, expert) pairs in two Triton launches, no sort: a decode step's MoE.

triton_moe.fused_experts sorts the pairs by expert (a count and a place kernel) so that an expert's weights
are read once for all its tokens, then runs two GEMMs and sums each token's k rows: five launches a layer. At
a few tokens every pair has its own expert anyway, and the launches cost more than the work (docs/benchmarks.md,
"What 60% takes at batch 1"). Here, for x [T, d], w13 [E, 2F, d], w2 [E, d, F], weights and ids [T, k]:

1. ``_pairs_up_kernel``, a program per (pair, F-tile): the pair's gate and up rows of w13[e] against x[t]
   (a GEMV: float32 products summed per BLOCK_K step), the optional DeepSeek-V4 clamp, silu(gate) * up, stored
   in x's dtype ([T k, F]).
2. ``_pairs_down_kernel``, a program per (token, d-tile): for each of the token's k pairs, activation @ w2[e].T
   times the pair's routing weight in float32, rounded to x's dtype, and the k of them summed in float32 in pair
   order (deterministic, no atomics), stored in x's dtype.

With ``shared`` (a DeepSeek-style shared expert, sw13 [2 Fs, d] and sw2 [d, Fs], Fs a multiple of F) each token
also gets Fs / F pairs of weight 1 whose "expert" is a width-F slice of the shared one (its gate and up rows
j F .. (j + 1) F, sw2's columns alike): SwiGLU is per channel and the down projection a sum over channels, so
the slices' outputs add up to the shared expert's. Its three launches (w13, the activation, w2) ride on these two.

The roundings are fused_experts' (the activation and each pair's weighted output to x's dtype, the k-sum in
float32); the sums run in another order, so results agree to the last bits, not bit for bit. The shared expert's
are those of the unfused path it replaces (its gate / up products, ced_swiglu's silu and output, its down product
and the routed sum each rounded to x's dtype, then their sum): a step of a few tokens (a prefix hit's suffix, a
decode step) then rounds as one of many tokens (fused_experts and the shared expert apart) does, as prefix hits
and speculation's twin runs expect (in bf16 one rounding more or less parted them by 1e-3 nats). FP8 block-scaled
weights as fused_experts takes them (float8_e4m3fn with [E, cdiv(rows, 128), cdiv(cols, 128)] float32 scales;
with them BLOCK_K divides 128, so a step's products take one scale per row). Ids outside [0, E) contribute zero (not
checked: a host sync). Block sizes from shapes only: capture-safe, deterministic.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference.moe import FP8, _check_experts, check_scales
from . import triton_gemv
from .triton_moe import SUPPORTED_DTYPES
from .triton_ced_fused import _exp
from .triton_norm import cast_rne, to_f32
from .triton_pdl import launch_kw, pdl_signal, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
MAX_PAIRS = 256  # past this, sorting by expert (fused_experts) reads each expert's weights once for its tokens


@triton.jit
def _weight_tile(ptrs, mask):
    w = tl.load(ptrs, mask=mask, other=0.0)
    return w.to(tl.float32)  # (an e4m3 or bf16 value is exact in float32)


@triton.jit
def _pairs_up_kernel(
    x_ptr, w_ptr, ws_ptr, ids_ptr, act_ptr, sw_ptr,
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_at,
    stride_swn, stride_swk, F, FS, D, E, TOPK, P, NS, clamp,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_CLAMP: tl.constexpr, FP8_W: tl.constexpr, D_I: tl.constexpr,
    HAS_SHARED: tl.constexpr, PDL: tl.constexpr = 0,
):
    """act[p, n-tile] = silu(gate(x[t])) * up(x[t]) of pair p's expert (zero for an id out of range); pairs from P
    on (HAS_SHARED) are the shared expert's slices, NS a token."""
    pdl_start(PDL, True)
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < F
    e = tl.load(ids_ptr + tl.minimum(p, P - 1)).to(tl.int64)
    if HAS_SHARED:
        shared = p >= P
        t = tl.where(shared, (p - P) // NS, p // TOPK).to(tl.int64)
        valid = shared | ((e >= 0) & (e < E))
        e = tl.where(shared | ~valid, 0, e)
        slice_ = (p - P) % NS
        z = p.to(tl.int64) * 0  # (int64 tensors in both branches: a stride or size of 1 arrives as a constant)
        if shared:  # two bases, one per program
            w_e = sw_ptr + (slice_ * F).to(tl.int64) * stride_swn
            sn = z + stride_swn
            sk = z + stride_swk
            up = z + FS
        else:
            w_e = w_ptr + e * stride_we
            sn = z + stride_wn
            sk = z + stride_wk
            up = z + F
    else:
        t = (p // TOPK).to(tl.int64)
        valid = (e >= 0) & (e < E)
        e = tl.where(valid, e, 0)
        w_e = w_ptr + e * stride_we
        sn = stride_wn
        sk = stride_wk
        up = F
    kk = tl.arange(0, BLOCK_K)
    s_e = ws_ptr + e * stride_se
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D_I if _INTERP else D, BLOCK_K):
        k = k0 + kk
        k_mask = k < D
        xv = tl.load(x_ptr + t * stride_xt + k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        m = n_mask[:, None] & k_mask[None, :]
        wg = _weight_tile(w_e + n[:, None].to(tl.int64) * sn + k[None, :] * sk, m)
        wu = _weight_tile(w_e + (up + n)[:, None].to(tl.int64) * sn + k[None, :] * sk, m)
        g = tl.sum(wg * xv[None, :], axis=1)
        u = tl.sum(wu * xv[None, :], axis=1)
        if FP8_W:  # one scale per 128 x 128 block; this K step lies inside one block column
            kb = k0 // 128
            g = g * tl.load(s_e + (n // 128) * stride_sn + kb * stride_sk, mask=n_mask, other=0.0)
            u = u * tl.load(s_e + ((F + n) // 128) * stride_sn + kb * stride_sk, mask=n_mask, other=0.0)
        acc_g += g
        acc_u += u
    DT = act_ptr.dtype.element_ty
    if HAS_SHARED:
        if p >= P:  # the unfused shared expert's roundings: its w13 product, then ced_swiglu's silu, to the dtype
            acc_g = to_f32(cast_rne(acc_g, DT))
            acc_u = to_f32(cast_rne(acc_u, DT))
    if HAS_CLAMP:  # DeepSeek-V4: gate <= clamp, -clamp <= up <= clamp
        acc_g = tl.minimum(acc_g, clamp)
        acc_u = tl.maximum(tl.minimum(acc_u, clamp), -clamp)
    silu = acc_g * tl.sigmoid(acc_g)
    if HAS_SHARED:
        if p >= P:
            silu = to_f32(cast_rne(acc_g / (1.0 + _exp(-acc_g)), DT))
    a = tl.where(valid, silu * acc_u, 0.0)
    pdl_signal(PDL)
    tl.store(act_ptr + p.to(tl.int64) * stride_at + n, cast_rne(a, DT), mask=n_mask)


@triton.jit
def _pairs_down_kernel(
    act_ptr, w_ptr, ws_ptr, ids_ptr, rw_ptr, out_ptr, sw_ptr,
    stride_at, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_ot, stride_swn, stride_swk,
    D, E, P,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_W: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
    HAS_SHARED: tl.constexpr, NS: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = 0,
):
    """out[t, n-tile] = sum over t's pairs of round(weight * act[p] @ w2[e].T), in pair order, then (HAS_SHARED)
    its shared expert's NS slices' sum, round(sum_j act[p_j] @ sw2[:, slice j].T).

    A program's rows r < TOPK are the token's pairs, TOPK <= r < TOPK + NS its shared slices: one [BLOCK_R,
    BLOCK_N, BLOCK_K] weight tile a K step, so every row's loads are in flight at once (a loop over the pairs,
    each a load behind its expert id and a cross-warp reduction, took ~9 us for 10 MB at one token on the H200)."""
    pdl_start(PDL, True)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < D
    r = tl.arange(0, BLOCK_R)
    routed = r < TOPK
    e = tl.load(ids_ptr + t * TOPK + r, mask=routed, other=-1).to(tl.int64)
    valid = routed & (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    live = valid
    rows = t * TOPK + r
    w_rows = w_ptr + e * stride_we  # [BLOCK_R] row bases
    sn = stride_wn
    sk = stride_wk
    if HAS_SHARED:
        sh = (r >= TOPK) & (r < TOPK + NS)
        live = valid | sh
        rows = tl.where(routed, rows, P + t * NS + (r - TOPK))
        z = r.to(tl.int64) * 0  # int64 strides either way (a stride of 1 arrives as a constant)
        w_rows = tl.where(sh, sw_ptr + ((r - TOPK) * F).to(tl.int64) * stride_swk, w_rows)
        sn = tl.where(sh, z + stride_swn, z + stride_wn)
        sk = tl.where(sh, z + stride_swk, z + stride_wk)
        sn = sn[:, None, None]
        sk = sk[:, None, None]
    a_rows = act_ptr + rows.to(tl.int64) * stride_at
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for f0 in tl.static_range(0, F, BLOCK_K):
        f = f0 + kk
        f_mask = f < F
        av = tl.load(a_rows[:, None] + f[None, :], mask=live[:, None] & f_mask[None, :], other=0.0).to(tl.float32)
        wp = w_rows[:, None, None] + n[None, :, None].to(tl.int64) * sn + f[None, None, :] * sk
        m = live[:, None, None] & n_mask[None, :, None] & f_mask[None, None, :]
        y = tl.sum(tl.load(wp, mask=m, other=0.0).to(tl.float32) * av[:, None, :], axis=2)  # [BLOCK_R, BLOCK_N]
        if FP8_W:  # one scale per 128 x 128 block; this K step lies inside one block column
            sc = ws_ptr + e[:, None] * stride_se + (n // 128)[None, :] * stride_sn + (f0 // 128) * stride_sk
            y = y * tl.load(sc, mask=valid[:, None] & n_mask[None, :], other=0.0)
        acc += y
    pdl_signal(PDL)
    DT = out_ptr.dtype.element_ty
    rw = tl.load(rw_ptr + t * TOPK + r, mask=routed, other=0.0)
    yr = tl.where(valid[:, None], to_f32(cast_rne(acc * rw[:, None], DT)), 0.0)  # fused_experts' rounding
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOPK):  # in pair order (each row's sum is that one value: exact)
        total += tl.sum(tl.where((r == j)[:, None], yr, 0.0), axis=0)
    if HAS_SHARED:  # the unfused path's roundings: routed sum and shared product each to the dtype, then their sum
        srow = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(NS):
            srow += tl.sum(tl.where((r == TOPK + j)[:, None], acc, 0.0), axis=0)
        total = to_f32(cast_rne(total, DT)) + to_f32(cast_rne(srow, DT))
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + n, cast_rne(total, DT), mask=n_mask)


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
             shared: Optional[tuple] = None) -> bool:
    """Whether pair_experts runs these inputs: fused_experts' (triton_moe.supports) with at most MAX_PAIRS pairs;
    a shared expert (sw13 [2 Fs, d], sw2 [d, Fs]) in x's dtype, Fs a multiple of the experts' F, beside
    bf16 / fp16 / float32 experts (not FP8 ones)."""
    from .triton_moe import supports as fused_supports

    if not (fused_supports(x, w13, w2, weights, ids, w13_scale, w2_scale) and ids.numel() <= MAX_PAIRS):
        return False
    if shared is None:
        return True
    sw13, sw2 = shared
    F, d = w13.shape[1] // 2, x.shape[1]
    return w13.dtype != FP8 and sw13.dtype == sw2.dtype == x.dtype and sw13.device == sw2.device == x.device \
        and sw13.dim() == 2 and sw2.dim() == 2 and sw13.shape[1] == d and sw13.shape[0] % 2 == 0 and F > 0 \
        and sw13.shape[0] // 2 % F == 0 and tuple(sw2.shape) == (d, sw13.shape[0] // 2) \
        and x.shape[0] * (ids.shape[1] + sw13.shape[0] // 2 // F) <= MAX_PAIRS


TILE = 512 if INTERPRET else 8192  # weight elements a program loads per K step (bf16 / fp16 weights)
PROGRAMS_PER_SM = 4


def _blocks(cols: int, rows: int, K: int, fp8: bool, device: torch.device) -> tuple:
    """(BLOCK_N, BLOCK_K) as triton_gemv sizes a GEMV (its H200 sweep: few rows, big tiles, ~4 programs per SM):
    BLOCK_N halved from 64 while rows x column tiles would give fewer than PROGRAMS_PER_SM programs per SM (the
    first version stopped at 16 and took 128-wide K steps: 128 programs of 4 KB loads at one token, 1.9x slower
    than fused_experts), BLOCK_K = TILE / BLOCK_N. FP8 weights keep K steps of 128 (32 under the interpreter), so
    a step's products take one scale per row."""
    _, bn, bk = triton_gemv.block_sizes(1, rows, cols, K, device, TILE, PROGRAMS_PER_SM,
                                        min_n=min(2, next_pow2(cols)))  # (rows as the GEMV's groups)
    return bn, (32 if INTERPRET else 128) if fp8 else bk


def _i(n: int) -> int:
    """A loop bound the interpreter unrolls as a constant (compiled kernels take it at run time: one binary)."""
    return n if INTERPRET else 0


def pair_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 *, clamp: Optional[float] = None, w13_scale: Optional[torch.Tensor] = None,
                 w2_scale: Optional[torch.Tensor] = None, shared: Optional[tuple] = None) -> torch.Tensor:
    """triton_moe.fused_experts' contract (x [T, d], w13 [E, 2F, d], w2 [E, d, F] in x's dtype or FP8 with
    scales, weights / ids [T, k]) for at most MAX_PAIRS pairs, in two launches. Returns [T, d] in x's dtype.
    ``shared`` = (sw13 [2 Fs, d], sw2 [d, Fs]): plus the shared expert's SwiGLU (the same clamp), in the same two
    launches (see the module doc)."""
    _check_experts(x, w13, w2, weights, ids, clamp)
    check_scales(w13, w2, w13_scale, w2_scale)
    if not supports(x, w13, w2, weights, ids, w13_scale, w2_scale, shared):
        raise ValueError(f"pair_experts: unsupported inputs: x {x.dtype} {tuple(x.shape)}, w13 {w13.dtype}, "
                         f"w2 {w2.dtype}, {ids.numel()} pairs (at most {MAX_PAIRS}; dtypes {SUPPORTED_DTYPES} "
                         f"or FP8 weights with both scales)"
                         + ("" if shared is None else f", shared expert {[(t.dtype, tuple(t.shape)) for t in shared]}"
                            " (x's dtype, sw13 [2 Fs, d] and sw2 [d, Fs], Fs a multiple of F; not with FP8 experts)"))
    T, d = x.shape
    F, k = w13.shape[1] // 2, ids.shape[1]
    if T == 0 or F == 0 or d == 0:
        return torch.zeros(T, d, dtype=x.dtype, device=x.device)
    P = T * k  # routed pairs; the shared expert's slices follow, NS a token
    sw13, sw2 = shared if shared is not None else (x, x)  # placeholders: never read without HAS_SHARED
    NS = sw13.shape[0] // 2 // F if shared is not None else 0
    fp8 = w13.dtype == FP8
    ids_flat = ids.reshape(-1).contiguous()
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    s13 = w13_scale if fp8 else rw  # placeholders: never read without FP8
    s2 = w2_scale if fp8 else rw
    s13_strides = s13.stride() if fp8 else (0, 0, 0)
    s2_strides = s2.stride() if fp8 else (0, 0, 0)
    BN1, BK1 = _blocks(F, P + T * NS, d, fp8, x.device)
    BN2, BK2 = _blocks(d, T, F, fp8, x.device)
    BR = next_pow2(k + NS)
    # The down kernel's tile holds all of a token's rows: TILE elements in all (FP8 keeps its K step of one
    # scale block, so its tile narrows in N instead: 8 rows x 128 K would otherwise load 8x TILE at BLOCK_N 64).
    if fp8:
        BN2 = max(2, min(BN2, TILE // (BR * BK2)))
    else:
        BK2 = max(16, min(BK2, TILE // (BR * BN2)))
    act = torch.empty(P + T * NS, F, dtype=x.dtype, device=x.device)
    _pairs_up_kernel[(P + T * NS, cdiv(F, BN1))](
        x, w13, s13, ids_flat, act, sw13, x.stride(0), x.stride(1), *w13.stride(), *s13_strides, act.stride(0),
        sw13.stride(0), sw13.stride(1), F, NS * F, d, w13.shape[0], k, P, max(NS, 1),
        float(clamp) if clamp is not None else 0.0,
        BLOCK_N=BN1, BLOCK_K=BK1, HAS_CLAMP=clamp is not None, FP8_W=fp8, D_I=_i(d), HAS_SHARED=NS > 0,
        num_warps=8, **launch_kw(x.device))
    out = torch.empty(T, d, dtype=x.dtype, device=x.device)
    _pairs_down_kernel[(T, cdiv(d, BN2))](
        act, w2, s2, ids_flat, rw, out, sw2, act.stride(0), *w2.stride(), *s2_strides, out.stride(0),
        sw2.stride(0), sw2.stride(1), d, w13.shape[0], P,
        BLOCK_N=BN2, BLOCK_K=BK2, FP8_W=fp8, F=F, TOPK=k, HAS_SHARED=NS > 0, NS=NS, BLOCK_R=BR,
        num_warps=8,
        **launch_kw(x.device))
    return out
