"""Reference backend: every op in plain PyTorch, any device, float32 or bfloat16. The oracle."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..base import AttnMetadata, Ops


def _softmax_attend(q, k, v, mask, scale, sinks):
    """q: [B, Q, H, D]; k, v: [B, K, Hk, D]; mask: [B, Q, K] -> [B, Q, H, Dv]. Softmax in float32."""
    if sinks is None and q.dtype == torch.float32:
        # Same function through PyTorch's fused kernel; fully masked (padded) rows may come back NaN
        # and are dropped by the caller.
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask[:, None], scale=scale,
                                             enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
    B, Q, H, D = q.shape
    Hk = k.shape[2]
    G = H // Hk
    qg = q.reshape(B, Q, Hk, G, D).permute(0, 2, 3, 1, 4).float()  # [B, Hk, G, Q, D]
    kf = k.permute(0, 2, 3, 1).float()  # [B, Hk, D, K]
    s = torch.matmul(qg, kf.unsqueeze(2)) * scale  # [B, Hk, G, Q, K]
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, Hk, G, 1, 1).expand(B, Hk, G, Q, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p)  # fully masked (padded) query rows
    out = torch.matmul(p, v.permute(0, 2, 1, 3).float().unsqueeze(2))  # [B, Hk, G, Q, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(B, Q, H, v.shape[-1]).to(q.dtype)


def _gather_kv(cache, meta):
    """Each sequence's cached rows, [B, max_kv, ...], from the paged cache [num_slots, ...]."""
    B, max_kv = meta.kv_slots.shape
    if meta.block_table is not None and cache.is_contiguous() and max_kv == meta.block_table.shape[1] * meta.block_size:
        # Whole blocks (one contiguous row each) rather than single tokens: far less copying work.
        rows = cache.view(-1, meta.block_size * cache[0].numel()).index_select(0, meta.block_table.reshape(-1))
        return rows.view(B, max_kv, *cache.shape[1:])
    return cache.index_select(0, meta.kv_slots.reshape(-1)).view(B, max_kv, *cache.shape[1:])


