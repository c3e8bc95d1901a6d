"""Hypothesis strategies for checking a fast implementation against its oracle (see oracles.py).

Each strategy draws a small, seeded *case* (an attrs object of tensors and sizes); pass it to your fast
implementation and to the matching oracle, then compare with ``deepinfer.testing.assert_close``.
"""

from __future__ import annotations

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
