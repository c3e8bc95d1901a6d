"""Structured outputs' token bitmask applied to logits, in PyTorch: the oracle of the nvidia kernel
(backends/nvidia/triton_bitmask.py).

Layout (xgrammar's): bitmask [R, W] int32, W >= ceil(V / 32); token v of row i is allowed when bit v % 32
of bitmask[i, v // 32] is set. Row i masks logits row rows[i]; other rows are untouched.
"""

from __future__ import annotations

import torch


def allowed_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, W] int32 -> [R, vocab_size] bool (token allowed)."""
    v = torch.arange(vocab_size, device=bitmask.device)
    words = bitmask.index_select(1, v >> 5)  # [R, V] int32: each token's word
    return ((words >> (v & 31).to(torch.int32)) & 1).bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], v] = -inf for every token v that bitmask[i] does not allow."""
    if rows.numel() == 0:
        return
    V = logits.shape[1]
    if bitmask.shape[1] * 32 < V:
        raise ValueError(f"apply_token_bitmask: bitmask covers {bitmask.shape[1] * 32} tokens, logits have {V}")
    rows = rows.to(device=logits.device, dtype=torch.long)
    keep = allowed_mask(bitmask.to(logits.device), V)  # [R, V]
    logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
