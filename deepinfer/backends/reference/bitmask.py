"""Structured outputs' token bitmask applied to logits, in PyTorch: the oracle of the nvidia kernel
(backends/nvidia/triton_bitmask.py).

Layout (xgrammar's): bitmask [R, W] int32, W >= ceil(V / 32); token v of row i is allowed when bit v % 32
of bitmask[i, v // 32] is set. Row i masks logits row rows[i]; other rows are untouched.
"""

from __future__ import annotations

import torch


def allowed_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, W] int32 -> [R, vocab_size] bool (token allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]: token 32 w + b is bit b of word w
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], v] = -inf for every token v that bitmask[i] does not allow."""
    if rows.numel() == 0:
        return
    V = logits.shape[1]
    if bitmask.shape[1] * 32 < V:
        raise ValueError(f"apply_token_bitmask: bitmask covers {bitmask.shape[1] * 32} tokens, logits have {V}")
    rows = rows.to(device=logits.device, dtype=torch.long)
    keep = allowed_mask(bitmask.to(logits.device), V)  # [R, V]
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~keep, float("-inf")))
