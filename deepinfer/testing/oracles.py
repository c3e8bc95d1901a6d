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


def paged_attention_by_mask(case) -> torch.Tensor:
    """Each row of a PagedCase on its own: its keys read position by position through its block table, an
    explicit causal (and window) mask, the sink in the denominator. [T, H, Dv], float64."""
    H, Hk = case.q.shape[1], case.k_cache.shape[1]
    bs = case.meta.block_size
    outs, t = [], 0
    for (prefix, n), table in zip(case.rows, case.tables):
        L = prefix + n
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(L)])
        k = case.k_cache[slots].double().repeat_interleave(H // Hk, dim=1)  # [L, H, D]
        v = case.v_cache[slots].double().repeat_interleave(H // Hk, dim=1)
        qpos, kpos = torch.arange(prefix, L)[:, None], torch.arange(L)[None, :]
        mask = kpos <= qpos
        if case.window is not None:
            mask &= kpos > qpos - case.window
        s = torch.einsum("qhd,khd->hqk", case.q[t:t + n].double(), k) * case.scale
        s = s.masked_fill(~mask, float("-inf"))
        if case.sinks is not None:
            s = torch.cat([s, case.sinks.double().view(H, 1, 1).expand(H, n, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :L]
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        t += n
    return torch.cat(outs)


def moe_dense(case, scoring: str = "softmax", renormalize: bool = True) -> torch.Tensor:
    """Every expert on every token, weighted by the router's top-k (the MoE oracle): [T, d]."""
    weights, ids = moe_ops.route(case.router_logits, case.top_k, scoring=scoring, renormalize=renormalize)
    return moe_ops.experts_dense(case.x, case.w13, case.w2, weights, ids)
