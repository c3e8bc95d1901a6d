"""Batch-invariant paged attention (the reference backend's ``paged_attention`` when ``ops.batch_invariant``).

Every query, in a prefill chunk or a decode row, alone or among any others, reduces over its sequence's keys in
one order: blocks of ``KV_BLOCK`` positions from position 0, an online softmax (running max ``m``, denominator
``l``, unnormalised output ``acc``, all float32) updated block by block. A block a query cannot see at all (past
its position, or before its window, or padding past the row's context) leaves its state exactly unchanged
(rescale by exp(0) = 1, add exact zeros), so the result does not depend on how far the batch's longest row
reaches, and a prefix-cache hit, a chunked prefill and a cold prefill reduce a position's keys in the same
order (the keys are in the cache before attention: the model writes them first). The sink, a per-head logit in
the denominator only, starts the state (m = sink, l = 1). Matmuls go through torch, which the engine runs under
``batch_invariant`` (fixed row tiles); run without it, this is an ordinary, exact-up-to-rounding attention that
tests/test_batch_invariant.py holds against ``attention.padded_attention``.
"""

from __future__ import annotations

import torch

from ..base import AttnMetadata
from .attention import _gather_kv, _v_is_k_prefix

KV_BLOCK = 64  # keys per online-softmax step: fixed, never derived from the batch


def invariant_paged_attention(q, k_cache, v_cache, meta: AttnMetadata, scale, window=None, sinks=None):
    """q [T, H, D] ragged queries over each row's cached KV -> [T, H, Dv] in q's dtype."""
    T, H, D = q.shape
    B, max_q = meta.q_index.shape
    Hk, Dv = k_cache.shape[1], v_cache.shape[-1]
    G = H // Hk
    if T == 0 or B == 0:
        return q.new_zeros(T, H, Dv)
    k = _gather_kv(k_cache, meta)  # [B, max_kv, Hk, D]
    v = k[..., :Dv] if _v_is_k_prefix(k_cache, v_cache) else _gather_kv(v_cache, meta)
    max_kv = -(-k.shape[1] // KV_BLOCK) * KV_BLOCK  # whole blocks: every step's matmuls have one shape
    if max_kv != k.shape[1]:  # padded keys are zeros (finite) and masked (position >= the row's length)
        k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, max_kv - k.shape[1]))
        v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, max_kv - v.shape[1]))
    M = max_q * G  # one matmul row per (query, head of the group)
    qp = q.float()[meta.q_index]  # [B, max_q, H, D]
    qp = qp.view(B, max_q, Hk, G, D).permute(0, 2, 1, 3, 4).reshape(B * Hk, M, D)
    qpos = meta.q_pos[:, None, :, None].expand(B, Hk, max_q, G).reshape(B * Hk, M, 1)
    lens = meta.seq_lens[:, None].expand(B, Hk).reshape(B * Hk, 1, 1)
    if sinks is None:
        m = qp.new_full((B * Hk, M, 1), float("-inf"))
        l = qp.new_zeros(B * Hk, M, 1)
    else:
        m = sinks.float().view(1, Hk, 1, G).expand(B, Hk, max_q, G).reshape(B * Hk, M, 1).clone()
        l = qp.new_ones(B * Hk, M, 1)
    acc = qp.new_zeros(B * Hk, M, Dv)
    for lo in range(0, max_kv, KV_BLOCK):
        hi = lo + KV_BLOCK
        kb = k[:, lo:hi].float().permute(0, 2, 3, 1).reshape(B * Hk, D, hi - lo)  # [B*Hk, D, n]
        vb = v[:, lo:hi].float().permute(0, 2, 1, 3).reshape(B * Hk, hi - lo, Dv)  # [B*Hk, n, Dv]
        pos = torch.arange(lo, hi, device=q.device).view(1, 1, -1)
        see = (pos <= qpos) & (pos < lens)
        if window is not None:
            see &= pos > qpos - window
        s = torch.bmm(qp, kb).mul_(scale).masked_fill_(~see, float("-inf"))  # [B*Hk, M, n]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        base = torch.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
        alpha = torch.exp(m - base)
        p = torch.exp(s - base)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, vb)
        m = m_new
    out = acc / l  # [B*Hk, M, Dv]; padded queries (l = 0) come out NaN and are dropped below
    out = out.view(B, Hk, max_q, G, Dv).permute(0, 2, 1, 3, 4).reshape(B, max_q, H, Dv)
    return out[meta.q_valid].to(q.dtype)
