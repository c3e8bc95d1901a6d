"""Fused mixture-of-experts (SwiGLU experts mixed by routing weights) in Triton, free of host syncs.

Algorithm, for x [T, d], w13 [E, 2F, d] (gate rows, then up rows), w2 [E, d, F], routing weights and
expert ids [T, k] (pair p = t * k + j is token t's j-th choice):

1. Alignment (two small kernels): a stable counting sort of the N = T * k pairs by expert. The pairs are
   cut into chunks; ``_count_kernel`` histograms every chunk; ``_place_kernel`` sums the chunk histograms
   into per-expert counts, pads each expert's segment to a multiple of BLOCK_M, and writes every pair's
   index at start[e] + (pairs of e before it) in ``sorted_ids``. Ids outside [0, E) go to one more bucket,
   E, whose pairs contribute zero (the reference path raises on them; here they are the router's bug, and
   checking would need a host sync). Every buffer is sized from shapes only: the padded layout has at
   most cdiv(N, BLOCK_M) + min(E + 1, N) M-blocks; a block at or past the real total (read on the device)
   exits at once. A row is valid when it lies within its expert's count. Padding rows compute on token 0
   (so every activation row GEMM 2 reads is written and finite) and are never stored to the output.
2. GEMM 1 + SwiGLU: a program takes an M-block (one expert's pairs, x rows gathered by token) and an
   N-tile of F, accumulates the gate rows n and the up rows F + n of w13[e] in float32, applies the optional
   DeepSeek-V4 clamp (gate <= clamp, |up| <= clamp) and silu(gate) * up, and stores the activation
   [padded rows, F] in x's dtype.
3. GEMM 2: activation @ w2[e].T times the pair's routing weight (float32), stored in x's dtype at the
   pair's own row of a [N, d] buffer; the k rows of each token are then summed in pair order in float32
   (``_ksum_kernel``; torch's reduction where PDL_CHAIN is off: deterministic either way, no atomics) into [T, d].

FP8 block-scaled weights (DeepSeek-V3): w13/w2 as float8_e4m3fn with float32 scales w13_scale
[E, cdiv(2F, 128), cdiv(d, 128)] and w2_scale [E, cdiv(d, 128), cdiv(F, 128)] (weight = fp8 * scale per
128 x 128 block). Tiles are converted to x's dtype in registers (exact: every e4m3 value is a bf16/fp16
value) and each BLOCK_K step's float32 product is multiplied by its block's scale (BLOCK_K divides 128,
so a step never straddles two scale blocks); activations stay in x's dtype (w8a16).

Supports x in bf16/fp16/fp32 with weights of the same dtype, or FP8 weights with scales; any strides;
d and F of any size; E up to MAX_EXPERTS. Block sizes come from shapes only (no autotuning), so a launch
is deterministic and can be captured in a CUDA graph.

Precision: products of bf16/fp16 operands are exact and accumulate in float32; float32 inputs use the
"ieee" dot (not tf32). The SwiGLU is float32; the activation and each pair's weighted output are rounded
to x's dtype once (as the reference's routed path rounds its matmuls), the k-sum accumulates in float32.
Expect ||out - ref|| / ||ref|| of a few 1e-3 in bf16 and ~1e-7 in float32 against experts_dense.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...pair_sum import PairSum
from ..reference.moe import FP8, SCALE_BLOCK, _check_experts, check_scales
from .triton_attention import sm_count
from .triton_norm import cast_rne, to_f32
from .triton_pdl import launch_kw, pdl_signal, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, merge_launch, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_EXPERTS = 1024
_INT32_MAX = tl.constexpr(2 ** 31 - 1)
# PDL_CHAIN: the five launches (count, place, GEMM 1, GEMM 2, k-sum) as a PDL chain (triton_pdl), the k-sum a Triton
# kernel (_ksum_kernel) instead of torch's reduction. Off, they launch normally and the PDL kernels on either side of
# them lose their overlap. On: the CED bench decode step on the H100 (25th session, profile_decode graph replay,
# two alternating runs against 0d6fa03) 2.818 / 2.828 against 2.925 / 2.924 ms at batch 16, 3.500 / 3.500 against
# 3.598 / 3.594 at 64 (batch 1 takes the pair kernels). Off: profile_decode --knob triton_moe.PDL_CHAIN=0.
PDL_CHAIN = True


# ------------------------------------------------------------------------------------------- helpers
@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in float32. The interpreter multiplies bf16 operands as raw bits, so there they are
    upcast first (exact)."""
    if _INTERP:
        return tl.dot(to_f32(a), to_f32(b), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _bucket(ids_ptr, idx, mask, E):
    """Expert id of pairs idx as an int32 bucket; ids outside [0, E) go to bucket E."""
    key = tl.load(ids_ptr + idx, mask=mask, other=0)
    return tl.where((key < 0) | (key >= E), E, key).to(tl.int32)


@triton.jit
def _block_expert(starts_ptr, counts_ptr, row0, NB, EB: tl.constexpr):
    """The bucket whose padded segment holds row row0: the last with start <= row0 (empty buckets share
    their successor's start). Returns (bucket, its first row, its pair count)."""
    e_off = tl.arange(0, EB)
    starts = tl.load(starts_ptr + e_off, mask=e_off < NB, other=_INT32_MAX)
    e = tl.sum((starts <= row0).to(tl.int32), axis=0) - 1
    return e, tl.load(starts_ptr + e), tl.load(counts_ptr + e)


@triton.jit
def _load_weight(ptrs, mask, dtype: tl.constexpr, EVEN: tl.constexpr, FP8_W: tl.constexpr):
    """A weight tile, FP8 converted to the activations' dtype (exact)."""
    if EVEN:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=mask, other=0.0)
    if FP8_W:
        if _INTERP:
            w = w.to(tl.float32)  # the interpreter's fp8 conversion is exact to float32
        else:
            w = w.to(dtype)
    return w


