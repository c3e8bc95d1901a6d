"""Skinny products in Triton: y = x @ w.T for a few rows of x, one launch, bandwidth-bound by design.

At a decode step of one or a few sequences a linear layer is a GEMV: the time is the weight's bytes over the
memory bandwidth. cuBLAS's kernels for these shapes (the CED bench config's 2-32 MB projections) reached about
half the H200's copy bandwidth (docs/benchmarks.md, "Where a decode step goes"), since its tiles leave few
bytes in flight per SM. Here a program owns BLOCK_N output columns of one group and walks K in tiles of
BLOCK_N x BLOCK_K weights (a fixed number of elements, so every program keeps the same bytes in flight);
BLOCK_N shrinks until the grid has a few programs per SM. (cuBLAS picked a kernel that read a 1024 x 2048 bf16
weight at 0.3 TB/s: 13 us, where this takes 3.4.) Each of the M <= BLOCK_M rows of x is multiplied in
float32 and summed per tile (CUDA cores: at a few rows the products cost less than the loads), the row's
float32 total rounded once to x's dtype at the end.

Shapes: x [M, G, K] and w [G, N, K] give [M, G, N] (a grouped projection: CED's output groups); a plain
linear is G = 1 (``linear``). No split over K, no atomics on values: deterministic, one launch, and block sizes
come from shapes only, so it is safe inside a CUDA graph capture.

Options for CED's decode step (each tested against the launches it replaces; backends/nvidia/ops.py says which
ship on): a prologue, ``norm_in`` (each row's RMSNorm before the product); epilogues on the store, ``rope`` (the
query's RoPE); and two on the launch's last program, picked by a ticket counter (triton_tickets): ``route``
(triton_ced_route.Tail: the router on the logits) and ``linear_add_rms`` (the residual add and the next norm).

``EARLY_W`` (a module knob, on; ``benchmarks/profile_decode.py --knob triton_gemv.EARLY_W=0`` A/Bs it): the
CUDA-core kernel loads its first weight tile before the PDL wait, so under PDL the tile streams while the kernel
before it still runs (the weights are parameters: no kernel of a step writes them, so reading them early is safe;
everything else is read after the wait). The same loads and sums in the same order: the same bits. On the H100
(25th session, the CED bench decode step at batch 1, graph replay) 1.276 against 1.318 ms in one run, 1.302 / 1.307
against 1.333 / 1.328 in two more: the GEMVs' share of the span fell 0.558 -> 0.481 ms, most of it handed to the
small kernels after them, which now wait longer.

Precision: float32 accumulation of exact products of bf16 / fp16 / float32 values, one rounding (round to
nearest even) at the end, as cuBLAS computes; the summation order differs, so results agree to the last bits.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_attention import _dot, sm_count
from .triton_ced_fused import _cos_sin, _mul_rn, _rsqrt, add_rms_tail
from .triton_ced_route import Tail, route_tail, supports_tail
from .triton_norm import cast_rne, to_f32
from . import triton_tickets
from .triton_pdl import launch_kw, pdl_signal, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 8  # past this the per-row products cost more than the loads save: cuBLAS's GEMM
DOT_ROWS = 64  # the tensor-core variant: rows padded to 16, 32 or 64 (one to four MMA row tiles)
DOT_X_TILE = 8192  # x elements a dot program loads per K step at 32 rows or more (BLOCK_K = this / BLOCK_M)
# Launch knobs from benchmarks/gemv_bench.py on the H200 (13th session): the lowest step total at one row over the
# CED bench projections (609 us against cuBLAS's 1079). A variant that summed per k lane and reduced once after
# the loop was slower at 1-2 rows (656 / 815 us against 609 / 752) and lost to cuBLAS from 4 rows as this does.
TILE = 8192  # weight elements a program loads per K step (16 KB in bf16)
PROGRAMS_PER_SM = 4
NUM_WARPS = 8
EARLY_W = True  # the first weight tile before the PDL wait (the module doc)


@triton.jit
def _rope_cols(acc, rows, pos_ptr, inv_ptr, M, HEAD_D, HALF, DT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The output tile acc [BLOCK_M, BLOCK_N] (float32 sums of this program's columns, BLOCK_N even) rounded to DT,
    then each head's rotary pairs (2i, 2i + 1) among the last 2 HALF of its HEAD_D columns rotated by the row's
    position: triton_ced_fused's rope kernel on the rounded output, the same cos / sin (pos * inv_freq) and
    products rounded on their own. Float32, to be rounded to DT once more (exact where nothing rotated)."""
    y = to_f32(cast_rne(acc, DT))
    a, b = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
    ce = (tl.program_id(0) * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2)) % HEAD_D  # even columns, within the head
    i = ce // 2 - (HEAD_D // 2 - HALF)
    on = i >= 0
    inv = tl.load(inv_ptr + i, mask=on, other=0.0)
    p = tl.load(pos_ptr + rows, mask=rows < M, other=0).to(tl.float32)
    cos, sin = _cos_sin(p[:, None] * inv[None, :])
    o1 = tl.where(on[None, :], _mul_rn(a, cos) - _mul_rn(b, sin), a)
    o2 = tl.where(on[None, :], _mul_rn(b, cos) + _mul_rn(a, sin), b)
    return tl.reshape(tl.join(o1, o2), (BLOCK_M, BLOCK_N))