class ReferenceOps(Ops):
    name = "reference"

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def rms_norm(self, x, weight, eps):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps):
        h = x + residual
        return self.rms_norm(h, weight, eps), h

    def silu_and_mul(self, x):
        f = x.shape[-1] // 2
        return F.silu(x[..., :f]) * x[..., f:]

    def write_kv(self, k_cache, v_cache, k, v, slots):
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))

    def apply_rotary(self, q, k, positions, cos_sin_cache, interleaved):
        from ...models.rope import rotate

        return rotate(q, k, positions, cos_sin_cache, interleaved)

    def paged_attention(self, q, k_cache, v_cache, meta: AttnMetadata, scale, window=None, sinks=None):
        k = _gather_kv(k_cache, meta)  # [B, max_kv, Hk, D]
        if v_cache.data_ptr() == k_cache.data_ptr() and v_cache.shape[:-1] == k_cache.shape[:-1]:
            v = k[..., : v_cache.shape[-1]]  # V is a prefix of K (MLA's latent): gather once
        else:
            v = _gather_kv(v_cache, meta)
        if meta.q_index.shape[1] == 1:  # decode: one query per row, already in row order
            return _softmax_attend(q[:, None], k, v, meta.mask(window), scale, sinks)[:, 0]
        qp = q[meta.q_index]  # [B, max_q, H, D]
        out = _softmax_attend(qp, k, v, meta.mask(window), scale, sinks)
        return out[meta.q_valid]  # back to ragged [T, H, Dv], in T order

    def dense_attention(self, q, k, v, scale, window=None, sinks=None):
        L = q.shape[0]
        pos = torch.arange(L, device=q.device)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        return _softmax_attend(q[None], k[None], v[None], mask[None], scale, sinks)[0]

    def moe_route(self, router_logits, top_k, **kw):
        from .moe import route

        return route(router_logits, top_k, **kw)

    def moe_experts(self, x, w13, w2, weights, ids, *, clamp=None, impl="routed"):
        from .moe import experts_dense, experts_routed

        if impl not in ("routed", "dense"):
            raise ValueError(f"impl must be 'routed' or 'dense', got {impl!r}")
        fn = experts_dense if impl == "dense" else experts_routed
        return fn(x, w13, w2, weights, ids, clamp=clamp)

    def sample(self, logits, batch, generator=None):
        from .sampling import sample

        return sample(logits, batch, generator)

    def compute_logprobs(self, logits, token_ids, num_top):
        from .sampling import compute_logprobs

        return compute_logprobs(logits, token_ids, num_top)

    def apply_token_bitmask(self, logits, bitmask, rows):
        from .bitmask import apply_token_bitmask

        apply_token_bitmask(logits, bitmask, rows)

    # Low-bit KV caches and the CED engine path (the PyTorch code the CED engine path ran before it called ops).
    def quantize_kv(self, x, fmt):
        from . import lowbit

        return lowbit.quantize(x, fmt)

    def dequantize_kv(self, codes, scales, fmt, dtype=torch.float32):
        from . import lowbit

        return lowbit.dequantize(codes, scales, fmt, dtype)

    def ced_indexer_topk(self, q, weights, keys, key_fmt, entry_slots, q_rows, num_visible, k, allowed=None,
                         return_scores=False):
        from ...models.ced import functional as fn  # select_topk is looked up at call time (tests wrap it)
        from . import lowbit

        Tq, J = q.shape[0], entry_slots.shape[1]
        codes, scales = keys
        scores = q.new_zeros(Tq, J, dtype=torch.float32)
        if Tq:
            # One sequence at a time against its own keys: no [Tq, J, dh] per-query copy of the keys.
            rows, counts = torch.unique_consecutive(q_rows, return_counts=True)
            a = 0
            for r, n in zip(rows.tolist(), counts.tolist()):
                sl = entry_slots[r]
                kr = lowbit.dequantize(codes[sl], scales[sl] if scales is not None and scales.shape[-1] else None,
                                       key_fmt, dtype=q.dtype)
                scores[a:a + n] = fn.index_scores(q[a:a + n], weights[a:a + n], kr)
                a += n
        ok = torch.arange(J, device=q.device)[None, :] < num_visible[:, None]
        if allowed is not None:
            ok = ok & allowed
        return fn.select_topk(scores, ok, k), (scores if return_scores else None)

    def ced_sparse_attention(self, q, kv, ring, entries, entry_slots, *, pos, cut, fresh_lo, fresh_start, ring_slot,
                             window, ring_fmt, entry_fmt, sinks, scale):
        from ...models.ced import functional as fn
        from . import lowbit

        # Window keys [Tq, W, D]: fresh rows of kv, older positions dequantized from the ring.
        Tq, W, D = q.shape[0], window, kv.shape[-1]
        p = pos[:, None] - (W - 1) + torch.arange(W, device=q.device)[None, :]  # [Tq, W]
        valid = (p >= cut[:, None]) & (p >= 0)
        fresh = p >= fresh_lo[:, None]
        fresh_idx = (fresh_start[:, None] + p - fresh_lo[:, None]).clamp(0, max(Tq - 1, 0))
        keys = kv[fresh_idx] if Tq else kv.new_zeros(0, W, D)
        from_ring = valid & ~fresh  # only these are read (and dequantized) from the ring
        if bool(from_ring.any()):
            codes, scales = ring
            slots = ring_slot[:, None].expand_as(p)[from_ring]
            r = p[from_ring].clamp(min=0) % codes.shape[1]
            sc = scales[slots, r] if scales is not None and scales.shape[-1] else None
            keys = keys.clone()
            keys[from_ring] = lowbit.dequantize(codes[slots, r], sc, ring_fmt, dtype=kv.dtype)
        # Selected entries [Tq, K, D] (zeros where none).
        gmask = entry_slots >= 0
        if entries is None or entries[0].shape[0] == 0 or entry_slots.numel() == 0:
            glob = kv.new_zeros(Tq, entry_slots.shape[1], D)
        else:
            codes, scales = entries
            sl = entry_slots.clamp(min=0)
            sc = scales[sl] if scales is not None and scales.shape[-1] else None
            glob = lowbit.dequantize(codes[sl], sc, entry_fmt, dtype=kv.dtype).masked_fill(~gmask[..., None], 0)
        return fn.attend(q, keys, valid, glob, gmask, sinks, scale)