# ------------------------------------------------------------------------------------------- alignment
@triton.jit
def _count_kernel(ids_ptr, chunk_counts_ptr, N, E, CHUNK, S: tl.constexpr, EB: tl.constexpr,
                  CHUNK_I: tl.constexpr, PDL: tl.constexpr = 0):
    """chunk_counts[c, b] = pairs of chunk c (pairs c*CHUNK .. +CHUNK-1) in bucket b."""
    pdl_start(PDL)
    c = tl.program_id(0).to(tl.int64)
    hist = tl.zeros([EB], dtype=tl.int32)
    for s in range(0, CHUNK_I if _INTERP else CHUNK, S):
        idx = c * CHUNK + s + tl.arange(0, S)
        m = idx < N
        hist += tl.histogram(_bucket(ids_ptr, idx, m, E), EB, mask=m)
    tl.store(chunk_counts_ptr + c * EB + tl.arange(0, EB), hist)


@triton.jit
def _place_kernel(ids_ptr, chunk_counts_ptr, sorted_ptr, starts_ptr, counts_ptr,
                  N, E, CHUNK, NUM_CHUNKS,
                  BLOCK_M: tl.constexpr, S: tl.constexpr, EB: tl.constexpr, RB: tl.constexpr,
                  CHUNK_I: tl.constexpr, NUM_CHUNKS_I: tl.constexpr, PDL: tl.constexpr = 0):
    """Stable placement of chunk c's pairs; program 0 also writes starts [E + 2] (starts[E + 1] is the
    padded total) and counts [E + 1]."""
    pdl_start(PDL)
    c = tl.program_id(0)
    e_off = tl.arange(0, EB)
    total = tl.zeros([EB], dtype=tl.int32)  # pairs per bucket
    before = tl.zeros([EB], dtype=tl.int32)  # pairs per bucket in chunks before this one
    for r0 in range(0, NUM_CHUNKS_I if _INTERP else NUM_CHUNKS, RB):
        r = r0 + tl.arange(0, RB)
        tile = tl.load(chunk_counts_ptr + r[:, None].to(tl.int64) * EB + e_off[None, :],
                       mask=(r < NUM_CHUNKS)[:, None], other=0)  # [RB, EB]
        total += tl.sum(tile, axis=0)
        before += tl.sum(tl.where((r < c)[:, None], tile, 0), axis=0)
    padded = tl.cdiv(total, BLOCK_M) * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded  # [EB]; buckets past E are empty, so starts[E+1] = total
    if c == 0:
        tl.store(starts_ptr + e_off, starts, mask=e_off <= E + 1)
        tl.store(counts_ptr + e_off, total, mask=e_off <= E)
    nxt = starts + before  # next free row of each bucket for this chunk
    lane = tl.arange(0, S)
    earlier = lane[None, :] < lane[:, None]  # [S, S]: j before i
    for s in range(0, CHUNK_I if _INTERP else CHUNK, S):
        idx = c.to(tl.int64) * CHUNK + s + lane
        m = idx < N
        key = _bucket(ids_ptr, idx, m, E)
        same = (key[:, None] == key[None, :]) & earlier & m[None, :]
        rank = tl.sum(same.to(tl.int32), axis=1)  # pairs of the same bucket earlier in this sub-tile
        dest = tl.gather(nxt, tl.where(m, key, 0), 0) + rank
        tl.store(sorted_ptr + dest, idx.to(tl.int32), mask=m)
        nxt += tl.histogram(key, EB, mask=m)