@triton.jit
def _rows_step(acc, w, x_g, stride_xm, k, k_mask, M, rows, rstd, nin_w, BLOCK_M: tl.constexpr,
               NORM_IN: tl.constexpr):
    """One K step of the CUDA-core kernel: the float32 weight tile w [BLOCK_N, BLOCK_K] against each row's x at
    columns k, summed into that row of acc (with NORM_IN, x normed first, as ced_rms_norm rounds it)."""
    if NORM_IN:
        wn = to_f32(tl.load(nin_w + k, mask=k_mask, other=0.0))
    for r in tl.static_range(BLOCK_M):
        xr = tl.load(x_g + r * stride_xm + k, mask=k_mask & (r < M), other=0.0).to(tl.float32)
        if NORM_IN:  # the norm's output as ced_rms_norm rounds it: x * rstd * w in float32, then x's dtype
            rs = tl.sum(tl.where(rows == r, rstd, 0.0), axis=0)
            xr = to_f32(cast_rne(_mul_rn(_mul_rn(xr, rs), wn), x_g.dtype.element_ty))
        s = tl.sum(w * xr[None, :], axis=1)  # [BLOCK_N]
        acc = tl.where(rows[:, None] == r, acc + s[None, :], acc)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K,
                 stride_xm, stride_xg, stride_wg, stride_wn, stride_om, stride_og,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_I: tl.constexpr,
                 pos_ptr=None, inv_ptr=None, HEAD_D=1, HALF=0, ROPE: tl.constexpr = False,
                 tail_count=None, tail_w=None, tail_ids=None, tail_bias=None, tail_scale=1.0,
                 ROUTE: tl.constexpr = False, TOPK: tl.constexpr = 1, BLOCK_E: tl.constexpr = 1,
                 BLOCK_TK: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False, RENORM: tl.constexpr = False,
                 norm_count=None, norm_r=None, norm_w=None, norm_h=None, norm_o=None, stride_nr=0, stride_nh=0,
                 stride_no=0, norm_eps=1e-6, NORM: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1,
                 nin_w=None, nin_eps=1e-6, NORM_IN: tl.constexpr = False, EARLY_W: tl.constexpr = False,
                 PDL: tl.constexpr = 0):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1).to(tl.int64)
    n_mask = n < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + g * stride_wg + n[:, None].to(tl.int64) * stride_wn
    if EARLY_W:  # (a parameter: no kernel before this one writes it; see the module doc)
        w0 = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)
    pdl_start(PDL, True)
    rows = tl.arange(0, BLOCK_M)
    x_g = x_ptr + g * stride_xg
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM_IN:  # each row's RMS first: its squares summed over K in BLOCK_K chunks
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K_I if _INTERP else K, BLOCK_K):
            k = k0 + kk
            for r in tl.static_range(BLOCK_M):
                xr = to_f32(tl.load(x_g + r * stride_xm + k, mask=(k < K) & (r < M), other=0.0))
                ss = tl.where(rows == r, ss + tl.sum(_mul_rn(xr, xr), axis=0), ss)
        rstd = _rsqrt(ss / K + nin_eps)
    if EARLY_W:  # the first step on the early tile, then the loop from the second
        acc = _rows_step(acc, w0.to(tl.float32), x_g, stride_xm, kk, kk < K, M, rows, rstd, nin_w, BLOCK_M, NORM_IN)
    for k0 in range(BLOCK_K if EARLY_W else 0, K_I if _INTERP else K, BLOCK_K):
        k = k0 + kk
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc = _rows_step(acc, w, x_g, stride_xm, k, k_mask, M, rows, rstd, nin_w, BLOCK_M, NORM_IN)
    o = out_ptr + g * stride_og + rows[:, None].to(tl.int64) * stride_om + n[None, :]
    pdl_signal(PDL)
    if ROPE:
        acc = _rope_cols(acc, rows, pos_ptr, inv_ptr, M, HEAD_D, HALF, out_ptr.dtype.element_ty, BLOCK_M, BLOCK_N)
    tl.store(o, cast_rne(acc, out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & n_mask[None, :])
    if ROUTE:
        route_tail(tail_count, tl.num_programs(0) * tl.num_programs(1), out_ptr, stride_om, M, N, tail_w, tail_ids,
                   tail_bias, tail_scale, TOPK, BLOCK_M, BLOCK_E, BLOCK_TK, HAS_BIAS, RENORM)
    if NORM:
        add_rms_tail(norm_count, tl.num_programs(0) * tl.num_programs(1), out_ptr, stride_om, norm_r, stride_nr,
                     norm_w, norm_h, stride_nh, norm_o, stride_no, M, N, norm_eps, NORM_BLOCK, BLOCK_M)


@triton.jit
def _dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K,
                stride_xm, stride_xg, stride_wg, stride_wn, stride_om, stride_og,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_I: tl.constexpr, WIDEN: tl.constexpr,
                PRECISION: tl.constexpr, pos_ptr=None, inv_ptr=None, HEAD_D=1, HALF=0, ROPE: tl.constexpr = False,
                tail_count=None, tail_w=None, tail_ids=None, tail_bias=None, tail_scale=1.0,
                ROUTE: tl.constexpr = False, TOPK: tl.constexpr = 1, BLOCK_E: tl.constexpr = 1,
                BLOCK_TK: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False, RENORM: tl.constexpr = False,
                norm_count=None, norm_r=None, norm_w=None, norm_h=None, norm_o=None, stride_nr=0, stride_nh=0,
                stride_no=0, norm_eps=1e-6, NORM: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1,
                nin_w=None, nin_eps=1e-6, NORM_IN: tl.constexpr = False, BLOCK_M: tl.constexpr = 16,
                PDL: tl.constexpr = 0):
    """The same product for up to DOT_ROWS rows on the tensor cores: x's rows padded to BLOCK_M (16, 32 or 64; the
    MMA's M is 16), one dot per K step; WIDEN: mixed dtypes, both operands widened to float32 (exact) for an "ieee"
    dot."""
    pdl_start(PDL, True)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1).to(tl.int64)
    n_mask = n < N
    rows = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + g * stride_wg + n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + g * stride_xg + rows[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if NORM_IN:  # each row's RMS first: its squares summed over K in BLOCK_K chunks
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K_I if _INTERP else K, BLOCK_K):
            k = k0 + kk
            xt = to_f32(tl.load(x_rows + k[None, :], mask=(rows < M)[:, None] & (k < K)[None, :], other=0.0))
            ss += tl.sum(_mul_rn(xt, xt), axis=1)
        rstd = _rsqrt(ss / K + nin_eps)
    for k0 in range(0, K_I if _INTERP else K, BLOCK_K):
        k = k0 + kk
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=(rows < M)[:, None] & k_mask[None, :], other=0.0)
        if NORM_IN:  # the norm's output as ced_rms_norm rounds it
            wn = to_f32(tl.load(nin_w + k, mask=k_mask, other=0.0))
            x = cast_rne(_mul_rn(_mul_rn(to_f32(x), rstd[:, None]), wn[None, :]), x_ptr.dtype.element_ty)
        if WIDEN:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc += _dot(x, tl.trans(w), PRECISION)
    o = out_ptr + g * stride_og + rows[:, None].to(tl.int64) * stride_om + n[None, :]
    pdl_signal(PDL)
    if ROPE:
        acc = _rope_cols(acc, rows, pos_ptr, inv_ptr, M, HEAD_D, HALF, out_ptr.dtype.element_ty, BLOCK_M, BLOCK_N)
    tl.store(o, cast_rne(acc, out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & n_mask[None, :])
    if ROUTE:
        route_tail(tail_count, tl.num_programs(0) * tl.num_programs(1), out_ptr, stride_om, M, N, tail_w, tail_ids,
                   tail_bias, tail_scale, TOPK, BLOCK_M, BLOCK_E, BLOCK_TK, HAS_BIAS, RENORM)
    if NORM:
        add_rms_tail(norm_count, tl.num_programs(0) * tl.num_programs(1), out_ptr, stride_om, norm_r, stride_nr,
                     norm_w, norm_h, stride_nh, norm_o, stride_no, M, N, norm_eps, NORM_BLOCK, BLOCK_M)


def supports(x: torch.Tensor, w: torch.Tensor, dot: bool = False) -> bool:
    """Whether grouped_gemv runs x [M, G, K] against w [G, N, K] (contiguous along K, M <= MAX_ROWS, or DOT_ROWS
    with ``dot``; each in one of SUPPORTED_DTYPES, not necessarily the same: a bf16 hidden row against CED's
    float32 router weight)."""
    if x.dim() != 3 or w.dim() != 3 or x.dtype not in SUPPORTED_DTYPES or w.dtype not in SUPPORTED_DTYPES:
        return False
    if x.device != w.device or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[2]:
        return False
    return 0 < x.shape[0] <= (DOT_ROWS if dot else MAX_ROWS) and x.stride(2) == 1 and w.stride(2) == 1


def block_sizes(M: int, G: int, N: int, K: int, device: torch.device, tile: int = TILE,
                per_sm: int = PROGRAMS_PER_SM, min_n: int = 1) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K): BLOCK_N halved from 64 (down to ``min_n``) while the grid would give fewer than
    ``per_sm`` programs per SM, BLOCK_K = tile / BLOCK_N (at most K rounded up to a power of two). Shapes only."""
    bn = max(min_n, min(64, next_pow2(N)))
    while bn > min_n and G * cdiv(N, bn) < per_sm * sm_count(device):
        bn //= 2
    bk = max(16, min(next_pow2(K), tile // bn))
    return next_pow2(M), bn, bk


def dot_rows(M: int) -> int:
    """The dot kernel's BLOCK_M for M rows: 16, 32 or 64."""
    return max(16, next_pow2(max(1, M)))


