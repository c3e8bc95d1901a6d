"""Reference backend: every op in plain PyTorch, any device, float32 or bfloat16. The oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base import AttnMetadata, Ops
from . import attention


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
        if self.batch_invariant:  # every row, in KV blocks from position 0 (one order whatever the batch)
            from .invariant_attention import invariant_paged_attention

            return invariant_paged_attention(q, k_cache, v_cache, meta, scale, window, sinks)
        # Decode rows on the CPU attend to their blocks in place; the rest through the padded path (the oracle).
        return attention.paged_attention(q, k_cache, v_cache, meta, scale, window, sinks)

    def dense_attention(self, q, k, v, scale, window=None, sinks=None):
        L = q.shape[0]
        pos = torch.arange(L, device=q.device)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        return attention.softmax_attend(q[None], k[None], v[None], mask[None], scale, sinks)[0]

    def moe_route(self, router_logits, top_k, **kw):
        from .moe import route

        return route(router_logits, top_k, **kw)

    def moe_experts(self, x, w13, w2, weights, ids, *, clamp=None, impl="routed", w13_scale=None, w2_scale=None):
        from .moe import experts_dense, experts_routed

        if impl not in ("routed", "dense"):
            raise ValueError(f"impl must be 'routed' or 'dense', got {impl!r}")
        fn = experts_dense if impl == "dense" else experts_routed
        return fn(x, w13, w2, weights, ids, clamp=clamp, w13_scale=w13_scale, w2_scale=w2_scale)

    def sample(self, logits, batch, generator=None):
        from .sampling import sample

        return sample(logits, batch, generator)

    def compute_logprobs(self, logits, token_ids, num_top):
        from .sampling import compute_logprobs

        return compute_logprobs(logits, token_ids, num_top, stable=self.batch_invariant)

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

    def ced_rms_norm(self, x, weight, eps):
        """CED's RMSNorm (functional.rms: the weight applied in float32, one rounding to x's dtype)."""
        from ...models.ced import functional as fn

        return fn.rms(x, weight, eps)

    def ced_rope(self, x, pos, rope_dim, theta, inverse=False, reuse_input=False):
        """CED's RoPE on the last rope_dim channels of x [T, ..., D], adjacent pairs (functional.apply_rope).
        ``reuse_input``: the caller drops x, so a backend may rotate it in place and return it (this one does not)."""
        from ...models.ced import functional as fn

        return fn.apply_rope(x, pos, rope_dim, theta, inverse)

    def ced_indexer_topk(self, q, weights, keys, key_fmt, entry_slots, q_rows, num_visible, k, allowed=None,
                         return_scores=False, candidates=None):
        from ...models.ced import functional as fn  # select_topk is looked up at call time (tests wrap it)
        from . import lowbit

        if candidates is not None:  # only each query's candidates are scored (a decoder reindex layer's pool)
            return fn.candidate_indexer_topk(q, weights, keys, key_fmt, entry_slots, q_rows, candidates, k,
                                             return_scores)
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

    def ced_swa_kv(self, y, weight, eps, pos, rope_dim, theta, fmt, fake, ring, ring_slot):
        from ...models.ced import functional as fn  # (ops=self: a subclass's fused kernels, on CUDA)

        kv = fn.apply_rope(fn.rms(y, weight, eps, ops=self), pos, rope_dim, theta, ops=self)
        kv = fn.fake(kv, fmt, fake, ops=self)
        codes, scales = self.quantize_kv(kv, fmt)
        at = pos % ring[0].shape[1]
        ring[0][ring_slot, at] = codes
        if scales is not None and ring[1].shape[-1]:
            ring[1][ring_slot, at] = scales
        return kv

    def ced_add_rms_norm(self, x, residual, weight, eps, extra=None):
        from ...models.ced import functional as fn

        return fn.add_rms(x, residual, weight, eps, extra=extra)  # (no ops: the torch formulas)

    def ced_add(self, x, residual, extra=None):
        from ...models.ced import functional as fn

        return fn.add_moe(x, residual, extra=extra)  # (no ops: the torch formula)

    def ced_swiglu(self, gu, limit):
        g, u = gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)

    def ced_moe_route(self, x, gate, top_k, *, bias, scaling):
        return self.moe_route(torch.nn.functional.linear(x.float(), gate), top_k, scoring="sqrt_softplus",
                              renormalize=True, scaling=scaling, bias=bias)

    def ced_entry_rows(self, table, q_rows, ids):
        if not table.shape[1]:  # (no entry yet: every id is -1)
            return torch.full_like(ids, -1)
        return torch.where(ids >= 0, table[q_rows[:, None], ids.clamp(min=0)], -1)

    def ced_query(self, qa, norm_w, eps, w, pos, rope_dim, theta, heads):
        return self.ced_linear_rope(self.ced_rms_norm(qa, norm_w, eps), w, pos, rope_dim, theta, heads)

    def ced_linear_add_rms(self, x, w, residual, weight, eps):
        return self.ced_add_rms_norm(residual, self.linear(x, w), weight, eps)

    def ced_linear_rope(self, x, w, pos, rope_dim, theta, heads):
        y = self.linear(x, w).view(x.shape[0], heads, w.shape[0] // heads)  # (explicit widths: 0 rows too)
        return self.ced_rope(y, pos, rope_dim, theta, reuse_input=True)

    def ced_compress_plan(self, pos, block_table, m, size, per, *, rows=None, real=None, scratch_block=0):
        j = pos // m  # the group each token belongs to
        at = members = None
        if m > 1:
            at = pos % size
            members = ((j * m)[:, None] + torch.arange(m, device=j.device)) % size  # [n, m] group positions
        bt = block_table
        if rows is None:
            out = bt.gather(1, (j // per)[:, None])[:, 0] * per + j % per
        else:  # only a real token completing its group writes its row's entry; the rest the scratch block
            blk = bt[rows, (j // per).clamp(max=bt.shape[1] - 1)]
            own = real & (pos % m == m - 1)
            out = torch.where(own, blk, scratch_block) * per + j % per
        return at, members, j, out

    def ced_block_slots(self, block_table, per):
        ids = torch.arange(block_table.shape[1] * per, device=block_table.device)
        return block_table[:, ids // per] * per + ids % per

    def ced_compress_write(self, v, z, m, weight, eps, entry_ids, rope_dim, theta, fmt, fake, store, rows):
        from ...models.ced import functional as fn  # (ops=self: a subclass's fused kernels, on CUDA)

        c = fn.compress(v, fn.group_weights(z, m) if m > 1 else None, m)
        if weight is not None:
            c = fn.rms(c, weight, eps, ops=self)
        if rope_dim:
            c = fn.apply_rope(c, entry_ids * m, rope_dim, theta, ops=self)
        codes, scales = self.quantize_kv(fn.fake(c, fmt, fake, ops=self), fmt)
        store[0][rows] = codes
        if scales is not None:
            store[1][rows] = scales

    def ced_pool_candidates(self, scores, num_visible, block, nblocks):
        from ...models.ced import functional as fn

        visible = torch.arange(scores.shape[1], device=scores.device)[None, :] < num_visible[:, None]
        return fn.pool_candidates(scores, visible, block, nblocks)

    def ced_sparse_attention(self, q, kv, ring, entries, entry_slots, *, pos, cut, fresh_lo, fresh_start, ring_slot,
                             window, ring_fmt, entry_fmt, sinks, scale, unrope=None):
        from ...models.ced import functional as fn

        out = self._ced_sparse_attention(q, kv, ring, entries, entry_slots, pos=pos, cut=cut, fresh_lo=fresh_lo,
                                         fresh_start=fresh_start, ring_slot=ring_slot, window=window,
                                         ring_fmt=ring_fmt, entry_fmt=entry_fmt, sinks=sinks, scale=scale)
        return out if unrope is None else fn.rope_rotate(out, *unrope, inverse=True)

    def _ced_sparse_attention(self, q, kv, ring, entries, entry_slots, *, pos, cut, fresh_lo, fresh_start, ring_slot,
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
