"""Paged attention in plain PyTorch: the padded path (the oracle) and the in-place block path (CPU decode).

``padded_attention`` copies every row's blocks into a [B, max_kv, Hk, D] batch and runs one masked softmax;
it serves any rows, dtype and device, and is what the GPU kernels are tested against.

``block_attention`` serves the one-query (decode) rows on the CPU without that copy. The cache viewed as
[num_blocks, block_size, Hk, D] is already a strided batch of blocks, so one batched matmul per KV head
scores every row's query against each of its blocks in place, over a run of physical block ids (blocks of
the run that no row holds are scored and dropped). The scores are small ([rows, heads, context]): they
are gathered into row order for one masked softmax, and the probabilities go back to block order for the
second matmul, whose per-block outputs are summed into their rows. Rows with several queries (prefill
chunks) keep the padded path, where the copy is shared by all of a row's queries. In both paths a key that
a row cannot see still meets a 0 probability, so cache rows must hold finite values (the cache starts
zeroed).
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch
import torch.nn.functional as F

from ..base import AttnMetadata

# Split a run of held block ids where more than this many unused ids lie between two held ones (an unused
# block in a run costs its read; a new run costs 2 * Hk more matmul calls).
_MAX_GAP = 8


def softmax_attend(q, k, v, mask, scale, sinks):
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


def _v_is_k_prefix(k_cache, v_cache) -> bool:
    """V is the leading channels of K (MLA's latent cache: key = the whole row, value = its c_kv part)."""
    return v_cache.data_ptr() == k_cache.data_ptr() and v_cache.shape[:-1] == k_cache.shape[:-1]


def padded_attention(q, k_cache, v_cache, meta: AttnMetadata, scale, window=None, sinks=None):
    """Every row's context copied into a padded batch, one masked softmax: q [T, H, D] -> [T, H, Dv]."""
    k = _gather_kv(k_cache, meta)  # [B, max_kv, Hk, D]
    if _v_is_k_prefix(k_cache, v_cache):
        v = k[..., : v_cache.shape[-1]]  # gather once
    else:
        v = _gather_kv(v_cache, meta)
    if meta.q_index.shape[1] == 1:  # decode: one query per row, already in row order
        return softmax_attend(q[:, None], k, v, meta.mask(window), scale, sinks)[:, 0]
    qp = q[meta.q_index]  # [B, max_q, H, D]
    out = softmax_attend(qp, k, v, meta.mask(window), scale, sinks)
    return out[meta.q_valid]  # back to ragged [T, H, Dv], in T order


@attrs.define(eq=False)
class BlockPlan:
    """Where one-query rows' blocks lie in the cache; built once per step and shared by its layers.

    The blocks attended are laid out as the concatenation of ``runs``: run (lo, hi) is the physical blocks
    lo..hi-1, and NP = the runs' total length. A block held by k rows (prefix sharing) is laid out k times,
    in k different runs.
    """

    runs: list  # [(lo, hi)] physical block ranges, in layout order
    q_row: torch.Tensor  # [NP] int64 the row whose query each laid-out block meets (0 where none)
    owner: torch.Tensor  # [NP] int64 the row each laid-out block's output goes to (R where none)
    pair: torch.Tensor  # [R, MB] int64 laid-out index of row r's j-th block (0 where it holds none)
    inv: torch.Tensor  # [NP] int64 r * MB + j of the pair each laid-out block serves (0 where none)
    last: torch.Tensor  # [R] int64 last visible position: min(q_pos, seq_len - 1)
    q_pos: torch.Tensor  # [R] int64
    block_size: int
    masks: dict = attrs.field(factory=dict)  # (window, dtype) -> additive mask [1, R, 1, MB * bs]

    def mask(self, window: Optional[int], dtype) -> torch.Tensor:
        """0 where row r's key at position p is visible, -inf elsewhere; shaped for scores [Hk, R, G, MB * bs]."""
        key = (window, dtype)
        if key not in self.masks:
            p = torch.arange(self.pair.shape[1] * self.block_size)
            vis = p[None, :] <= self.last[:, None]
            if window is not None:
                vis &= p[None, :] > self.q_pos[:, None] - window
            self.masks[key] = torch.zeros(vis.shape, dtype=dtype).masked_fill_(~vis, float("-inf"))[None, :, None]
        return self.masks[key]


def _runs(ids: torch.Tensor) -> list:
    """Sorted distinct block ids [n] -> [(lo, hi)] runs, split where more than _MAX_GAP ids are unused."""
    cut = (torch.nonzero(ids[1:] - ids[:-1] > _MAX_GAP + 1).reshape(-1) + 1).tolist()
    starts, ends = [0] + cut, cut + [ids.shape[0]]
    lo, hi = ids[starts].tolist(), (ids[[e - 1 for e in ends]] + 1).tolist()
    return list(zip(lo, hi))


def block_plan(meta: AttnMetadata) -> BlockPlan:
    """The BlockPlan of a metadata whose rows all have one query (cached on it). Reads small index tensors
    on the host: CPU only."""
    if "block_plan" in meta.cache:
        return meta.cache["block_plan"]
    bs, bt, lens, q_pos = meta.block_size, meta.block_table.long(), meta.seq_lens.long(), meta.q_pos[:, 0].long()
    R, MB = bt.shape
    held = torch.arange(MB)[None, :] < ((lens + bs - 1) // bs)[:, None]  # [R, MB]
    pr, pj = torch.nonzero(held, as_tuple=True)  # the held (row, j) pairs, row-major
    pb = bt[pr, pj]
    lo, hi = int(pb.min()), int(pb.max()) + 1
    if int(torch.bincount(pb - lo).max()) == 1 and hi - lo - pb.shape[0] <= _MAX_GAP:
        runs, slot = [(lo, hi)], pb - lo  # the common case: distinct blocks, one run
    else:  # the i-th pair holding a block id goes to layer i; each layer's distinct ids form runs
        srt, order = torch.sort(pb, stable=True)
        _, counts = torch.unique_consecutive(srt, return_counts=True)
        layer = torch.empty_like(order)
        layer[order] = torch.arange(pb.shape[0]) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        runs, slot = [], torch.empty_like(pb)
        for k in range(int(counts.max())):
            sel = torch.nonzero(layer == k).reshape(-1)
            ids, o = torch.sort(pb[sel])
            lr = _runs(ids)
            starts = torch.tensor([a for a, _ in lr])
            offs = torch.tensor([0] + [h - a for a, h in lr]).cumsum(0)[:-1] + sum(h - a for a, h in runs)
            run = torch.searchsorted(starts, ids, right=True) - 1
            slot[sel[o]] = offs[run] + ids - starts[run]
            runs.extend(lr)
    NP = sum(h - a for a, h in runs)
    plan = BlockPlan(runs=runs, q_row=torch.zeros(NP, dtype=torch.long).index_put_((slot,), pr),
                     owner=torch.full((NP,), R, dtype=torch.long).index_put_((slot,), pr),
                     pair=torch.zeros(R, MB, dtype=torch.long).index_put_((pr, pj), slot),
                     inv=torch.zeros(NP, dtype=torch.long).index_put_((slot,), pr * MB + pj),
                     last=torch.minimum(q_pos, lens - 1), q_pos=q_pos, block_size=bs)
    meta.cache["block_plan"] = plan
    return plan


def _bmm_runs(out, a, blocks, runs) -> None:
    """out[n] = a[n] @ blocks[physical block of laid-out block n] for every run: a [NP, M, K], blocks
    [num_blocks, K, N] (a view of the cache), out [NP, M, N]."""
    grad = torch.is_grad_enabled() and (a.requires_grad or blocks.requires_grad)
    i = 0
    for lo, hi in runs:
        n = hi - lo
        if grad:  # out= does not record autograd
            out[i:i + n] = torch.bmm(a[i:i + n], blocks[lo:hi])
        else:
            torch.bmm(a[i:i + n], blocks[lo:hi], out=out[i:i + n])
        i += n


def block_attention(q, k_cache, v_cache, plan: BlockPlan, scale, window=None, sinks=None):
    """One query per row (q [R, H, D], row r's query in row r), attended in place -> [R, H, Dv]."""
    R, H, D = q.shape
    bs, Hk, Dv = plan.block_size, k_cache.shape[1], v_cache.shape[-1]
    G, NP, MB = H // Hk, plan.q_row.shape[0], plan.pair.shape[1]
    kb = k_cache.view(-1, bs, Hk, D)  # [num_blocks, bs, Hk, D]: a view, as are the per-head slices below
    vb = kb[..., :Dv] if _v_is_k_prefix(k_cache, v_cache) else v_cache.view(-1, bs, Hk, Dv)
    qb = q.reshape(R, Hk, G, D).transpose(0, 1).index_select(1, plan.q_row)  # [Hk, NP, G, D]
    s = q.new_empty(Hk, NP, G, bs)
    for h in range(Hk):
        _bmm_runs(s[h], qb[h], kb[:, :, h].transpose(1, 2), plan.runs)
    # Scores into row order, one softmax over each row's context (and the sink, which has no value).
    s = torch.add(plan.mask(window, s.dtype), s[:, plan.pair].transpose(2, 3).reshape(Hk, R, G, MB * bs),
                  alpha=scale)  # [Hk, R, G, MB * bs]
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:
        sink = sinks.to(s.dtype).view(Hk, 1, G, 1).expand(Hk, R, G, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    # Back to block order; each laid-out block's output goes to its row (blocks no row holds: to row R).
    p = p.reshape(Hk, R, G, MB, bs).transpose(2, 3).reshape(Hk, R * MB, G, bs).index_select(1, plan.inv)
    o = q.new_empty(Hk, NP, G, Dv)
    for h in range(Hk):
        _bmm_runs(o[h], p[h], vb[:, :, h], plan.runs)
    out = q.new_zeros(Hk, R + 1, G, Dv).index_add_(1, plan.owner, o)
    return out[:, :R].transpose(0, 1).reshape(R, H, Dv)


def block_path_ok(q, k_cache, v_cache, meta: AttnMetadata) -> bool:
    """Whether block_attention can serve this call: CPU (its plan reads index tensors on the host), float32
    or float64 throughout (scores in the inputs' dtype), a block table, and caches that view as blocks."""
    return (q.device.type == "cpu" and meta.block_table is not None and meta.block_size > 0
            and q.dtype in (torch.float32, torch.float64) and k_cache.dtype == q.dtype == v_cache.dtype
            and k_cache.is_contiguous() and (v_cache.is_contiguous() or _v_is_k_prefix(k_cache, v_cache)))


def _leading_decodes(meta: AttnMetadata) -> int:
    """How many leading rows have exactly one query (meta.num_decodes when the engine set it)."""
    if meta.num_decodes or meta.q_index.shape[1] == 1:
        return meta.num_decodes or meta.q_index.shape[0]
    one = (meta.q_valid.sum(1) == 1).tolist()
    return one.index(False) if False in one else len(one)


def paged_attention(q, k_cache, v_cache, meta: AttnMetadata, scale, window=None, sinks=None):
    """Ops.paged_attention of the reference backend: the leading one-query rows through block_attention
    where it applies, the other rows (and everything elsewhere) through padded_attention."""
    nd = _leading_decodes(meta) if block_path_ok(q, k_cache, v_cache, meta) else 0
    if nd == 0:
        return padded_attention(q, k_cache, v_cache, meta, scale, window, sinks)
    if nd == meta.q_index.shape[0]:
        return block_attention(q, k_cache, v_cache, block_plan(meta), scale, window, sinks)
    if "split" not in meta.cache:
        meta.cache["split"] = meta.split(nd)
    dec, pre = meta.cache["split"]
    return torch.cat([block_attention(q[:nd], k_cache, v_cache, block_plan(dec), scale, window, sinks),
                      padded_attention(q[nd:], k_cache, v_cache, pre, scale, window, sinks)])