def dot_block_sizes(M: int, G: int, N: int, K: int, device: torch.device, tile: int = TILE,
                    per_sm: int = PROGRAMS_PER_SM) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the dot kernel: block_sizes' columns (16 at least); past 16 rows BLOCK_K
    also at most DOT_X_TILE / BLOCK_M, so the x tile of a pipelined K step stays 16 KB in bf16 (three stages of a 64
    x 512 x tile and a 16 x 512 weight tile would pass the 227 KB of shared memory)."""
    _, bn, bk = block_sizes(M, G, N, K, device, tile, per_sm, min_n=16)
    bm = dot_rows(M)
    if bm > 16:
        bk = max(16, min(bk, DOT_X_TILE // bm))
    return bm, bn, bk


def supports_rope(x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, rope_dim: int, heads: int) -> bool:
    """Whether linear(x, w, rope=...) takes this RoPE epilogue: one group, N = heads x D with D even, an even
    rope_dim in (0, D], pos int64 [M] on x's device."""
    N = w.shape[-2] if w.dim() >= 2 else 0
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or N % heads:
        return False
    D = N // heads
    return isinstance(rope_dim, int) and not isinstance(rope_dim, bool) and 0 < rope_dim <= D and D % 2 == 0 \
        and rope_dim % 2 == 0 and pos.dtype == torch.int64 and pos.dim() == 1 and pos.shape[0] == x.shape[0] \
        and pos.device == x.device


