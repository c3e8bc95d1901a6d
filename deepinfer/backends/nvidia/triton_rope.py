"""Rotary position embedding of q and k in one Triton launch (out of place).

Each program owns one token and a tile of heads, of q or of k (the grid's second axis runs over q's head
tiles, then k's). It reads the token's position, its cos/sin row of the float32 cache [P, R] = cat(cos,
sin) (gathered in the kernel, no index_select), rotates the first R channels, neox halves (x[:R/2],
x[R/2:R]) or interleaved pairs (x[2i], x[2i+1]), and copies channels R..D unchanged into a new
contiguous [T, heads, D] output. q and k may be strided views (split out of a fused qkv projection).

Precision: the same float32 operations as the reference (``models.rope.rotate``): x1*cos and x2*sin are
each rounded, then subtracted (added) and the result is rounded once to the input's dtype. FMA fusion is
switched off for this kernel, so outputs are bit-identical to the reference's in every dtype. Only
float32 caches are handled (a lower-precision cache rounds every step: the reference op serves it).
Positions must lie in [0, P): not checked (that would be a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_norm import cast_rne, to_f32
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_tile(x_ptr, o_ptr, t, h0, NH, D, HALF, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
                 BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                 INTERLEAVED: tl.constexpr):
    h = h0 + tl.arange(0, BLOCK_H)
    x_base = x_ptr + t * stride_xt + h[:, None] * stride_xh
    o_base = o_ptr + t * stride_ot + h[:, None] * stride_oh
    out_ty = o_ptr.dtype.element_ty
    if INTERLEAVED:
        # Load the rotary channels whole (coalesced) and split them into (even, odd) pairs in registers.
        c = tl.arange(0, 2 * BLOCK_R)
        m = (h < NH)[:, None] & (c < 2 * HALF)[None, :]
        x = to_f32(tl.load(x_base + c[None, :], mask=m, other=0.0))
        a, b = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_R, 2)))
        o1 = a * cos[None, :] - b * sin[None, :]
        o2 = b * cos[None, :] + a * sin[None, :]
        o = tl.reshape(tl.join(o1, o2), (BLOCK_H, 2 * BLOCK_R))
        tl.store(o_base + c[None, :], cast_rne(o, out_ty), mask=m)
    else:
        j = tl.arange(0, BLOCK_R)
        m = (h < NH)[:, None] & (j < HALF)[None, :]
        a = to_f32(tl.load(x_base + j[None, :], mask=m, other=0.0))
        b = to_f32(tl.load(x_base + HALF + j[None, :], mask=m, other=0.0))
        o1 = a * cos[None, :] - b * sin[None, :]
        o2 = b * cos[None, :] + a * sin[None, :]
        tl.store(o_base + j[None, :], cast_rne(o1, out_ty), mask=m)
        tl.store(o_base + HALF + j[None, :], cast_rne(o2, out_ty), mask=m)
    if BLOCK_P > 0:  # channels 2 * HALF .. D pass through
        c = 2 * HALF + tl.arange(0, BLOCK_P)
        mp = (h < NH)[:, None] & (c < D)[None, :]
        tl.store(o_base + c[None, :], tl.load(x_base + c[None, :], mask=mp), mask=mp)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_pos, stride_cs,
    H, HK, DQ, DK, HALF, NQT,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_PQ: tl.constexpr, BLOCK_PK: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    cs_row = cs_ptr + pos * stride_cs
    cos = tl.load(cs_row + j, mask=j < HALF, other=0.0)
    sin = tl.load(cs_row + HALF + j, mask=j < HALF, other=0.0)
    if tile < NQT:
        _rotate_tile(q_ptr, qo_ptr, t, tile * BLOCK_H, H, DQ, HALF, stride_qt, stride_qh, stride_qot, stride_qoh,
                     cos, sin, BLOCK_H, BLOCK_R, BLOCK_PQ, INTERLEAVED)
    else:
        _rotate_tile(k_ptr, ko_ptr, t, (tile - NQT) * BLOCK_H, HK, DK, HALF, stride_kt, stride_kh, stride_kot,
                     stride_koh, cos, sin, BLOCK_H, BLOCK_R, BLOCK_PK, INTERLEAVED)


def _problem(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Why the kernel cannot take these inputs (an error message naming the argument), or None."""
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 3 or x.dtype not in SUPPORTED_DTYPES:
            return f"{name} must be [T, heads, D] float16/bfloat16/float32, got {tuple(x.shape)} {x.dtype}"
    T = q.shape[0]
    if k.shape[0] != T:
        return f"k has {k.shape[0]} tokens, q has {T}"
    if positions.dim() != 1 or positions.shape[0] != T or positions.dtype not in (torch.int32, torch.int64):
        return f"positions must be [{T}] int32/int64, got {tuple(positions.shape)} {positions.dtype}"
    if cos_sin_cache.dim() != 2 or cos_sin_cache.dtype != torch.float32:
        return f"cos_sin_cache must be [P, R] float32, got {tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype}"
    R = cos_sin_cache.shape[1]
    if R == 0 or R % 2 or R > q.shape[2] or R > k.shape[2]:
        return (f"cos_sin_cache's rotary dim {R} must be even, > 0 and <= the head dims of q ({q.shape[2]}) "
                f"and k ({k.shape[2]})")
    for name, x in (("k", k), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if x.device != q.device:
            return f"{name} is on {x.device}, q on {q.device}"
    return None


def supports(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    return _problem(q, k, positions, cos_sin_cache) is None


def launch_config(H: int, Hk: int, half: int, Dq: int, Dk: int, R: int) -> dict:
    """A tile of heads x rotary pairs of about 2048 elements (at most 16 per thread with 4 warps)."""
    block_r = next_pow2(half)
    return {
        "BLOCK_R": block_r,
        "BLOCK_H": max(1, min(next_pow2(max(H, Hk)), (64 if INTERPRET else 2048) // block_r)),
        "BLOCK_PQ": next_pow2(Dq - R) if Dq > R else 0,
        "BLOCK_PK": next_pow2(Dk - R) if Dk > R else 0,
        "num_warps": 1 if INTERPRET else 4,
    }


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Ops.apply_rotary: q [T, H, Dq], k [T, Hk, Dk] (any strides; the last dim is made unit-stride),
    positions [T] int, cos_sin_cache [P, R] float32 -> new contiguous (q, k), bit-identical to
    models.rope.rotate."""
    problem = _problem(q, k, positions, cos_sin_cache)
    if problem is not None:
        raise ValueError(f"apply_rotary: {problem}")
    T, H, Dq = q.shape
    Hk, Dk = k.shape[1], k.shape[2]
    R = cos_sin_cache.shape[1]
    q_out = torch.empty((T, H, Dq), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, Hk, Dk), dtype=k.dtype, device=k.device)
    if T == 0 or H + Hk == 0:
        return q_out, k_out
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(1) == 1 else cos_sin_cache.contiguous()
    cfg = launch_config(H, Hk, R // 2, Dq, Dk, R)
    nqt = cdiv(H, cfg["BLOCK_H"])
    grid = (T, nqt + cdiv(Hk, cfg["BLOCK_H"]))
    _rope_kernel[grid](
        q, k, q_out, k_out, positions, cs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), positions.stride(0), cs.stride(0),
        H, Hk, Dq, Dk, R // 2, nqt,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_R=cfg["BLOCK_R"], BLOCK_PQ=cfg["BLOCK_PQ"], BLOCK_PK=cfg["BLOCK_PK"],
        INTERLEAVED=bool(interleaved), num_warps=cfg["num_warps"],
        enable_fp_fusion=False,  # round x*cos and x*sin separately, as the reference does
    )
    return q_out, k_out
