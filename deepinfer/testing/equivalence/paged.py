"""Paged KV against contiguous KV: a cache read through block tables gives back each sequence's tensor.

The contract (``read(cache, block_tables, lengths, block_size) -> list of tensors``): ``cache`` is a pool of
slots [num_slots, *F] (block b holds slots [b * block_size, (b + 1) * block_size)); sequence i's position p
lives in slot ``block_tables[i][p // block_size] * block_size + p % block_size``; return, per sequence, its
positions 0 .. lengths[i] - 1 as a tensor [lengths[i], *F]. The oracle lays the case's contiguous tensors
out that way (every other slot holds noise) and compares what comes back bit for bit.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch
from hypothesis import strategies as st


@attrs.frozen
class PagedKVCase:
    """Contiguous KV per sequence ([L_i, H, D]), the block size, and block tables over a shuffled pool of
    ``num_blocks`` blocks (sequence 1 may share sequence 0's leading blocks, as prefix caching makes it)."""

    seqs: list
    block_size: int
    tables: list
    num_blocks: int


@st.composite
def paged_kv_cases(draw, max_seqs: int = 4, max_len: int = 30) -> PagedKVCase:
    bs = draw(st.sampled_from([1, 2, 3, 4, 8]))
    lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_seqs))
    H, D = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4, 8]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    need = [-(-n // bs) for n in lens]
    spare = draw(st.integers(0, 4))
    perm = torch.randperm(sum(need) + spare, generator=g).tolist()
    tables, k = [], 0
    for nb in need:
        tables.append(perm[k:k + nb])
        k += nb
    seqs = [torch.randn(n, H, D, generator=g) for n in lens]
    if len(lens) > 1:  # shared leading blocks hold the same KV (only full blocks are shared)
        share = draw(st.integers(0, min(lens[0], lens[1]) // bs))
        tables[1][:share] = tables[0][:share]
        seqs[1][:share * bs] = seqs[0][:share * bs]
    return PagedKVCase(seqs=seqs, block_size=bs, tables=tables, num_blocks=len(perm))


def lay_out(case: PagedKVCase) -> torch.Tensor:
    """The pool [num_blocks * block_size, H, D] holding the case's sequences where their tables say (noise in
    every other slot)."""
    bs, first = case.block_size, case.seqs[0]
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(case.num_blocks * bs, *first.shape[1:], generator=g)
    for kv, table in zip(case.seqs, case.tables):
        for p in range(kv.shape[0]):
            pool[table[p // bs] * bs + p % bs] = kv[p]
    return pool


def engine_read(cache, block_tables, lengths, block_size) -> list:
    """Our implementation: the engine's AttnMetadata (core.inputs.build_inputs) for one prefill row per
    sequence, and each row's ``kv_slots`` gathered from the pool."""
    from ...core.inputs import build_inputs
    from ...core.params import SamplingParams
    from ...core.state import ScheduledBatch, Sequence

    seqs = [Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[0] * n, num_prompt_tokens=n,
                     params=SamplingParams(), arrival=i, block_table=list(t))
            for i, (t, n) in enumerate(zip(block_tables, lengths))]
    batch = ScheduledBatch(seqs=seqs, num_tokens=list(lengths), start=[0] * len(seqs), samples=[True] * len(seqs))
    _, meta, _ = build_inputs(batch, list(range(len(seqs))), block_size, "cpu")
    return [cache[meta.kv_slots[r, :n]] for r, n in enumerate(lengths)]


def check_paged(read: Callable, case: PagedKVCase) -> None:
    """``read`` over the laid-out pool must give back every sequence's contiguous KV bit for bit."""
    pool = lay_out(case)
    got = read(pool, [list(t) for t in case.tables], [s.shape[0] for s in case.seqs], case.block_size)
    assert len(got) == len(case.seqs), f"read returned {len(got)} sequences for {len(case.seqs)}"
    for i, (g, want) in enumerate(zip(got, case.seqs)):
        assert g.shape == want.shape, f"sequence {i}: shape {tuple(g.shape)}, expected {tuple(want.shape)}"
        bad = (g != want).flatten(1).any(1).nonzero().flatten().tolist()
        assert not bad, (f"sequence {i} (block_size {case.block_size}, table {case.tables[i]}): positions {bad[:8]} "
                         "differ from the contiguous KV")
