"""CED attention pieces as pure functions, shared by the full-sequence path and the engine path.

Shapes: Tq queries, H heads, D latent (K = V), R rotary channels (the last R of D),
J compressed entries, W window slots, K top-K, nh/dh indexer heads/dim.
"""

from __future__ import annotations

import torch

from ...backends.reference import lowbit
from ...device_consts import device_const
from ...pair_sum import PairSum, dense


def _fused(ops, name: str, *ts: torch.Tensor):
    """The ops' fused kernel ``name`` where it may replace a torch formula below: CUDA tensors, ops that offer
    it (CEDLayer._kernels supplies them on CUDA only), and no gradient to carry (the kernels have no backward).
    None otherwise: then the formula runs, as it always does on the CPU (the oracle and the training path)."""
    if ops is None or not ts[0].is_cuda or (torch.is_grad_enabled() and any(t.requires_grad for t in ts)):
        return None
    return getattr(ops, name, None)


def rope_inv_freq(rope_dim: int, theta: float, device) -> torch.Tensor:
    """The rotary frequencies [R/2] float32: 1 / theta^(2i / R)."""
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim))


def kept_inv_freq(rope_dim: int, theta: float, device) -> torch.Tensor:
    """rope_inv_freq on ``device``, built once there and kept (device_const); the nvidia RoPE kernel reads it too."""
    return device_const(("ced_rope_inv_freq", int(rope_dim), float(theta)), device,
                        lambda d: rope_inv_freq(rope_dim, theta, d))


