"""Structured outputs' token bitmask applied to the logits, in Triton (reference: reference/bitmask.py).

One program per (masked row, block of BLOCK tokens): it loads the block's BLOCK / 32 bitmask words (each
read by the 32 lanes of its tokens from cache), and writes -inf to the tokens whose bit is clear; allowed
tokens are not touched, so the kernel writes only what it masks. Rows not listed in ``rows`` are never
read. Launch parameters depend on shapes only (CUDA-graph safe), no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.backends.nvidia.host_math import cdiv

INTERPRET = bool(triton.knobs.runtime.interpret)
BLOCK = 1024


@triton.jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, V, W, stride_l, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    blk = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    words = tl.load(bitmask_ptr + i.to(tl.int64) * W + (offs >> 5), mask=inside, other=-1)
    bit = (words >> (offs & 31)) & 1
    neg = tl.full([BLOCK], float("-inf"), tl.float32)  # the store casts to the logits' dtype
    tl.store(logits_ptr + row * stride_l + offs, neg, mask=inside & (bit == 0))


def supports(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> bool:
    return (logits.ndim == 2 and logits.stride(1) == 1 and logits.dtype in (torch.float32, torch.float16,
                                                                                torch.bfloat16)
            and bitmask.ndim == 2 and bitmask.dtype == torch.int32 and bitmask.is_contiguous()
            and bitmask.shape[1] * 32 >= logits.shape[1] and rows.ndim == 1 and rows.numel() == bitmask.shape[0]
            and bitmask.device == logits.device == rows.device)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    R, V = rows.numel(), logits.shape[1]
    if R == 0 or V == 0:
        return
    grid = (R, cdiv(V, BLOCK))
    _bitmask_kernel[grid](logits, bitmask, rows.to(torch.int64), V, bitmask.shape[1], logits.stride(0), BLOCK=BLOCK)
