"""CED's router logits at prefill sizes in one launch: x [M, K] bf16 @ gate [N, K] float32 .T -> [M, N] float32.

The reference computes ``x.float() @ gate.T``: on a GPU a cast kernel writing x again in float32 (twice its
bytes) and then a float32 GEMM on the CUDA cores (N is only the expert count, 32 in the bench config). In a 16K
bounded prefill that pair took ~1.5 ms (H100, 32nd session's profile: the SIMT GEMM 0.70 ms over 8 calls, the
casts ~0.9 ms). Here each program owns BLOCK_M rows and BLOCK_N experts over all of K; the gate's float32 tile is
split in registers into three bf16 tiles that sum to it exactly (triton_splitk.split_bf16x3), so three
tensor-core products of exact bf16 x bf16 terms accumulate the float32 product's value in float32. x is read once,
as bf16. Rows are independent: a row's result does not depend on M or on the other rows.

Decode-sized calls keep triton_gemv / triton_splitk (NvidiaOps.ced_moe_route's row limits); this runs past them
where ``ops.CED_ROUTE_LOGITS_TILED`` is on.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_attention import _dot
from .triton_pdl import launch_kw, pdl_start
from .triton_splitk import split_bf16x3
from deepinfer.backends.nvidia.host_math import cdiv, check_knob, next_pow2

BLOCK_M = 64
# 128-deep K steps since the 35th session: 0.49-0.50 ms over the 16K prefill's 16 calls against 0.67-0.68 at 64
# (s35a, H100; the s33b sweep: 25.4 against 27.5 us a call alone).
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _logits_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
                   PDL: tl.constexpr = 0):
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < M
    n_mask = n < N
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(K_STEPS):  # (a constexpr count: K is the model's hidden size, one build per model)
        k = i * BLOCK_K + kk
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        hi, mid, lo = split_bf16x3(w)
        acc += _dot(x, tl.trans(hi), "tf32")
        acc += _dot(x, tl.trans(mid), "tf32")
        acc += _dot(x, tl.trans(lo), "tf32")
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + n[None, :], acc,
             mask=r_mask[:, None] & n_mask[None, :])


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether logits runs x [M, K] (bf16) against w [N, K] (float32): one device, both contiguous along K."""
    return x.dim() == 2 and w.dim() == 2 and x.dtype == torch.bfloat16 and w.dtype == torch.float32 \
        and x.device == w.device and x.shape[1] == w.shape[1] and x.stride(1) == 1 and w.stride(1) == 1


def logits(x: torch.Tensor, w: torch.Tensor, *, block_m: Optional[int] = None, block_k: Optional[int] = None,
           num_warps: Optional[int] = None, num_stages: Optional[int] = None) -> torch.Tensor:
    """x.float() @ w.T in float32 for bf16 x [M, K] and float32 w [N, K] (see the module doc); the keyword knobs
    are the launch's (tiles powers of two: rows 16-256, K steps 16-256), the module's BLOCK_M / BLOCK_K / NUM_WARPS /
    NUM_STAGES where not given (read per call, so a benchmark's --knob reaches them)."""
    block_m = BLOCK_M if block_m is None else block_m
    block_k = BLOCK_K if block_k is None else block_k
    num_warps = NUM_WARPS if num_warps is None else num_warps
    num_stages = NUM_STAGES if num_stages is None else num_stages
    for name, v, lo, hi, pow2 in (("block_m", block_m, 16, 256, True), ("block_k", block_k, 16, 256, True),
                                  ("num_warps", num_warps, 1, 16, True), ("num_stages", num_stages, 1, 8, False)):
        check_knob("router logits", name, v, lo, hi, pow2)
    if not supports(x, w):
        raise ValueError(f"router logits: x must be bf16 [M, K] and w float32 [N, K] on one device, both contiguous "
                         f"along K; got x {x.dtype} {tuple(x.shape)} stride {tuple(x.stride())} on {x.device}, "
                         f"w {w.dtype} {tuple(w.shape)} stride {tuple(w.stride())} on {w.device}")
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    BN = max(16, min(64, next_pow2(N)))  # (32 experts: one column tile)
    _logits_kernel[(cdiv(M, block_m), cdiv(N, BN))](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=BN,
        BLOCK_K=block_k, K_STEPS=cdiv(K, block_k), num_warps=num_warps, num_stages=num_stages, **launch_kw(x.device))
    return out
