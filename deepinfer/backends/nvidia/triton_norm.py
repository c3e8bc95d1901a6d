"""RMSNorm and fused residual-add + RMSNorm in Triton: one program per row, one pass over the row.

Rounding follows the reference op step by step so that low-precision outputs agree to the last bit
nearly always: the sum x + residual is rounded to x's dtype (and returned as the new residual), the
normalised row is computed in float32 and rounded to x's dtype, and only then multiplied by the weight
(one more rounding, to the promoted dtype of weight and x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.backends.nvidia.host_math import next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
MAX_BLOCK = 65536  # widest row kept in one program
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """x.to(dtype), rounding to nearest even. Triton's interpreter rounds float32 -> bfloat16 half-up
    without carrying into the exponent, so there the rounding is done on the bits; compiled code uses
    the hardware conversion (already round-to-nearest-even). Shared by the other kernel modules."""
    if _INTERP and dtype == tl.bfloat16:
        b = x.to(tl.float32).to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def to_f32(x):
    """x.to(float32), exactly. Triton's interpreter flushes or garbles bfloat16 subnormals in that
    conversion, so there it is done on the bits (a bf16 is the top half of a float32)."""
    if _INTERP and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, h_ptr,
    stride_x, stride_r, stride_o, stride_h,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = cast_rne(to_f32(x) + to_f32(r), h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    else:
        h = x
    hf = to_f32(h)
    var = tl.sum(hf * hf, axis=0) / N
    rstd = tl.rsqrt(var + eps)
    xn = to_f32(cast_rne(hf * rstd, h.dtype))  # the reference rounds the normalised row to x's dtype
    w = to_f32(tl.load(w_ptr + cols, mask=mask, other=0.0))
    tl.store(out_ptr + row * stride_o + cols, cast_rne(xn * w, out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    if x.dim() < 1 or x.dtype not in SUPPORTED_DTYPES or weight.dtype not in SUPPORTED_DTYPES:
        return False
    N = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != N or N == 0 or next_pow2(N) > MAX_BLOCK:
        return False
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return False
    return True


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, residual, weight, eps):
    N = x.shape[-1]
    x2 = _rows(x)
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    o2 = out.view(-1, N)
    M = x2.shape[0]
    if residual is not None:
        r2 = _rows(residual)
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        h2 = h.view(-1, N)
    else:
        r2 = h2 = x2  # unused
        h = None
    if M:
        BLOCK = next_pow2(N)
        num_warps = min(16, max(1, BLOCK // 512))
        _rms_norm_kernel[(M,)](
            x2, r2, w, o2, h2,
            x2.stride(0), r2.stride(0), o2.stride(0), h2.stride(0),
            N, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=num_warps,
        )
    return out, h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_normalise(x) over the last dim; x [..., N], weight [N]."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual), in one pass; neither input is modified."""
    return _launch(x, residual, weight, eps)
