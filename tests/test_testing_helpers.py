"""deepinfer.testing as a user writes with it (DESIGN.md's third use): fast paths against their oracles."""

import torch
from hypothesis import given, settings

from deepinfer.backends.base import AttnMetadata
from deepinfer.backends.reference import moe as moe_ops
from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.testing import assert_close, oracles
from deepinfer.testing import strategies as st


def paged_swa(case):
    """The engine's paged path: write the case's KV into a scattered paged cache, attend by block table."""
    L, hk, D = case.k.shape
    bs, table = case.block_size, case.block_table
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(L)])
    kc = torch.zeros((max(table) + 1) * bs, hk, D)
    vc = torch.zeros_like(kc)
    ops = ReferenceOps()
    ops.write_kv(kc, vc, case.k, case.v, slots)
    nb = len(table)
    kv_pos = torch.arange(nb * bs)
    bt = torch.tensor([table])
    meta = AttnMetadata(positions=torch.arange(L), slot_mapping=slots, seq_lens=torch.tensor([L]),
                        q_index=torch.arange(L)[None], q_valid=torch.ones(1, L, dtype=torch.bool),
                        kv_slots=bt[:, kv_pos // bs] * bs + kv_pos % bs, q_pos=torch.arange(L)[None],
                        block_table=bt, block_size=bs)
    return ops.paged_attention(case.q, kc, vc, meta, case.scale, window=case.window)


@settings(max_examples=40, deadline=None)
@given(st.swa_cases())
def test_paged_sliding_window_matches_the_mask(case):
    assert_close(paged_swa(case), oracles.swa_by_mask(case))


@settings(max_examples=40, deadline=None)
@given(st.moe_cases())
def test_routed_experts_match_dense(case):
    w, ids = moe_ops.route(case.router_logits, case.top_k)
    assert_close(moe_ops.experts_routed(case.x, case.w13, case.w2, w, ids), oracles.moe_dense(case))


def test_assert_close_uses_the_looser_dtype():
    x = torch.randn(64)
    assert_close(x.bfloat16(), x)  # bf16 rounding passes at bf16 tolerance
    try:
        assert_close(x + 1e-3, x)
    except AssertionError:
        pass
    else:
        raise AssertionError("a 1e-3 error must fail at float32 tolerance")
