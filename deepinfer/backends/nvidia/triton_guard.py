"""The engine's logits guard in one launch: rows of logits holding a NaN or +inf, or all -inf, are zeroed in place
and flagged (Ops.guard_logits' contract), on the device, without the host looking.

The torch composition (amax, isfinite, invert, masked_fill, or) is five to eight kernels a step; at batch 1 of a
CED decode step, where the host's ~1.6 ms outlasts the GPU's ~1.3, their launches were ~0.2 ms of it
(profile_decode). Here a program owns a row: it reads the row once for the three tests, and writes zeros only
where the row is bad (a second pass, rare).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_pdl import launch_kw, pdl_start

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _guard_kernel(lg_ptr, prev_ptr, out_ptr, stride_r, V, BLOCK: tl.constexpr, HAS_PREV: tl.constexpr,
                  V_I: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    row = lg_ptr + r * stride_r
    cols = tl.arange(0, BLOCK)
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    pinf = tl.zeros([BLOCK], dtype=tl.int32)
    finite_or_pinf = tl.zeros([BLOCK], dtype=tl.int32)  # anything but -inf (and masked lanes) seen
    for c0 in range(0, V_I if _INTERP else V, BLOCK):
        c = c0 + cols
        x = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32)
        nan |= (x != x).to(tl.int32)
        pinf |= (x == float("inf")).to(tl.int32)
        finite_or_pinf |= (x != float("-inf")).to(tl.int32)
    bad = (tl.max(nan, axis=0) + tl.max(pinf, axis=0) + (1 - tl.max(finite_or_pinf, axis=0))) > 0
    if bad:
        for c0 in range(0, V_I if _INTERP else V, BLOCK):
            c = c0 + cols
            tl.store(row + c, tl.zeros([BLOCK], dtype=lg_ptr.dtype.element_ty), mask=c < V)
    flag = bad
    if HAS_PREV:
        flag = flag | (tl.load(prev_ptr + r) != 0)
    tl.store(out_ptr + r, flag.to(tl.int8))


def supports(logits: torch.Tensor, prev_bad: Optional[torch.Tensor]) -> bool:
    return logits.dim() == 2 and logits.dtype in SUPPORTED_DTYPES and (logits.stride(1) == 1 or logits.shape[1] <= 1) \
        and (prev_bad is None or (prev_bad.dtype == torch.bool and prev_bad.shape == logits.shape[:1]
                                  and prev_bad.device == logits.device))


def guard_logits(logits: torch.Tensor, prev_bad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Zero, in place, the rows of logits [R, V] that hold a NaN or +inf or are all -inf; returns [R] bool: those
    rows, or'ed with prev_bad's. One launch."""
    if not supports(logits, prev_bad):
        raise ValueError(f"guard_logits: logits must be [R, V] float ({SUPPORTED_DTYPES}) with unit column stride and "
                         f"prev_bad None or bool [R] on its device; got {logits.dtype} {tuple(logits.shape)} stride "
                         f"{logits.stride()}, prev_bad "
                         f"{None if prev_bad is None else (prev_bad.dtype, tuple(prev_bad.shape), prev_bad.device)}")
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.bool, device=logits.device)
    if R:
        block = 64 if INTERPRET else 4096
        prev = prev_bad.contiguous().view(torch.int8) if prev_bad is not None else out
        _guard_kernel[(R,)](logits, prev, out.view(torch.int8), logits.stride(0), V, BLOCK=block,
                            HAS_PREV=prev_bad is not None, V_I=V if INTERPRET else 0,
                            num_warps=1 if INTERPRET else 8, **launch_kw(logits.device))
    return out