def rope_cos_sin(pos: torch.Tensor, rope_dim: int, theta: float):
    """pos: [T] -> cos, sin [T, R/2] float32."""
    inv = kept_inv_freq(rope_dim, theta, pos.device)
    ang = pos.float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float, inverse: bool = False, ops=None,
               reuse_input: bool = False):
    """Rotate adjacent pairs of the last rope_dim channels of x [T, ..., D] by position (or its inverse).
    ``ops`` (the engine's backend ops, on CUDA) runs it as one kernel, ``ops.ced_rope``, where they offer it;
    ``reuse_input`` (x is a temporary the caller drops) lets that kernel rotate x in place (the nvidia one then
    touches only the rotated channels). Use the return value either way."""
    kernel = _fused(ops, "ced_rope", x)
    if kernel is not None:
        return kernel(x, pos, rope_dim, theta, inverse, **({"reuse_input": True} if reuse_input else {}))
    return rope_rotate(x, *rope_cos_sin(pos, rope_dim, theta), inverse=inverse)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False):
    """apply_rope from the angles' cos, sin [T, R/2] float32 (rope_cos_sin): the torch formula."""
    rope_dim = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        sin = -sin
    keep, rot = x[..., :-rope_dim], x[..., -rope_dim:].float()
    a, b = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((keep, out.to(x.dtype)), dim=-1)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float, ops=None) -> torch.Tensor:
    """RMSNorm in float32, the weight applied in float32, one rounding to x's dtype. ``ops`` (the engine's
    backend ops, on CUDA) runs it as one kernel, ``ops.ced_rms_norm``, where they offer it."""
    kernel = _fused(ops, "ced_rms_norm", x, w)
    if kernel is not None:
        return kernel(x, w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def add_rms(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, ops=None, extra=None):
    """h = x + residual (+ extra, added to residual first) and rms(h): the residual add and the next norm, one
    kernel (``ops.ced_add_rms_norm``) where the ops offer it (CUDA); the torch formulas otherwise. residual may be
    a pair_sum.PairSum (a MoE's rows not yet added: the kernel adds them, the formulas take its value)."""
    kernel = _fused(ops, "ced_add_rms_norm", x, residual.pairs if isinstance(residual, PairSum) else residual, w)
    if kernel is not None:
        return kernel(x, residual, w, eps, extra)
    h = add_moe(x, residual, extra=extra)
    return h, rms(h, w, eps)


def add_moe(x: torch.Tensor, residual, ops=None, extra=None) -> torch.Tensor:
    """h = x + residual (+ extra, added to residual first): a deferred MoE output added where no norm follows, one
    kernel (``ops.ced_add``) where the ops offer it (CUDA); the torch formula otherwise. residual may be a
    pair_sum.PairSum."""
    kernel = _fused(ops, "ced_add", x, residual.pairs if isinstance(residual, PairSum) else residual)
    if kernel is not None:
        return kernel(x, residual, extra)
    residual = dense(residual)
    return x + (residual if extra is None else residual + extra)


def group_weights(z: torch.Tensor, m: int) -> torch.Tensor:
    """z: [G*m, C] gate logits -> per-channel softmax weights over each group of m tokens, [G, m, C]."""
    return torch.softmax(z.float().reshape(-1, m, z.shape[-1]), dim=1)


def compress(v: torch.Tensor, w: torch.Tensor | None, m: int) -> torch.Tensor:
    """v: [G*m, C] values of complete groups; w: [G, m, C] weights (None when m == 1) -> [G, C]."""
    if m == 1:
        return v
    return (w * v.float().reshape(-1, m, v.shape[-1])).sum(1).to(v.dtype)


class _FakeQuantSTE(torch.autograd.Function):
    """fake_quantize in the forward pass, identity in the backward pass (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, fmt):
        return lowbit.fake_quantize(x, fmt)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake(x: torch.Tensor, fmt: str, on: bool, ops=None) -> torch.Tensor:
    """Quantize-dequantize x in `fmt` when `on`. When x needs a gradient (training), the value is the same
    and the gradient passes straight through (the rounding itself has zero gradient almost everywhere).
    ``ops`` (the engine's backend ops) quantizes a CUDA tensor with its kernels, which give the same bytes as the
    reference without its finiteness check (a host sync, which a CUDA graph cannot hold)."""
    if not on:
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _FakeQuantSTE.apply(x, fmt)
    if ops is not None and x.is_cuda:
        codes, scales = ops.quantize_kv(x, fmt)
        return ops.dequantize_kv(codes, scales, fmt, dtype=x.dtype)
    return lowbit.fake_quantize(x, fmt)


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [Tq, nh, dh], w [Tq, nh], k [Tq, J, dh] (per query) or [J, dh] (shared) -> [Tq, J] float32."""
    if k.dim() == 2:
        dots = torch.einsum("thd,jd->thj", q.float(), k.float())
    else:
        dots = torch.einsum("thd,tjd->thj", q.float(), k.float())
    return (w.float()[:, :, None] * torch.relu(dots)).sum(1)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k visible entries per query, [Tq, k] int64, -1 after the last where fewer than k are visible.

    Ties break toward the lower index (stable), so every path picks the same set. An entry scored -inf
    counts as not visible: masked entries are -inf too, so keeping a visible -inf would depend on where
    the masked ones sit in the sort."""
    J = scores.shape[1]
    if J == 0:
        return torch.full((scores.shape[0], k), -1, dtype=torch.long, device=scores.device)
    s = scores.masked_fill(~visible, float("-inf"))
    kk = min(k, J)
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :kk]
    ok = torch.gather(s, 1, order) != float("-inf")
    idx = torch.where(ok, order, torch.full_like(order, -1))
    if kk < k:
        idx = torch.cat([idx, idx.new_full((idx.shape[0], k - kk), -1)], dim=1)
    return idx


def pool_mask(scores: torch.Tensor, visible: torch.Tensor, block: int, nblocks: int) -> torch.Tensor:
    """Decoder candidate pool: blocks of `block` entries scored by their max visible score; keep the best
    `nblocks` per query, the newest visible block always among them. Returns [Tq, J] bool."""
    Tq, J = scores.shape
    if J == 0:
        return visible.clone()
    nb = -(-J // block)
    pad = nb * block - J
    s = scores.masked_fill(~visible, float("-inf"))
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf")).reshape(Tq, nb, block).amax(-1)  # [Tq, nb]
    newest = (visible.long().cumsum(1).argmax(1)) // block  # block of the last visible entry
    s = s.clone()
    s.scatter_(1, newest[:, None], float("inf"))  # (a scalar index_put would copy from the host: no CUDA graph)
    keep_n = min(nblocks, nb)
    top = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :keep_n]
    blocks = torch.zeros(Tq, nb, dtype=torch.bool, device=scores.device)
    blocks.scatter_(1, top, True)
    blocks &= s > float("-inf")
    return blocks.repeat_interleave(block, 1)[:, :J] & visible


def pool_candidates(scores: torch.Tensor, visible: torch.Tensor, block: int, nblocks: int) -> torch.Tensor:
    """The decoder candidate pool as entry ids, the set ``pool_mask`` (its oracle) marks: [Tq, P] int64 with
    P = min(nblocks, ceil(J / block)) * block, each row's pool in ascending id order, then -1. A reindex layer
    scores only these (``select_candidates``): its work scales with P, not with J."""
    Tq, J = scores.shape
    if J == 0:
        return torch.full((Tq, 0), -1, dtype=torch.long, device=scores.device)
    nb = -(-J // block)
    s = scores.masked_fill(~visible, float("-inf"))
    s = torch.nn.functional.pad(s, (0, nb * block - J), value=float("-inf")).reshape(Tq, nb, block).amax(-1)
    newest = (visible.long().cumsum(1).argmax(1)) // block  # block of the last visible entry
    s.scatter_(1, newest[:, None], float("inf"))
    keep_n = min(nblocks, nb)
    top = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :keep_n]  # [Tq, keep_n] block ids
    kept = torch.gather(s, 1, top) > float("-inf")
    ids = (top[:, :, None] * block + torch.arange(block, device=s.device)).flatten(1)  # [Tq, P]
    ok = kept.repeat_interleave(block, 1) & (ids < J)
    ok &= torch.gather(visible, 1, ids.clamp(max=J - 1))
    ids = torch.sort(torch.where(ok, ids, J), dim=1).values  # ascending, the dropped ones (J) last
    return ids.masked_fill(ids >= J, -1)


def candidates_mask(cand: torch.Tensor, J: int) -> torch.Tensor:
    """Entry ids [Tq, P] (-1 = none) -> [Tq, J] bool (the pool as pool_mask returns it)."""
    out = torch.zeros(cand.shape[0], J + 1, dtype=torch.bool, device=cand.device)
    out.scatter_(1, torch.where(cand >= 0, cand, J), True)
    return out[:, :J]


def select_candidates(scores: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k of each query's candidates: scores [Tq, P] of the entries cand [Tq, P] (ascending ids, then -1)
    -> entry ids [Tq, k], -1 after the last. The set select_topk picks from full scores masked to the
    candidates: ties still go to the lower entry id, since candidates are in ascending order."""
    pos = select_topk(scores, cand >= 0, k)
    if cand.shape[1] == 0:
        return pos
    return torch.where(pos >= 0, torch.gather(cand, 1, pos.clamp(min=0)), -1)


CANDIDATE_CHUNK = 1 << 24  # most dequantized key elements candidate_indexer_topk holds at once


def candidate_indexer_topk(q, weights, keys, key_fmt, entry_slots, q_rows, candidates, k, return_scores=False):
    """The reference of Ops.ced_indexer_topk with ``candidates``: each query scores only its own candidate
    entries [Tq, P] (ascending ids, then -1), their keys gathered from the paged cache and dequantized, in
    chunks of queries. Returns (entry ids [Tq, k], -1 after the last; scores [Tq, P] float32, -inf at -1)."""
    Tq, P = candidates.shape
    codes, scales = keys
    scores = torch.full((Tq, P), float("-inf"), dtype=torch.float32, device=q.device)
    if Tq and P:
        rows = entry_slots[q_rows[:, None], candidates.clamp(min=0)]  # [Tq, P] cache rows
        step = max(1, CANDIDATE_CHUNK // (P * q.shape[-1]))
        for a in range(0, Tq, step):
            # Each distinct key once (a prefill's queries share most of their pools), then one copy per query.
            uniq, inv = torch.unique(rows[a:a + step], return_inverse=True)
            sc = scales[uniq] if scales is not None and scales.shape[-1] else None
            kr = lowbit.dequantize(codes[uniq], sc, key_fmt, dtype=q.dtype)  # [U, dh]
            scores[a:a + step] = index_scores(q[a:a + step], weights[a:a + step], kr[inv])  # keys [C, P, dh]
        scores = scores.masked_fill(candidates < 0, float("-inf"))
    return select_candidates(scores, candidates, k), (scores if return_scores else None)


def attend(q, swa_kv, swa_mask, glob_kv, glob_mask, sink, scale):
    """One softmax per query over its SWA keys, its top-K entries and the sink.

    q [Tq, H, D]; swa_kv [Tq, W, D] with swa_mask [Tq, W]; glob_kv [Tq, K, D] with glob_mask [Tq, K]
    (K may be 0); sink [H] or None. K = V (one latent). Returns [Tq, H, D].
    """
    qf = q.float()
    kv = torch.cat([swa_kv, glob_kv], dim=1).float()  # [Tq, W+K, D]
    mask = torch.cat([swa_mask, glob_mask], dim=1)  # [Tq, W+K]
    s = torch.einsum("thd,tkd->thk", qf, kv) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.float()[None, :, None].expand(s.shape[0], -1, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p)
    return torch.einsum("thk,tkd->thd", p, kv).to(q.dtype)


def gather_rows(x: torch.Tensor, idx: torch.Tensor):
    """x [N, C], idx [Tq, K] with -1 padding -> ([Tq, K, C], valid mask [Tq, K])."""
    valid = idx >= 0
    if x.shape[0] == 0:
        return x.new_zeros(idx.shape + (x.shape[-1],)), valid & False
    return x[idx.clamp(min=0)], valid