def supports_route(x: torch.Tensor, w: torch.Tensor, top_k: int, bias: Optional[torch.Tensor] = None,
                   dot: bool = False) -> bool:
    """Whether grouped_gemv(x, w, out_dtype=torch.float32, route=Tail(...)) carries a router of top_k (and bias):
    one group, K > 0, rows x experts within triton_ced_route.MAX_TAIL_LOGITS (x, w as supports takes them)."""
    return x.dim() == 3 and w.dim() == 3 and x.shape[1] == 1 and w.shape[0] == 1 and x.shape[2] > 0 \
        and supports_tail(x.shape[0], w.shape[1], top_k, bias,
                          dot_rows(x.shape[0]) if dot else next_pow2(max(1, x.shape[0])))


def grouped_gemv(x: torch.Tensor, w: torch.Tensor, *, out_dtype: Optional[torch.dtype] = None, tile: int = TILE,
                 per_sm: int = PROGRAMS_PER_SM, num_warps: int = NUM_WARPS, dot: bool = False,
                 rope: Optional[tuple] = None, route: Optional[Tail] = None, norm: Optional[dict] = None,
                 norm_in: Optional[tuple] = None) -> torch.Tensor:
    """x [M, G, K] @ w[g].T per group -> [M, G, N] in ``out_dtype`` (default x's; see the module doc: both operands
    are widened to float32 exactly, so mixed dtypes compute x.float() @ w.float().T). ``tile``, ``per_sm`` and
    ``num_warps`` are the launch's knobs (benchmarks/gemv_bench.py times them); ``dot``: the tensor-core kernel
    (up to DOT_ROWS rows, padded to 16, 32 or 64: dot_block_sizes; BLOCK_N at least 16), float32 operands through
    an "ieee" dot. ``rope`` = (pos [M] int64, inv_freq [R/2] float32, heads): one group whose N columns are heads
    of D = N / heads; each head's last R columns leave rotated by the row's position (CED's query RoPE, as
    triton_ced_fused.rope computes it on the rounded output; supports_rope says which). ``route``: a
    triton_ced_route.Tail for one group of N experts' float32 logits; the launch's last program routes every row
    into its ``w`` / ``ids`` (supports_route says which). ``norm_in`` = (weight [K], eps): x's rows pass CED's
    RMSNorm first (the bits ced_rms_norm rounds to, up to its sum's order), in the product's launch (one group, x's
    dtype out)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if rope is not None and (x.dim() != 3 or x.shape[1] != 1 or len(rope) != 3
                             or not supports_rope(x, w, rope[0], 2 * rope[1].shape[0], rope[2])):
        raise ValueError(f"grouped_gemv: rope must be (pos int64 [M], inv_freq [R/2], heads) for one group of "
                         f"heads x D columns with even D and R <= D; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if not supports(x, w, dot) or out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"grouped_gemv: unsupported inputs: x {x.dtype} {tuple(x.shape)} stride {x.stride()}, "
                         f"w {w.dtype} {tuple(w.shape)} stride {w.stride()}, out {out_dtype} "
                         f"(x [M <= {DOT_ROWS if dot else MAX_ROWS}, G, K] and w [G, N, K] in {SUPPORTED_DTYPES}, "
                         "contiguous along K)")
    if route is not None and not (supports_route(x, w, route.top_k, None, dot) and out_dtype == torch.float32
                                  and route.w.shape[0] == x.shape[0] and route.E == w.shape[1]):
        raise ValueError(f"grouped_gemv: route must be a Tail of {tuple(x.shape)[0]} rows and {w.shape[-2]} experts "
                         f"for one group of float32 logits with K > 0; got x {tuple(x.shape)}, w {tuple(w.shape)}, "
                         f"out {out_dtype}")
    M, G, K = x.shape
    N = w.shape[1]
    out = torch.empty(M, G, N, dtype=out_dtype, device=x.device)
    if N == 0 or G == 0:
        return out
    if K == 0:
        return out.zero_()
    rk = dict(route.kernel_kw) if route is not None else {}
    rk.update(norm or {})  # (linear_add_rms's tail arguments)
    if norm_in is not None:
        nw, eps = norm_in
        if G != 1 or x.dtype != out_dtype or nw.shape != (K,) or not nw.is_contiguous() or nw.device != x.device:
            raise ValueError(f"grouped_gemv: norm_in must be (weight [K={K}] contiguous on x's device, eps) for one "
                             f"group with out_dtype x's; got weight {tuple(nw.shape)}, {G} groups, out {out_dtype}")
        rk.update(nin_w=nw, nin_eps=float(eps), NORM_IN=True)
    if rope is not None:
        pos, inv, heads = rope
        rk.update(pos_ptr=pos.contiguous(), inv_ptr=inv.contiguous(), HEAD_D=N // heads, HALF=inv.shape[0],
                  ROPE=True)
    if dot:
        BM, BN, BK = dot_block_sizes(M, G, N, K, x.device, tile, per_sm)
        widen = x.dtype != w.dtype or x.dtype == torch.float32
        _dot_kernel[(cdiv(N, BN), G)](
            x, w, out, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
            BLOCK_N=BN, BLOCK_K=BK, K_I=K if INTERPRET else 0, WIDEN=widen, PRECISION="ieee" if widen else "tf32",
            BLOCK_M=BM, **rk, num_warps=4, **launch_kw(x.device))
        return out
    BM, BN, BK = block_sizes(M, G, N, K, x.device, tile, per_sm, min_n=2 if rope is not None else 1)
    _gemv_kernel[(cdiv(N, BN), G)](
        x, w, out, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, K_I=K if INTERPRET else 0, EARLY_W=bool(EARLY_W), **rk,
        num_warps=num_warps, **launch_kw(x.device))
    return out


def linear(x: torch.Tensor, w: torch.Tensor, **knobs) -> torch.Tensor:
    """F.linear(x, w) without bias for x [M, K] (M <= MAX_ROWS), w [N, K] -> [M, N] (``rope``: see grouped_gemv)."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"linear: x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    return grouped_gemv(x[:, None, :], w[None], **knobs)[:, 0, :]


