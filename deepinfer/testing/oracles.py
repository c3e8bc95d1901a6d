"""Slow, obviously correct twins of the fast paths, for property tests (see strategies.py)."""

from __future__ import annotations

import torch

from ..backends.reference import moe as moe_ops


def swa_by_mask(case) -> torch.Tensor:
    """Causal sliding-window attention by an explicit [L, L] mask over the full KV: [L, H, D], float64."""
    q, k, v = case.q.double(), case.k.double(), case.v.double()
    L, H, _ = q.shape
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    pos = torch.arange(L)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - case.window)
    s = torch.einsum("qhd,khd->hqk", q, k) * case.scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def moe_dense(case, scoring: str = "softmax", renormalize: bool = True) -> torch.Tensor:
    """Every expert on every token, weighted by the router's top-k (the MoE oracle): [T, d]."""
    weights, ids = moe_ops.route(case.router_logits, case.top_k, scoring=scoring, renormalize=renormalize)
    return moe_ops.experts_dense(case.x, case.w13, case.w2, weights, ids)
