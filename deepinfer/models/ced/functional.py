"""CED attention pieces as pure functions, shared by the full-sequence path and the engine path.

Shapes: Tq queries, H heads, D latent (K = V), R rotary channels (the last R of D),
J compressed entries, W window slots, K top-K, nh/dh indexer heads/dim.
"""

from __future__ import annotations

import torch

from ...backends.reference import lowbit


def rope_cos_sin(pos: torch.Tensor, rope_dim: int, theta: float):
    """pos: [T] -> cos, sin [T, R/2] float32."""
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=pos.device, dtype=torch.float32) / rope_dim))
    ang = pos.float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float, inverse: bool = False):
    """Rotate adjacent pairs of the last rope_dim channels of x [T, ..., D] by position (or its inverse)."""
    cos, sin = rope_cos_sin(pos, rope_dim, theta)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        sin = -sin
    keep, rot = x[..., :-rope_dim], x[..., -rope_dim:].float()
    a, b = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((keep, out.to(x.dtype)), dim=-1)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


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


def fake(x: torch.Tensor, fmt: str, on: bool) -> torch.Tensor:
    """Quantize-dequantize x in `fmt` when `on`. When x needs a gradient (training), the value is the same
    and the gradient passes straight through (the rounding itself has zero gradient almost everywhere)."""
    if not on:
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _FakeQuantSTE.apply(x, fmt)
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
    s[torch.arange(Tq), newest] = float("inf")
    keep_n = min(nblocks, nb)
    top = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :keep_n]
    blocks = torch.zeros(Tq, nb, dtype=torch.bool, device=scores.device)
    blocks.scatter_(1, top, True)
    blocks &= s > float("-inf")
    return blocks.repeat_interleave(block, 1)[:, :J] & visible


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
