"""Hypothesis strategies for checking a fast implementation against its oracle (see oracles.py).

Each strategy draws a small, seeded *case* (an attrs object of tensors and sizes); pass it to your fast
implementation and to the matching oracle, then compare with ``deepinfer.testing.assert_close``.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch
from hypothesis import strategies as st


@attrs.frozen
class SWACase:
    """One sequence of L tokens: q [L, H, D], k/v [L, Hk, D], a sliding window, and a paged layout of its KV
    (block_size, a shuffled block table) for implementations that read a paged cache."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    window: int
    scale: float
    block_size: int
    block_table: list


@attrs.frozen
class PagedCase:
    """One step's paged attention call: ``rows`` [(prefix, n)] (n new queries after a cached prefix; the
    first ``num_decodes`` rows are decode rows), q [T, H, D], caches [slots, Hk, D] and [slots, Hk, Dv]
    filled at random (v_cache may be a view of k_cache's first Dv channels, as MLA's is), each row's block
    ``tables`` on a shuffled pool (rows 0 and 1 may share their leading blocks, as prefix caching makes
    them), the AttnMetadata the engine builds for them (core.inputs.build_inputs), and the call's scale,
    window and sinks [H]."""

    rows: list
    num_decodes: int
    tables: list
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: object
    scale: float
    window: Optional[int]
    sinks: Optional[torch.Tensor]


@attrs.frozen
class MoECase:
    """x [T, d], router logits [T, E], SwiGLU expert weights w13 [E, 2F, d] and w2 [E, d, F], top_k."""

    x: torch.Tensor
    router_logits: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    top_k: int


@st.composite
def swa_cases(draw, max_len: int = 40, max_heads: int = 4, head_dims=(8, 16, 32)) -> SWACase:
    L = draw(st.integers(1, max_len))
    hk = draw(st.integers(1, max_heads))
    group = draw(st.integers(1, 3))
    D = draw(st.sampled_from(head_dims))
    window = draw(st.integers(1, max_len))
    bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    nblocks = -(-L // bs)
    table = torch.randperm(nblocks + 3, generator=g)[:nblocks].tolist()  # scattered, not 0..n-1
    return SWACase(q=torch.randn(L, hk * group, D, generator=g), k=torch.randn(L, hk, D, generator=g),
                   v=torch.randn(L, hk, D, generator=g), window=window, scale=D ** -0.5, block_size=bs,
                   block_table=table)


@st.composite
def paged_cases(draw, max_rows: int = 5, max_len: int = 40, head_dims=(8, 16, 32)) -> PagedCase:
    from types import SimpleNamespace

    from ..core.inputs import build_inputs

    R = draw(st.integers(1, max_rows))
    nd = draw(st.integers(0, R))
    rows = []
    for i in range(R):
        L = draw(st.integers(1, max_len))
        n = 1 if i < nd else draw(st.integers(1, L))  # later rows may have one query too
        rows.append((L - n, n))
    mla = draw(st.booleans())
    hk, group = (1, draw(st.integers(1, 4))) if mla else (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    D = draw(st.sampled_from(head_dims))
    Dv = D // 2 if mla else D
    bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    window = draw(st.none() | st.integers(1, max_len))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    need = [-(-(p + n) // bs) for p, n in rows]
    spread = draw(st.sampled_from([0, 0, 1, 4]))  # unused blocks in the pool: 0 = one run of block ids
    perm = torch.randperm(sum(need) * (1 + spread) + 2, generator=g).tolist()
    tables, k = [], 0
    for nb in need:
        tables.append(perm[k:k + nb])
        k += nb
    if R > 1:  # prefix sharing: row 1 reads row 0's leading blocks
        share = draw(st.integers(0, min(need[0], need[1]) - 1))
        tables[1][:share] = tables[0][:share]
    seqs = [SimpleNamespace(input_ids=lambda st_, n_: [0] * n_, block_table=t, state_slot=0, replay_start=0,
                            prefix_replay_start=0, num_cached_tokens=0, swa_restore=None)
            for t in tables]
    batch = SimpleNamespace(seqs=seqs, start=[p for p, _ in rows], num_tokens=[n for _, n in rows], future=None)
    _, meta, _ = build_inputs(batch, list(range(R)), bs, "cpu", num_decodes=nd)
    if draw(st.booleans()):  # the CUDA-graph path's tables are int32
        meta.block_table, meta.seq_lens = meta.block_table.int(), meta.seq_lens.int()
    magnitude = draw(st.sampled_from([0.5, 1.0, 4.0]))  # 4: large logits, a peaked softmax
    slots = len(perm) * bs
    q = (torch.randn(sum(n for _, n in rows), hk * group, D, generator=g) * magnitude).to(dtype)
    k_cache = (torch.randn(slots, hk, D, generator=g) * magnitude).to(dtype)
    v_cache = k_cache[..., :Dv] if mla else torch.randn(slots, hk, Dv, generator=g).to(dtype)
    sinks = torch.randn(hk * group, generator=g).to(dtype) if draw(st.booleans()) else None
    return PagedCase(rows=rows, num_decodes=nd, tables=tables, q=q, k_cache=k_cache, v_cache=v_cache, meta=meta,
                     scale=D ** -0.5, window=window, sinks=sinks)


@st.composite
def moe_cases(draw, max_tokens: int = 12, max_experts: int = 8) -> MoECase:
    T = draw(st.integers(0, max_tokens))
    E = draw(st.integers(1, max_experts))
    k = draw(st.integers(1, E))
    d = draw(st.sampled_from([8, 16]))
    F = draw(st.sampled_from([4, 8, 12]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return MoECase(x=torch.randn(T, d, generator=g), router_logits=torch.randn(T, E, generator=g),
                   w13=torch.randn(E, 2 * F, d, generator=g) * 0.3, w2=torch.randn(E, d, F, generator=g) * 0.3,
                   top_k=k)


@st.composite
def ced_attention_rows(draw, max_rows: int = 3, max_lo: int = 30) -> list:
    """Rows of one CED sparse-attention call as ``attention_cases.ced_attention_case`` takes them: per sequence
    (fresh_lo, queries, cut) with up to ``max_lo`` older positions in the ring and a cut at or before fresh_lo."""
    rows = []
    for _ in range(draw(st.integers(1, max_rows))):
        lo = draw(st.integers(0, max_lo))
        rows.append((lo, draw(st.integers(1, 4)), draw(st.integers(0, lo))))
    return rows
