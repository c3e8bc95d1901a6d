"""Skinny GEMMs of a few to 64 rows with K split over programs: y = x @ w.T, read once at the memory's pace.

A decode step of 5-64 sequences multiplies each projection by a handful of rows: the time is the weight's bytes
over the bandwidth, provided enough bytes are in flight. cuBLAS's kernels for the CED bench config's projections
at 16 rows took ~55 us a layer where the bytes need ~20 (docs/benchmarks.md, nineteenth session), and
triton_gemv's kernels, one program per column tile over all of K, leave a few programs per SM with K = 8192.
Here a program owns (BLOCK_N columns of one group, one K range) and runs tensor-core products with the rows
padded to an MMA's (16, 32 or 64); column tiles x K splits fill the GPU. Each program writes its float32 partial
to a workspace and takes a ticket on its column tile's counter; the program that takes the last ticket sums the
tile's partials in split order (so the result does not depend on which program finished last), writes the
output and resets the counter. One launch, no atomics on values: deterministic for a shape.

The counters live in a zeroed int32 buffer per (device, stream), left zeroed by every call, so a CUDA graph that
captured a call replays it; two calls on one stream never overlap (with PDL a kernel waits for the previous grid
before any load). Launch parameters come from shapes only.

``swap`` (a launch knob, same-dtype operands): the product runs as y.T = w @ x.T, the weight tile the MMA's M side
(BLOCK_N of 64 or more: Hopper's wgmma, which reads it from shared memory as loaded) and the padded rows its N
side, instead of the rows as M (16: the older mma.sync, the tile staged through registers); the tile is
transposed back before the partials and the store. The partials hold the same float32 sums per (row, column), so
the bound below holds either way (the MMA's internal order may differ: not bit-equal to swap off on a GPU).

Precision: float32 accumulation of exact bf16 / fp16 products, one rounding (round to nearest even) at the end,
as cuBLAS computes; the summation order differs, so results agree to the last bits (the tests' bound: K float32
roundings of sum |x w| plus half an ulp). A float32 weight against bf16 rows (CED's router logits, x.float() @
gate.T, into float32) is split in registers into three bf16 terms whose sum is the weight exactly (8 + 8 + 8
significant bits), so three tensor-core products of exact bf16 x bf16 terms give the float32 product's value
with float32 accumulation: no cast of x, no SIMT float32 GEMM.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_attention import _dot, sm_count
from . import triton_tickets
from .triton_ced_route import Tail, route_tail, supports_tail
from .triton_norm import cast_rne
from .triton_pdl import launch_kw, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, check_knob, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_ROWS = 64  # one MMA tile of rows (wgmma's M on Hopper); past it cuBLAS's GEMM tiles M itself
# Launch knobs (benchmarks/gemv_bench.py, "splitk" rows): programs per SM the splits aim for, the K tile, the
# column tile, the most splits a tile takes (each adds a partial the last program reads back).
PROGRAMS_PER_SM = 4
BLOCK_K = 128
BLOCK_N = 64
MAX_SPLITS = 16
NUM_STAGES = 3
COUNTERS = 1 << 16  # column tiles one call may have (a [G, N] of 64-wide tiles: N x G <= 4M columns)


@triton.jit
def split_bf16x3(w):
    """A float32 tile as three bf16 tiles whose sum is it exactly (8 + 8 + 8 significant bits, each remainder
    exact in float32), so three products of a bf16 operand with them give its float32 product's terms."""
    hi = w.to(tl.bfloat16)
    r = w - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, N_TILES,
                   stride_xm, stride_xg, stride_wg, stride_wn, stride_om, stride_og,
                   SPLITS: tl.constexpr, K_STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_W: tl.constexpr = False, SWAP: tl.constexpr = False,
                   tail_count=None, tail_w=None, tail_ids=None, tail_bias=None, tail_scale=1.0,
                   ROUTE: tl.constexpr = False, TOPK: tl.constexpr = 1, BLOCK_E: tl.constexpr = 1,
                   BLOCK_TK: tl.constexpr = 1, HAS_BIAS: tl.constexpr = False, RENORM: tl.constexpr = False,
                   PDL: tl.constexpr = 0):
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    rows = tl.arange(0, BLOCK_M)
    r_mask = rows < M
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + g * stride_wg + n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + g * stride_xg + rows[:, None].to(tl.int64) * stride_xm
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = s * (K_STEPS * BLOCK_K)
    for i in range(K_STEPS):
        k = k_lo + i * BLOCK_K + kk
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        if SPLIT_W:  # float32 w = hi + mid + lo exactly, each bf16; x is bf16 (exact products)
            hi, mid, lo = split_bf16x3(w)
            acc += _dot(x, tl.trans(hi), "tf32")
            acc += _dot(x, tl.trans(mid), "tf32")
            acc += _dot(x, tl.trans(lo), "tf32")
        elif SWAP:  # (the weight tile as the MMA's M side: see the module doc)
            acc += _dot(w, tl.trans(x), "tf32")
        else:
            acc += _dot(x, tl.trans(w), "tf32")
    if SWAP:
        acc = tl.trans(acc)
    o = out_ptr + g * stride_og + rows[:, None].to(tl.int64) * stride_om + n[None, :]
    o_mask = r_mask[:, None] & n_mask[None, :]
    if SPLITS == 1:
        tl.store(o, cast_rne(acc, out_ptr.dtype.element_ty), mask=o_mask)
        if ROUTE:  # (every program finishes its tile: the last of them routes)
            route_tail(tail_count, N_TILES * tl.num_programs(1), out_ptr, stride_om, M, N, tail_w, tail_ids,
                       tail_bias, tail_scale, TOPK, BLOCK_M, BLOCK_E, BLOCK_TK, HAS_BIAS, RENORM)
    else:
        tile = g * N_TILES + pid_n
        cell = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [BLOCK_M, BLOCK_N] within a partial
        base = part_ptr + tile * (SPLITS * BLOCK_M * BLOCK_N)
        tl.store(base + s * (BLOCK_M * BLOCK_N) + cell, acc, mask=o_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release) below
        ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if ticket == SPLITS - 1:  # the last one: sum the partials in split order, reset the counter
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in range(SPLITS):
                total += tl.load(base + j * (BLOCK_M * BLOCK_N) + cell, mask=o_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(o, cast_rne(total, out_ptr.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(count_ptr + tile, 0)
            if ROUTE:  # (the tiles' last programs: the last of them routes)
                route_tail(tail_count, N_TILES * tl.num_programs(1), out_ptr, stride_om, M, N, tail_w, tail_ids,
                           tail_bias, tail_scale, TOPK, BLOCK_M, BLOCK_E, BLOCK_TK, HAS_BIAS, RENORM)


def _counter_buffer(device: torch.device) -> torch.Tensor:
    """The column tiles' zeroed ticket counters on this device's current stream (each call leaves them zeroed)."""
    return triton_tickets.counter("splitk", device, COUNTERS)


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether grouped_splitk runs x [M, G, K] against w [G, N, K]: 1..MAX_ROWS rows, one dtype of
    SUPPORTED_DTYPES (or bf16 rows against a float32 weight), contiguous along K, no more column tiles than the
    counters hold."""
    if x.dim() != 3 or w.dim() != 3 or x.dtype not in SUPPORTED_DTYPES:
        return False
    if w.dtype != x.dtype and not (x.dtype == torch.bfloat16 and w.dtype == torch.float32):
        return False
    if x.device != w.device or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[2]:
        return False
    return 0 < x.shape[0] <= MAX_ROWS and x.stride(2) == 1 and w.stride(2) == 1 \
        and w.shape[0] * cdiv(w.shape[1], BLOCK_N) <= COUNTERS


def supports_route(x: torch.Tensor, w: torch.Tensor, top_k: int, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether grouped_splitk(x, w, route=Tail(...)) carries a router of top_k (and bias): one group, K > 0, rows (padded as
    plan pads them) x experts within triton_ced_route.MAX_TAIL_LOGITS (x, w as supports takes them)."""
    return x.dim() == 3 and w.dim() == 3 and x.shape[1] == 1 and w.shape[0] == 1 and x.shape[2] > 0 \
        and supports_tail(x.shape[0], w.shape[1], top_k, bias, max(16, next_pow2(max(1, x.shape[0]))))


def plan(M: int, G: int, N: int, K: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM,
         block_k: int = BLOCK_K, block_n: int = BLOCK_N, max_splits: int = MAX_SPLITS) -> dict:
    """The launch for these shapes: BLOCK_M (rows padded to 16, 32 or 64), column tiles, splits (as many as bring
    the grid to ``per_sm`` programs an SM, at most ``max_splits`` and one K tile each) and K tiles per split."""
    tiles = G * cdiv(N, block_n)
    k_tiles = max(1, cdiv(K, block_k))
    want = max(1, min(max_splits, k_tiles, cdiv(per_sm * sm_count(device), tiles)))
    steps = cdiv(k_tiles, want)
    return dict(BLOCK_M=max(16, next_pow2(M)), BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=cdiv(k_tiles, steps),
                K_STEPS=steps, n_tiles=cdiv(N, block_n))


def grouped_splitk(x: torch.Tensor, w: torch.Tensor, *, per_sm: int = PROGRAMS_PER_SM, block_k: int = BLOCK_K,
                   block_n: int = BLOCK_N, max_splits: int = MAX_SPLITS, num_warps: int = 4,
                   num_stages: int = NUM_STAGES, out: Optional[torch.Tensor] = None,
                   route: Optional[Tail] = None, swap: bool = False) -> torch.Tensor:
    """x [M, G, K] @ w[g].T per group -> [M, G, N] in x's dtype, or float32 for a float32 w (``out``: a [M, G, N]
    tensor of that dtype to write, contiguous along N, any row / group strides). The keyword knobs are the
    launch's (benchmarks/gemv_bench.py times them; ``swap``: the weight tile as the MMA's M side, see the module
    doc, for same-dtype operands only). ``route``: a triton_ced_route.Tail for one group of N experts'
    float32 logits (a float32 w); the launch's last finishing program routes every row into its ``w`` / ``ids``."""
    for name, v, lo, hi, pow2 in (("block_k", block_k, 16, 512, True), ("block_n", block_n, 16, 512, True),
                                  ("num_warps", num_warps, 1, 16, True), ("num_stages", num_stages, 1, 8, False),
                                  ("per_sm", per_sm, 1, 64, False), ("max_splits", max_splits, 1, 1024, False)):
        check_knob("grouped_splitk", name, v, lo, hi, pow2)
    if not supports(x, w):
        raise ValueError(f"grouped_splitk: unsupported inputs: x {x.dtype} {tuple(x.shape)} stride {x.stride()}, "
                         f"w {w.dtype} {tuple(w.shape)} stride {w.stride()} (x [M <= {MAX_ROWS}, G, K] and "
                         f"w [G, N, K], one dtype of {SUPPORTED_DTYPES} or bf16 x with float32 w, contiguous "
                         "along K)")
    M, G, K = x.shape
    N = w.shape[1]
    split_w = w.dtype != x.dtype
    if not isinstance(swap, bool) or (swap and (split_w or route is not None)):
        raise ValueError(f"grouped_splitk: swap must be a bool, and True only for same-dtype operands without a "
                         f"route; got swap={swap!r}, x {x.dtype}, w {w.dtype}, route {route is not None}")
    dtype = torch.float32 if split_w else x.dtype
    if out is None:
        out = torch.empty(M, G, N, dtype=dtype, device=x.device)
    elif out.shape != (M, G, N) or out.dtype != dtype or out.stride(2) != 1:
        raise ValueError(f"grouped_splitk: out must be [{M}, {G}, {N}] {dtype}, contiguous along N; got "
                         f"{out.dtype} {tuple(out.shape)} stride {out.stride()}")
    p = plan(M, G, N, K, x.device, per_sm, block_k, block_n, max_splits)
    if route is not None and not (supports_route(x, w, route.top_k) and split_w and route.w.shape[0] == M
                                  and N == route.E):
        raise ValueError(f"grouped_splitk: route must be a Tail of {M} rows and {N} experts for one group of float32 "
                         f"logits with K > 0; got x {tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}")
    if N == 0 or G == 0:
        return out
    if K == 0:
        return out.zero_()
    S, BM, BN = p["SPLITS"], p["BLOCK_M"], p["BLOCK_N"]
    part = torch.empty(G * p["n_tiles"] * S * BM * BN if S > 1 else 1, dtype=torch.float32, device=x.device)
    _splitk_kernel[(p["n_tiles"], G, S)](
        x, w, out, part, _counter_buffer(x.device), M, N, K, p["n_tiles"],
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        SPLITS=S, K_STEPS=p["K_STEPS"], BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=p["BLOCK_K"], SPLIT_W=split_w, SWAP=swap,
        **(route.kernel_kw if route is not None else {}), num_warps=num_warps, num_stages=num_stages, **launch_kw(x.device))
    return out


def linear(x: torch.Tensor, w: torch.Tensor, **knobs) -> torch.Tensor:
    """F.linear(x, w) without bias for x [M, K] (M <= MAX_ROWS), w [N, K] -> [M, N]."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"linear: x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    return grouped_splitk(x[:, None, :], w[None], **knobs)[:, 0, :]
