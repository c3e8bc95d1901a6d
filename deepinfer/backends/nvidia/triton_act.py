"""SiLU-and-multiply (the SwiGLU gate) in Triton: x [..., 2F] -> silu(x[..., :F]) * x[..., F:].

Rounds like the reference op: silu is computed in float32 and rounded to x's dtype, then the product
is computed in float32 and rounded again.
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
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    g = tl.load(x_ptr + row * stride_x + F + cols, mask=mask, other=0.0)
    af = to_f32(a)
    s = to_f32(cast_rne(af / (1.0 + tl.exp(-af)), a.dtype))
    tl.store(out_ptr + row * stride_o + cols, cast_rne(s * to_f32(g), out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor) -> bool:
    return x.dim() >= 1 and x.dtype in SUPPORTED_DTYPES and x.shape[-1] % 2 == 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    F = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], F), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, 2 * F)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = out.view(-1, F)
    M = x2.shape[0]
    if M == 0 or F == 0:
        return out
    BLOCK = min(1024, next_pow2(F))
    grid = (M, cdiv(F, BLOCK))
    _silu_and_mul_kernel[grid](x2, o2, x2.stride(0), o2.stride(0), F, BLOCK=BLOCK,
                               num_warps=4 if BLOCK >= 512 else 1)
    return out