# ------------------------------------------------------------------------------------------- grouped GEMMs
@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w_ptr, ws_ptr, act_ptr, sorted_ptr, starts_ptr, counts_ptr,
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_at,
    F, D, E, TOPK, NUM_N, clamp,
    EB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_CLAMP: tl.constexpr, FP8_W: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, D_I: tl.constexpr, PDL: tl.constexpr = 0,
):
    """act[rows of M-block, N-tile] = silu(x_rows @ gate.T) * (x_rows @ up.T) of the block's expert."""
    pdl_start(PDL, True)
    pid = tl.program_id(0)
    pid_m = pid // NUM_N
    pid_n = pid % NUM_N
    row0 = pid_m * BLOCK_M
    if row0 >= tl.load(starts_ptr + E + 1):  # past the padded total
        return
    e, start_e, count_e = _block_expert(starts_ptr, counts_ptr, row0, E + 1, EB)
    if e >= E:  # the bucket of out-of-range ids: GEMM 2 writes its zeros
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    valid = rows - start_e < count_e
    # Padding rows read token 0 (a real row): their results are never stored, and rows do not mix.
    pair = tl.load(sorted_ptr + rows, mask=valid, other=0)
    tok = (pair // TOPK).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < F
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + kk[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_e = w_ptr + e.to(tl.int64) * stride_we
    g_ptrs = w_e + n[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk  # [BLOCK_K, BLOCK_N] gate.T
    u_ptrs = w_e + (F + n)[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk  # up.T
    s_e = ws_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D_I if _INTERP else D, BLOCK_K):
        k_mask = k0 + kk < D
        if EVEN_K:
            xa = tl.load(x_ptrs)
        else:
            xa = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = _load_weight(g_ptrs, w_mask, x_ptr.dtype.element_ty, EVEN_K and EVEN_N, FP8_W)
        wu = _load_weight(u_ptrs, w_mask, x_ptr.dtype.element_ty, EVEN_K and EVEN_N, FP8_W)
        if FP8_W:  # one scale per 128 x 128 block; this K step lies inside one block column
            kb = k0 // 128
            sg = tl.load(s_e + (n // 128) * stride_sn + kb * stride_sk, mask=n_mask, other=0.0)
            su = tl.load(s_e + ((F + n) // 128) * stride_sn + kb * stride_sk, mask=n_mask, other=0.0)
            zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_g += _mma(xa, wg, zero, DOT_PRECISION) * sg[None, :]
            acc_u += _mma(xa, wu, zero, DOT_PRECISION) * su[None, :]
        else:
            acc_g = _mma(xa, wg, acc_g, DOT_PRECISION)
            acc_u = _mma(xa, wu, acc_u, DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    pdl_signal(PDL)
    if HAS_CLAMP:  # DeepSeek-V4: gate <= clamp, -clamp <= up <= clamp
        acc_g = tl.minimum(acc_g, clamp)
        acc_u = tl.maximum(tl.minimum(acc_u, clamp), -clamp)
    a = acc_g * tl.sigmoid(acc_g) * acc_u
    # Padding rows are stored too (finite: token 0's values), so GEMM 2 reads only written rows.
    tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_at + n[None, :], cast_rne(a, act_ptr.dtype.element_ty),
             mask=n_mask[None, :])


@triton.jit
def _gemm2_kernel(
    act_ptr, w_ptr, ws_ptr, rw_ptr, out_ptr, sorted_ptr, starts_ptr, counts_ptr,
    stride_at, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_ot,
    F, D, E, NUM_N,
    EB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8_W: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    F_I: tl.constexpr, PDL: tl.constexpr = 0,
):
    """out[pair, N-tile of d] = routing_weight[pair] * (act_row @ w2[e].T) for the M-block's pairs."""
    pdl_start(PDL, True)
    pid = tl.program_id(0)
    pid_m = pid // NUM_N
    pid_n = pid % NUM_N
    row0 = pid_m * BLOCK_M
    if row0 >= tl.load(starts_ptr + E + 1):
        return
    e, start_e, count_e = _block_expert(starts_ptr, counts_ptr, row0, E + 1, EB)
    rows = row0 + tl.arange(0, BLOCK_M)
    valid = rows - start_e < count_e
    pair = tl.load(sorted_ptr + rows, mask=valid, other=0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < D
    o_ptrs = out_ptr + pair[:, None] * stride_ot + n[None, :]
    o_mask = valid[:, None] & n_mask[None, :]
    if e >= E:  # pairs with an out-of-range id contribute zero
        tl.store(o_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty), mask=o_mask)
        return
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_at + kk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk
    s_e = ws_ptr + e.to(tl.int64) * stride_se + (n // 128) * stride_sn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F_I if _INTERP else F, BLOCK_K):
        k_mask = k0 + kk < F
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        w = _load_weight(w_ptrs, k_mask[:, None] & n_mask[None, :], act_ptr.dtype.element_ty, EVEN_K and EVEN_N,
                         FP8_W)
        if FP8_W:
            s = tl.load(s_e + (k0 // 128) * stride_sk, mask=n_mask, other=0.0)
            acc += _mma(a, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PRECISION) * s[None, :]
        else:
            acc = _mma(a, w, acc, DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    pdl_signal(PDL)
    rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)  # [BLOCK_M] float32 routing weights
    tl.store(o_ptrs, cast_rne(acc * rw[:, None], out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _ksum_kernel(pairs_ptr, out_ptr, D, stride_pt, stride_ot, TOPK: tl.constexpr, BLOCK_D: tl.constexpr,
                 PDL: tl.constexpr = 0):
    """out[t, tile] = sum over j in order of pairs[t * TOPK + j, tile], in float32, rounded once to out's dtype."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = n < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(pairs_ptr + (t * TOPK + j) * stride_pt + n, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + n, cast_rne(acc, out_ptr.dtype.element_ty), mask=m)


def k_sum(pairs: torch.Tensor, T: int, k: int, pdl: dict) -> torch.Tensor:
    """[T * k, d] weighted expert outputs -> [T, d]: each token's k rows summed in pair order in float32."""
    d = pairs.shape[1]
    out = torch.empty(T, d, dtype=pairs.dtype, device=pairs.device)
    BLOCK_D = min(1024, next_pow2(d)) if not INTERPRET else min(64, next_pow2(d))
    _ksum_kernel[(T, cdiv(d, BLOCK_D))](pairs, out, d, pairs.stride(0), out.stride(0), TOPK=k, BLOCK_D=BLOCK_D,
                                         num_warps=4, **pdl)
    return out


# ------------------------------------------------------------------------------------------- host side
def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per M-block from the mean pairs per expert: 16 (the smallest MMA tile) for decode-sized
    batches, 64 or 128 for prefill. Every expert's segment is padded to this, so it grows only when the
    mean load makes the padding a small share."""
    if INTERPRET:
        return 16 if num_pairs <= 2 * num_experts * 16 else 32
    mean = num_pairs / max(1, num_experts)
    return 16 if mean <= 32 else (64 if mean <= 512 else 128)


SMEM_BUDGET = 200 * 1024  # of the H200's 227 KB per block; Triton keeps (num_stages - 1) stages in flight


# The large-M tiles of the 29th (128-row M-blocks) and 32nd (64-row) sessions' sweeps (launch_config); off: the
# earlier ones, for A/B runs. FP8_PREFILL_TILES: the 32nd session's tiles for FP8 weights at 128-row M-blocks.
WIDE_PREFILL_TILES = True
FP8_PREFILL_TILES = True
_SMEM: dict = {}  # device index -> the shared memory a block may use (Triton's max_shared_mem), cached
HOPPER_SHARED_MEM = 232448  # an sm_90 block's (227 KB)


def max_shared_mem(device: torch.device) -> int:
    """Bytes of shared memory a program may use on ``device``: Triton's figure for a CUDA device (227 KB on
    sm_90, ~163 KB on an A100), Hopper's for any other device (the compile-only tests target sm_90)."""
    if device.type != "cuda":
        return HOPPER_SHARED_MEM
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMEM:
        _SMEM[idx] = int(triton.runtime.driver.active.utils.get_device_properties(idx)["max_shared_mem"])
    return _SMEM[idx]


def _stages(stage_bytes: int) -> int:
    return max(2, min(4, 1 + SMEM_BUDGET // stage_bytes))


def _gemm1_stage_bytes(BM: int, BK: int, BN: int, x_bytes: int, w_bytes: int) -> int:
    """Shared memory of one GEMM-1 pipeline stage: an x tile and the gate and up weight tiles."""
    return BM * BK * x_bytes + 2 * BK * BN * w_bytes


def launch_config(num_pairs: int, num_experts: int, F: int, d: int, device: torch.device,
                  block_m: Optional[int] = None, x_bytes: int = 2, w_bytes: int = 2) -> dict:
    """Tile sizes, warps and pipeline stages of both GEMMs, from shapes only (deterministic, capture-safe).

    For sm_90: BLOCK_M 16 (decode, memory bound on the weights) streams weights in 128-wide K steps; the
    GEMM-1 N tile narrows to 32 when few experts are active, so that enough programs stream weights to
    fill the GPU. Larger M-blocks use 64-wide K steps, 128-wide GEMM-2 N tiles (GEMM 1's gate and up
    tiles make 2 x 64) and 8 warps at BLOCK_M 128; there bf16 weights take 2 x 128 GEMM-1 tiles and three
    GEMM-2 stages (WIDE_PREFILL_TILES), and FP8 weights at BLOCK_M 128 take 128-deep GEMM-1 K steps and 64-wide
    GEMM-2 N tiles on 4 warps (FP8_PREFILL_TILES). float32 activations (tests, not serving) use 32-wide
    tiles. Up to four stages, fewer when tiles would overflow shared memory. BLOCK_K divides 128 (FP8
    scale blocks). x_bytes/w_bytes: element sizes of x and of the weights.
    """
    BM = block_m or choose_block_m(num_pairs, num_experts)
    wide = False
    if INTERPRET:
        return dict(BLOCK_M=BM, BN1=16, BK1=16, BN2=16, BK2=16, warps1=4, stages1=1, warps2=4, stages2=1)
    if x_bytes >= 4:  # float32 runs the "ieee" dot on FMA units: small tiles keep it out of local memory
        warps = 8 if BM >= 128 else 4
        cfg = dict(BLOCK_M=BM, BN1=32, BK1=32, BN2=32, BK2=32, warps1=warps, warps2=warps)
    elif BM <= 32:
        # benchmarks/moe_launch_sweep.py on the H200 (CED bench MoE, 16-128 tokens; 19th session): 64-wide GEMM-1
        # tiles beat 32-wide ones by 3-4 us a call once the active experts' tiles fill one wave (they had been
        # narrowed below two waves).
        active = min(num_pairs, num_experts)
        BN1 = 64 if active * cdiv(F, 64) >= sm_count(device) else 32
        cfg = dict(BLOCK_M=BM, BN1=BN1, BK1=128, BN2=64, BK2=128, warps1=4, warps2=4)
    else:
        warps = 8 if BM >= 128 else 4
        # moe_launch_sweep.py --prefill on the H100 (CED bench MoE, bf16): a 128-wide GEMM-1 N tile (2 x 128 of gate
        # and up) and three GEMM-2 stages. 29th session, 128-row M-blocks (16K tokens): 1117 and 1143 against 1228 us
        # a call each alone, the same bits; in the 16K prefill the MoE 9.52 -> 7.64 ms. 32nd session, 64-row blocks
        # (2K / 4K tokens): the wide GEMM-1 tile 213.6 / 365.4 against 239.3 / 401.6 us, three GEMM-2 stages
        # 230.4 / 392.4 (the same bits).
        # (four stages of the wide GEMM-1 tile take 160 KB at 64 rows, 192 KB at 128: where a block gets less
        # shared memory, an A100's ~163 KB at 128 rows, the old tiles stay)
        cfg = dict(BLOCK_M=BM, BN1=64, BK1=64, BN2=128, BK2=64, warps1=warps, warps2=warps)
        wide_bn1 = 128
        wide_stage = _gemm1_stage_bytes(BM, cfg["BK1"], wide_bn1, x_bytes, w_bytes)
        wide = WIDE_PREFILL_TILES and w_bytes == 2 and x_bytes == 2 \
            and _stages(wide_stage) * wide_stage <= max_shared_mem(device)
        if wide:
            cfg["BN1"] = wide_bn1
        elif FP8_PREFILL_TILES and BM >= 128 and w_bytes == 1 and x_bytes == 2:
            # The same sweep with block-scaled FP8 weights (--fp8, 16K tokens, 32nd session): a 128-deep GEMM-1 K
            # step (one scale block a step) 1931 against 2092 us a call; GEMM 2 on 64-wide N tiles and 4 warps 1994
            # (the same bits). 64-row blocks with FP8 weights were not swept and keep the old tiles.
            cfg.update(BK1=128, BN2=64, warps2=4)
    cfg["stages1"] = _stages(_gemm1_stage_bytes(BM, cfg["BK1"], cfg["BN1"], x_bytes, w_bytes))
    cfg["stages2"] = _stages(BM * cfg["BK2"] * x_bytes + cfg["BK2"] * cfg["BN2"] * w_bytes)
    if wide:
        cfg["stages2"] = 3
    if BM <= 32 and x_bytes < 4 and cdiv(F, cfg["BK2"]) <= 4:
        cfg["stages2"] = 2  # a short K loop (the same sweep: F = 512, 2 us a call faster than 4 stages)
    return cfg


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded layout for any routing: cdiv(N, BLOCK_M) + min(E + 1, N) blocks (one partial
    block per non-empty bucket, bucket E holding out-of-range ids)."""
    return (cdiv(num_pairs, block_m) + min(num_experts + 1, num_pairs)) * block_m


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int, pdl: Optional[dict] = None):
    """Sort the pairs of ids [T, k] by expert (stable) into BLOCK_M-padded segments, on the device.

    Returns (sorted_ids [max_rows] int32, starts [E + 2] int32, counts [E + 1] int32): bucket b (expert b,
    or E for ids outside [0, E)) holds its counts[b] pairs at rows starts[b] .. starts[b] + counts[b] - 1
    in ascending pair order; starts[E + 1] is the padded total. Padding rows are left unwritten.
    pdl: triton_pdl.launch_kw's arguments for both launches (fused_experts' PDL_CHAIN), or none.
    """
    pdl = pdl or {}
    flat = ids.reshape(-1)  # [N]; pair p = t * k + j
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    N, E = flat.numel(), num_experts
    EB = next_pow2(E + 2)
    S = 16 if INTERPRET else (64 if EB <= 512 else 32)  # sub-tile: [S, S] and [S] x EB work per step
    target = 4 if INTERPRET else 128  # chunks (programs); each program reads every chunk's histogram
    CHUNK = S * cdiv(cdiv(max(N, 1), S), target)
    C = cdiv(max(N, 1), CHUNK)
    dev = flat.device
    sorted_ids = torch.empty(max_rows(N, E, block_m), dtype=torch.int32, device=dev)
    starts = torch.empty(E + 2, dtype=torch.int32, device=dev)
    counts = torch.empty(E + 1, dtype=torch.int32, device=dev)
    chunk_counts = torch.empty(C, EB, dtype=torch.int32, device=dev)
    _count_kernel[(C,)](flat, chunk_counts, N, E, CHUNK, S=S, EB=EB, CHUNK_I=_i(CHUNK), num_warps=4, **pdl)
    _place_kernel[(C,)](flat, chunk_counts, sorted_ids, starts, counts, N, E, CHUNK, C,
                        BLOCK_M=block_m, S=S, EB=EB, RB=8, CHUNK_I=_i(CHUNK),
                        NUM_CHUNKS_I=_i(C), num_warps=4, **pdl)
    return sorted_ids, starts, counts


def _i(n: int) -> int:
    """A loop bound for the interpreter, which cannot take runtime ints as range() bounds under numpy >= 2.4
    (triton-lang/triton#9171); 0 when compiled, so it never causes a recompile."""
    return int(n) if INTERPRET else 0


def _is_fp8(w: torch.Tensor) -> bool:
    return w.dtype == FP8


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None) -> bool:
    """Whether fused_experts runs these inputs (shapes as the reference op checks them)."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or ids.dim() != 2 or weights.shape != ids.shape:
        return False
    if x.dtype not in SUPPORTED_DTYPES or ids.dtype not in (torch.int32, torch.int64):
        return False
    if not weights.dtype.is_floating_point:
        return False
    if not 1 <= w13.shape[0] <= MAX_EXPERTS:
        return False
    if _is_fp8(w13) or _is_fp8(w2):
        return _is_fp8(w13) and _is_fp8(w2) and w13_scale is not None and w2_scale is not None
    return w13.dtype == x.dtype and w2.dtype == x.dtype and w13_scale is None and w2_scale is None


# fused_experts' launch overrides (merge_launch): tiles and warps powers of two, stages a small count.
_LAUNCH_BOUNDS = {**{f"{k}{g}": (16, 256, True) for k in ("BN", "BK") for g in (1, 2)},
                  **{f"warps{g}": (1, 16, True) for g in (1, 2)}, **{f"stages{g}": (1, 8, False) for g in (1, 2)}}


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  *, clamp: Optional[float] = None, w13_scale: Optional[torch.Tensor] = None,
                  w2_scale: Optional[torch.Tensor] = None, block_m: Optional[int] = None,
                  launch: Optional[dict] = None, pair_sum: bool = False):
    """SwiGLU experts mixed by routing weights, as reference.moe.experts_routed, with no host sync.

    x [T, d] (bf16/fp16/fp32); w13 [E, 2F, d] and w2 [E, d, F] in x's dtype, or float8_e4m3fn with
    w13_scale [E, cdiv(2F, 128), cdiv(d, 128)] and w2_scale [E, cdiv(d, 128), cdiv(F, 128)] float32;
    weights [T, k] (float32); ids [T, k] int64/int32. clamp: DeepSeek-V4's SwiGLU clamp. block_m
    overrides the M-block rows (tests); ``launch`` overrides launch_config's other keys (BN1, BK1, warps1,
    stages1, BN2, BK2, warps2, stages2: benchmarks/moe_launch_sweep.py times them). Ids are not range-checked
    (that would sync): a pair with an id outside [0, E) contributes zero. Returns [T, d] in x's dtype; with
    ``pair_sum`` (and PDL_CHAIN) a pair_sum.PairSum of the [T * k, d] weighted rows instead, whose value is k_sum's.
    """
    _check_experts(x, w13, w2, weights, ids, clamp)
    check_scales(w13, w2, w13_scale, w2_scale)
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    fp8 = _is_fp8(w13)
    if not fp8 and (w13.dtype != x.dtype or w2.dtype != x.dtype):
        raise ValueError(f"w13/w2 must have x's dtype {x.dtype} (or be float8_e4m3fn with scales), "
                         f"got {w13.dtype} and {w2.dtype}")
    if not 1 <= w13.shape[0] <= MAX_EXPERTS:
        raise ValueError(f"w13 must have 1..{MAX_EXPERTS} experts, got {w13.shape[0]}")
    if block_m is not None and block_m not in (16, 32, 64, 128):
        raise ValueError(f"block_m must be 16, 32, 64 or 128, got {block_m}")
    T, d = x.shape
    E, F = w13.shape[0], w13.shape[1] // 2
    k = ids.shape[1]
    N = T * k
    if N == 0 or F == 0 or d == 0:
        return torch.zeros(T, d, dtype=x.dtype, device=x.device)
    dev = x.device
    cfg = launch_config(N, E, F, d, dev, block_m, x.element_size(), w13.element_size())
    cfg = merge_launch("fused_experts", cfg, launch, _LAUNCH_BOUNDS)
    BM = cfg["BLOCK_M"]
    if fp8:
        if SCALE_BLOCK % cfg["BK1"] or SCALE_BLOCK % cfg["BK2"]:
            raise ValueError(f"FP8 weights need BK1 and BK2 dividing {SCALE_BLOCK}, got {cfg['BK1']} and {cfg['BK2']}")
    pdl = launch_kw(dev) if PDL_CHAIN else {}
    sorted_ids, starts, counts = align_pairs(ids, E, BM, pdl)
    rows = sorted_ids.shape[0]
    rw = weights.reshape(-1).to(torch.float32).contiguous()  # [N]
    s13 = w13_scale if fp8 else rw  # placeholders: never read without FP8
    s2 = w2_scale if fp8 else rw
    s13_strides = s13.stride() if fp8 else (0, 0, 0)
    s2_strides = s2.stride() if fp8 else (0, 0, 0)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    EB = next_pow2(E + 2)

    act = torch.empty(rows, F, dtype=x.dtype, device=dev)  # [padded rows, F]
    n1 = cdiv(F, cfg["BN1"])
    _gemm1_swiglu_kernel[(rows // BM * n1,)](
        x, w13, s13, act, sorted_ids, starts, counts,
        x.stride(0), x.stride(1), *w13.stride(), *s13_strides, act.stride(0),
        F, d, E, k, n1, float(clamp) if clamp is not None else 0.0,
        EB=EB, BLOCK_M=BM, BLOCK_N=cfg["BN1"], BLOCK_K=cfg["BK1"], HAS_CLAMP=clamp is not None, FP8_W=fp8,
        EVEN_K=d % cfg["BK1"] == 0, EVEN_N=F % cfg["BN1"] == 0, DOT_PRECISION=precision, D_I=_i(d),
        num_warps=cfg["warps1"], num_stages=cfg["stages1"], **pdl,
    )
    out_pairs = torch.empty(N, d, dtype=x.dtype, device=dev)  # [T * k, d] weighted expert outputs
    n2 = cdiv(d, cfg["BN2"])
    _gemm2_kernel[(rows // BM * n2,)](
        act, w2, s2, rw, out_pairs, sorted_ids, starts, counts,
        act.stride(0), *w2.stride(), *s2_strides, out_pairs.stride(0),
        F, d, E, n2,
        EB=EB, BLOCK_M=BM, BLOCK_N=cfg["BN2"], BLOCK_K=cfg["BK2"], FP8_W=fp8,
        EVEN_K=F % cfg["BK2"] == 0, EVEN_N=d % cfg["BN2"] == 0, DOT_PRECISION=precision, F_I=_i(F),
        num_warps=cfg["warps2"], num_stages=cfg["stages2"], **pdl,
    )
    if PDL_CHAIN:
        if pair_sum:
            return PairSum(out_pairs, k, lambda p, kk: k_sum(p, T, kk, pdl))
        return k_sum(out_pairs, T, k, pdl)
    return out_pairs.view(T, k, d).sum(dim=1)  # deterministic k-sum, float32 accumulation
