"""CED's RMSNorm and RoPE (models/ced/functional.py ``rms``, ``apply_rope``), one Triton launch each.

The torch formulas run as ~9 (rms) and ~20 (rope: cos/sin, casts, strided slices, stack, cat) small kernels a
call, ~50 and ~50 calls per CED decode step; these kernels do the same float32 operations in one launch.

- ``rms_norm``: ``(xf * rsqrt(mean(xf^2) + eps) * w.float()).to(x.dtype)`` with xf = x in float32: the weight
  is applied in float32 and the result rounded ONCE to x's dtype (unlike triton_norm, the Llama-style op that
  rounds the normalised row before the weight). One program per row.
- ``rope``: rotate adjacent pairs (2i, 2i+1) of the last R channels of x [T, ..., D] by the angle
  pos[t] * inv_freq[i] (or its inverse, sin negated), in float32, rounded to x's dtype; channels 0 .. D - R are
  copied. cos and sin are computed in the kernel from the positions; inv_freq [R/2] is the model's own float32
  frequencies (``inv_freq`` keeps them per device, computed by functional.rope_inv_freq). One program per
  token and tile of the middle dims (heads).

Precision. FMA fusion is off, so every product and sum is rounded where torch rounds it. Compiled code takes
cos, sin and rsqrt from libdevice, the CUDA math library torch's kernels call (cosf, sinf, rsqrtf), so
``rope`` is meant to be bit-identical to the torch formula on the GPU (tests/test_triton_ced_fused.py checks
it there). ``rms_norm`` sums the squares in a different order than torch's reduction, so its mean can differ
in the last float32 bit: outputs then differ by at most ~1 ulp of x's dtype (in float32 a few ulp), and
are equal nearly always in bf16. Under Triton's interpreter cos/sin/rsqrt are numpy's, within ~1 ulp of torch's.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_norm import cast_rne, to_f32
from .triton_pdl import launch_kw, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
if not INTERPRET:
    from triton.language.extra import libdevice
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK = 65536  # widest row (rms) / non-rotated part (rope) kept in one program
MAX_KSUM = 16  # pair rows a token add_rms_norm adds in place of a residual row (an unrolled loop)


@triton.jit
def _cos_sin(ang):
    """cosf/sinf as torch's CUDA kernels compute them (libdevice); numpy's under the interpreter."""
    if _INTERP:
        return tl.cos(ang), tl.sin(ang)
    else:
        return libdevice.cos(ang), libdevice.sin(ang)


@triton.jit
def _rsqrt(x):
    if _INTERP:
        return tl.rsqrt(x)
    else:
        return libdevice.rsqrt(x)


@triton.jit
def _rms_row(xf, w_ptr, cols, mask, N, eps):
    """CED's RMSNorm of one row xf [BLOCK] float32 (0 past N; cols, mask its channels) with the weight at w_ptr:
    xf * rsqrt(sum(xf^2) / N + eps) * w in float32, not rounded (the callers round once, to their dtype).
    Shared by every CED kernel that norms a row, so they all do these float32 operations in this order."""
    rstd = _rsqrt(tl.sum(_mul_rn(xf, xf), axis=0) / N + eps)  # (no FMA in the sum, whatever the kernel's flags)
    w = to_f32(tl.load(w_ptr + cols, mask=mask, other=0.0))
    return xf * rstd * w


@triton.jit
def _rotate(a, b, cos, sin):
    """RoPE on adjacent pairs (a, b) = (x[2i], x[2i + 1]), as functional.apply_rope: (a cos - b sin,
    b cos + a sin) in float32, not rounded."""
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _mul_rn(a, b):
    """a * b in float32, rounded on its own: a product with an explicit rounding mode is never contracted with
    the add after it into an FMA, so kernels compiled with FMA fusion on still round as torch does."""
    if _INTERP:
        return a * b
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def rope_pairs(x, xp, c, cos_ptr, sin_ptr, D, HALF, INVERSE: tl.constexpr):
    """Channels c [BLOCK] of rows x [ROWS, BLOCK] float32 (one token's; values already rounded to their dtype),
    xp the same rows' pair partners (channel c ^ 1): the pairs (2i, 2i + 1) of the last 2 HALF of D channels
    rotated by the token's angles, whose cos and sin [HALF] float32 are at cos_ptr, sin_ptr (a row of
    functional.rope_cos_sin), or by their inverse with INVERSE: functional.apply_rope's products and sums, each
    rounded as torch rounds it, also in kernels compiled with FMA fusion on; other channels unchanged. Float32,
    not rounded. With the partner loaded as a tile of its own, nothing is reshaped in registers, and there is no
    trigonometry (libdevice's sinf / cosf keep a local-memory array for huge angles)."""
    i = c // 2 - (D // 2 - HALF)  # channel c's rotary pair
    on = (i >= 0) & (i < HALF) & (c < D)
    cos = tl.load(cos_ptr + i, mask=on, other=1.0)[None, :]
    sin = tl.load(sin_ptr + i, mask=on, other=0.0)[None, :]
    if INVERSE:
        sin = -sin
    u = _mul_rn(x, cos)
    v = _mul_rn(xp, sin)
    return tl.where(on[None, :], tl.where((c % 2 == 0)[None, :], u - v, u + v), x)  # (a cos - b sin, b cos + a sin)


@triton.jit
def _rope_row(x, pos, inv_ptr, N, HALF, DT: tl.constexpr, BLOCK: tl.constexpr):
    """One row x [BLOCK] float32 (N channels) with its pairs (2i, 2i + 1) of the last 2 HALF channels rotated by
    pos * inv[i - first] (pos float32; inv [HALF] float32 at inv_ptr), each rotated value rounded to DT (as the
    torch formula rounds apply_rope's output); the other channels as they are. Returns [BLOCK] float32."""
    a, b = tl.split(tl.reshape(x, (BLOCK // 2, 2)))
    pair = tl.arange(0, BLOCK // 2)
    first = N // 2 - HALF
    rot = (pair >= first) & (pair < N // 2)
    inv = tl.load(inv_ptr + (pair - first), mask=rot, other=0.0)
    cos, sin = _cos_sin(pos * inv)
    o1, o2 = _rotate(a, b, cos, sin)
    o1 = tl.where(rot, to_f32(cast_rne(o1, DT)), a)
    o2 = tl.where(rot, to_f32(cast_rne(o2, DT)), b)
    return tl.reshape(tl.join(o1, o2), (BLOCK,))


@triton.jit
def _ced_rms_kernel(x_ptr, w_ptr, o_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    xf = to_f32(tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0))
    o = _rms_row(xf, w_ptr, cols, mask, N, eps)
    tl.store(o_ptr + row * stride_o + cols, cast_rne(o, o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ced_add_rms_kernel(x_ptr, r_ptr, e_ptr, w_ptr, h_ptr, o_ptr, stride_x, stride_r, stride_e, stride_h, stride_o, N,
                        eps, BLOCK: tl.constexpr, HAS_EXTRA: tl.constexpr, KSUM: tl.constexpr = 1,
                        NORM: tl.constexpr = True, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    DT = h_ptr.dtype.element_ty
    if KSUM > 1:  # r: KSUM rows a token (a MoE's pairs), summed in pair order in float32 and rounded once (k_sum)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(KSUM):
            acc += to_f32(tl.load(r_ptr + (row * KSUM + j) * stride_r + cols, mask=mask, other=0.0))
        add = to_f32(cast_rne(acc, DT))
    else:
        add = to_f32(tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0))
    if HAS_EXTRA:  # (r + e) rounded first, as torch adds them
        add = to_f32(cast_rne(add + to_f32(tl.load(e_ptr + row * stride_e + cols, mask=mask, other=0.0)), DT))
    h = cast_rne(to_f32(tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)) + add, DT)
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    if NORM:  # (off: the residual add alone, add_moe)
        tl.store(o_ptr + row * stride_o + cols, cast_rne(_rms_row(to_f32(h), w_ptr, cols, mask, N, eps), DT),
                 mask=mask)


@triton.jit
def add_rms_tail(count_ptr, programs, x_ptr, stride_x, r_ptr, stride_r, w_ptr, h_ptr, stride_h, o_ptr, stride_o, M,
                 N, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """add_rms_norm (no extra) of rows a product has just stored (x, [M, N]) on that product's last program: each
    of its ``programs`` calls this after its stores and takes a ticket; the one that takes the last reads the rows
    back (past L1) and stores h = x + residual and rms(h), row by row as _ced_add_rms_kernel does (the same float32
    operations and rounding), then resets the counter for the next call (a CUDA graph's replay included). ROWS:
    the most rows M may be (the interpreter's loop bound)."""
    tl.debug_barrier()  # every thread's stores are done before the ticket (release) below
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if ticket == programs - 1:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        DT = h_ptr.dtype.element_ty
        for row in range(ROWS if _INTERP else M):  # (the interpreter takes constexpr bounds)
            on = mask & (row < M)
            add = to_f32(tl.load(r_ptr + row * stride_r + cols, mask=on, other=0.0))
            x = to_f32(tl.load(x_ptr + row * stride_x + cols, mask=on, other=0.0, cache_modifier=".cg"))
            h = cast_rne(x + add, DT)
            tl.store(h_ptr + row * stride_h + cols, h, mask=on)
            tl.store(o_ptr + row * stride_o + cols, cast_rne(_rms_row(to_f32(h), w_ptr, cols, mask, N, eps), DT),
                     mask=on)
        tl.atomic_xchg(count_ptr, 0)


@triton.jit
def _exp(x):
    if _INTERP:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _ced_swiglu_kernel(gu_ptr, o_ptr, stride_g, stride_o, F, limit, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    DT = o_ptr.dtype.element_ty
    g = to_f32(tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0))
    u = to_f32(tl.load(gu_ptr + row * stride_g + F + cols, mask=mask, other=0.0))
    g = tl.minimum(g, limit)  # (clamps are exact in any dtype)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    s = to_f32(cast_rne(g / (1.0 + _exp(-g)), DT))  # F.silu, rounded to the dtype
    tl.store(o_ptr + row * stride_o + cols, cast_rne(s * u, DT), mask=mask)


@triton.jit
def _ced_rope_kernel(x_ptr, o_ptr, pos_ptr, inv_ptr, stride_xt, stride_xm, stride_ot, stride_om, M, D, HALF,
                     BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, INVERSE: tl.constexpr,
                     PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < M
    x_base = x_ptr + t * stride_xt + rows[:, None].to(tl.int64) * stride_xm
    o_base = o_ptr + t * stride_ot + rows[:, None].to(tl.int64) * stride_om
    j = tl.arange(0, BLOCK_R)
    inv = tl.load(inv_ptr + j, mask=j < HALF, other=0.0)
    cos, sin = _cos_sin(tl.load(pos_ptr + t).to(tl.float32) * inv)  # pos.float()[:, None] * inv[None, :]
    if INVERSE:
        sin = -sin
    # The rotated channels, loaded whole (coalesced) and split into (even, odd) pairs in registers.
    R0 = D - 2 * HALF
    c = tl.arange(0, 2 * BLOCK_R)
    m = r_ok[:, None] & (c < 2 * HALF)[None, :]
    x = to_f32(tl.load(x_base + R0 + c[None, :], mask=m, other=0.0))
    a, b = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_R, 2)))
    o1, o2 = _rotate(a, b, cos[None, :], sin[None, :])
    o = tl.reshape(tl.join(o1, o2), (BLOCK_M, 2 * BLOCK_R))
    tl.store(o_base + R0 + c[None, :], cast_rne(o, o_ptr.dtype.element_ty), mask=m)
    if BLOCK_P > 0:  # channels 0 .. D - R pass through, bit for bit
        p = tl.arange(0, BLOCK_P)
        mp = r_ok[:, None] & (p < R0)[None, :]
        tl.store(o_base + p[None, :], tl.load(x_base + p[None, :], mask=mp), mask=mp)


def supports_rms(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dim() < 1 or x.dtype not in SUPPORTED_DTYPES or weight.dtype not in SUPPORTED_DTYPES:
        return False
    N = x.shape[-1]
    return weight.dim() == 1 and weight.shape[0] == N and 0 < N and next_pow2(N) <= MAX_BLOCK \
        and weight.device == x.device


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """CED's RMSNorm over the last dim: x [..., N], weight [N] -> [..., N] in x's dtype (see the module doc)."""
    if not supports_rms(x, weight):
        raise ValueError(f"rms_norm: unsupported x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} "
                         f"{tuple(weight.shape)} (see triton_ced_fused.supports_rms)")
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, N)
    if x2.shape[0]:
        BLOCK = next_pow2(N)
        _ced_rms_kernel[(x2.shape[0],)](x2, w, o2, x2.stride(0), o2.stride(0), N, float(eps), BLOCK=BLOCK,
                                        num_warps=1 if INTERPRET else min(16, max(1, BLOCK // 512)),
                                        enable_fp_fusion=False,  # x * rstd, then * w: two roundings, as torch
                                        **launch_kw(x.device))
    return out


def supports_add_rms(x, residual, weight, extra=None, ksum: int = 1) -> bool:
    return supports_rms(x, weight) and supports_add(x, residual, extra, ksum)


def supports_add(x, residual, extra=None, ksum: int = 1) -> bool:
    """Whether add_moe (and add_rms_norm's adds) run these inputs: [T, N] rows of one dtype, unit column stride,
    residual [T * ksum, N]."""
    if x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES or not 0 < x.shape[1] or next_pow2(x.shape[1]) > MAX_BLOCK:
        return False
    if isinstance(ksum, bool) or not isinstance(ksum, int) or not 1 <= ksum <= MAX_KSUM \
            or residual.shape != (x.shape[0] * ksum, x.shape[1]):
        return False
    ts = (x, residual) + ((extra,) if extra is not None else ())
    return all(t.dtype == x.dtype and t.device == x.device and (t.stride(-1) == 1 or x.shape[-1] == 1
                                                               or not x.numel()) for t in ts) \
        and (extra is None or extra.shape == x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 extra: Optional[torch.Tensor] = None, ksum: int = 1):
    """h = x + (residual + extra) (each sum rounded to x's dtype, as torch adds them) and CED's RMSNorm of h:
    x, residual, extra [T, N] of one dtype -> (h, rms(h)) [T, N], one launch. ``ksum`` > 1: residual is [T * ksum, N],
    a MoE's pair rows (pair_sum.PairSum), and its term is each token's rows summed in pair order in float32 and
    rounded once, as triton_moe.k_sum takes it."""
    if not supports_add_rms(x, residual, weight, extra, ksum):
        raise ValueError(f"add_rms_norm: unsupported x {x.dtype} {tuple(x.shape)}, residual {residual.dtype} "
                         f"{tuple(residual.shape)}, extra {None if extra is None else tuple(extra.shape)}, "
                         f"weight {weight.dtype} {tuple(weight.shape)}, ksum {ksum!r}")
    return _add_launch(x, residual, extra, ksum, weight, eps)


def add_moe(x: torch.Tensor, residual: torch.Tensor, extra: Optional[torch.Tensor] = None,
            ksum: int = 1) -> torch.Tensor:
    """h = x + (residual + extra), each sum rounded to x's dtype as torch adds them, in one launch: a deferred MoE
    output added to the residual stream where no norm follows (engine_path.finish). ``ksum`` > 1: residual is a
    MoE's pair rows [T * ksum, N], summed as add_rms_norm sums them. _ced_add_rms_kernel with its norm off."""
    if not supports_add(x, residual, extra, ksum):
        raise ValueError(f"add_moe: unsupported x {x.dtype} {tuple(x.shape)}, residual {residual.dtype} "
                         f"{tuple(residual.shape)}, extra {None if extra is None else tuple(extra.shape)}, "
                         f"ksum {ksum!r}")
    return _add_launch(x, residual, extra, ksum)[0]


def _add_launch(x, residual, extra, ksum: int, weight=None, eps: float = 0.0) -> tuple:
    """(h, rms(h)) by one _ced_add_rms_kernel launch over the checked inputs; weight None: the adds alone (NORM
    off, rms(h) not computed: h twice)."""
    T, N = x.shape
    h = torch.empty_like(x)
    out = h if weight is None else torch.empty_like(x)
    if T:
        e = extra if extra is not None else residual
        BLOCK = next_pow2(N)
        w = h if weight is None else weight if weight.is_contiguous() else weight.contiguous()
        _ced_add_rms_kernel[(T,)](x, residual, e, w, h, out, x.stride(0), residual.stride(0), e.stride(0),
                                  h.stride(0), out.stride(0), N, float(eps), BLOCK=BLOCK, HAS_EXTRA=extra is not None,
                                  KSUM=ksum, NORM=weight is not None,
                                  num_warps=1 if INTERPRET else min(16, max(1, BLOCK // 512)),
                                  enable_fp_fusion=False, **launch_kw(x.device))
    return h, out


def supports_swiglu(gu: torch.Tensor) -> bool:
    return gu.dim() == 2 and gu.dtype in SUPPORTED_DTYPES and gu.shape[1] % 2 == 0 \
        and (gu.stride(1) == 1 or not gu.numel())


def swiglu(gu: torch.Tensor, limit: float) -> torch.Tensor:
    """gu [T, 2F] (gate, up) -> silu(gate.clamp(max=limit)) * up.clamp(-limit, limit) [T, F], rounded as torch
    rounds each step (the silu, then the product)."""
    if not supports_swiglu(gu):
        raise ValueError(f"swiglu: gu must be [T, 2F] with unit column stride in {SUPPORTED_DTYPES}, got "
                         f"{gu.dtype} {tuple(gu.shape)} stride {gu.stride()}")
    T, F = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(T, F, dtype=gu.dtype, device=gu.device)
    if T and F:
        BLOCK = min(1024, next_pow2(F))
        _ced_swiglu_kernel[(T, cdiv(F, BLOCK))](gu, out, gu.stride(0), out.stride(0), F, float(limit),
                                                BLOCK=BLOCK, num_warps=1 if INTERPRET else 4,
                                                enable_fp_fusion=False, **launch_kw(gu.device))
    return out


def supports_rope(x: torch.Tensor, pos: torch.Tensor, rope_dim: int) -> bool:
    if x.dim() < 2 or x.dtype not in SUPPORTED_DTYPES or isinstance(rope_dim, bool) or not isinstance(rope_dim, int):
        return False
    D = x.shape[-1]
    if not 0 < rope_dim <= D or rope_dim % 2 or next_pow2(max(1, D - rope_dim)) > MAX_BLOCK:
        return False
    return pos.dim() == 1 and pos.shape[0] == x.shape[0] and pos.dtype in (torch.int32, torch.int64) \
        and pos.device == x.device


def launch_config(M: int, half: int, keep: int) -> dict:
    """A tile of BLOCK_M rows (heads) of one token: about 4096 elements of the copied part at most."""
    block_r = next_pow2(half)
    block_p = next_pow2(keep) if keep else 0
    widest = max(2 * block_r, block_p)
    return {"BLOCK_R": block_r, "BLOCK_P": block_p,
            "BLOCK_M": max(1, min(next_pow2(M), (256 if INTERPRET else 4096) // widest)),
            "num_warps": 1 if INTERPRET else 4}


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False,
         inplace: bool = False) -> torch.Tensor:
    """x [T, ..., D] rotated on its last R = 2 * len(inv_freq) channels by pos [T] (see the module doc):
    a new contiguous tensor in x's dtype. inv_freq [R/2] float32 on x's device. ``inplace`` (x contiguous):
    x's last R channels rotated where they are and x returned, the other D - R neither read nor written (a
    prefill's query is [T, 16, 512] with R = 64: an eighth of the traffic)."""
    R = 2 * inv_freq.shape[0]
    if not supports_rope(x, pos, R) or inv_freq.dtype != torch.float32 or inv_freq.device != x.device:
        raise ValueError(f"rope: unsupported x {x.dtype} {tuple(x.shape)}, pos {pos.dtype} {tuple(pos.shape)}, "
                         f"inv_freq {inv_freq.dtype} {tuple(inv_freq.shape)} (see triton_ced_fused.supports_rope)")
    T, D = x.shape[0], x.shape[-1]
    M = math.prod(x.shape[1:-1])  # the middle dims (heads), flattened
    inplace = inplace and x.is_contiguous()
    out = x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T and M:
        x3 = x.reshape(T, M, D)
        if x3.stride(-1) != 1:
            x3 = x3.contiguous()
        o3 = out.view(T, M, D)
        cfg = launch_config(M, R // 2, 0 if inplace else D - R)
        inv = inv_freq if inv_freq.is_contiguous() else inv_freq.contiguous()
        _ced_rope_kernel[(T, cdiv(M, cfg["BLOCK_M"]))](
            x3, o3, pos if pos.is_contiguous() else pos.contiguous(), inv,
            x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1), M, D, R // 2,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_R=cfg["BLOCK_R"], BLOCK_P=cfg["BLOCK_P"], INVERSE=bool(inverse),
            num_warps=cfg["num_warps"], enable_fp_fusion=False,  # a*cos and b*sin rounded apart, as torch
            **launch_kw(x.device))
    return out


def inv_freq(rope_dim: int, theta: float, device) -> torch.Tensor:
    """CED's rotary frequencies [R/2] float32, by the model's own formula (functional.rope_inv_freq) computed on
    ``device``, so the bits are those the torch path computes there: the very table the torch path keeps
    (functional.kept_inv_freq), so the two never differ."""
    from ...models.ced.functional import kept_inv_freq

    return kept_inv_freq(rope_dim, theta, device)