def supports_add_rms(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     dot: bool = False) -> bool:
    """Whether linear_add_rms runs x [M, K] @ w [N, K].T (supports' rows, ``dot`` its variant's) with the residual
    [M, N] and the norm's weight [N]: one dtype of x, w and residual, unit stride along N, a norm
    triton_ced_fused takes."""
    from . import triton_ced_fused as tcf

    return x.dim() == 2 and w.dim() == 2 and residual.dim() == 2 and x.shape[1] == w.shape[1] > 0 \
        and residual.shape == (x.shape[0], w.shape[0]) and x.dtype == w.dtype == residual.dtype \
        and residual.device == x.device and (residual.stride(1) == 1 or w.shape[0] == 1) \
        and supports(x[:, None, :], w[None], dot) and tcf.supports_rms(residual, weight)


def linear_add_rms(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   dot: bool = False, **knobs):
    """(h, rms(h)) for h = residual + x @ w.T, each [M, N] in x's dtype: the product, then on its last program
    triton_ced_fused.add_rms_norm's add and RMSNorm (the bits of linear then add_rms_norm(residual, product));
    one launch where two ran. ``knobs``: grouped_gemv's."""
    if not supports_add_rms(x, w, residual, weight, dot):
        raise ValueError(f"linear_add_rms: unsupported x {x.dtype} {tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}, "
                         f"residual {residual.dtype} {tuple(residual.shape)} stride {residual.stride()}, weight "
                         f"{weight.dtype} {tuple(weight.shape)} (see supports_add_rms)")
    M, N = residual.shape
    h, out = torch.empty_like(residual, memory_format=torch.contiguous_format), torch.empty(
        M, N, dtype=x.dtype, device=x.device)
    wn = weight if weight.is_contiguous() else weight.contiguous()
    norm = dict(norm_count=triton_tickets.counter("add_rms", x.device), norm_r=residual, norm_w=wn, norm_h=h,
                norm_o=out, stride_nr=residual.stride(0), stride_nh=h.stride(0), stride_no=out.stride(0),
                norm_eps=float(eps), NORM=True, NORM_BLOCK=next_pow2(N))
    linear(x, w, dot=dot, norm=norm, **knobs)
    return h, out
