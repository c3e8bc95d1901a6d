"""deepinfer.testing as a user writes with it (DESIGN.md's third use): fast paths against their oracles."""

import pytest
import torch
from hypothesis import given, settings

from deepinfer.backends.base import AttnMetadata
from deepinfer.backends.reference import moe as moe_ops
from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.testing import assert_close, assert_greedy_matches, assert_logits_close, assert_same_or_near_tie, oracles
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


def test_assert_logits_close_scales_with_each_row():
    """The bound is factor eps of each row's largest |value|: rows of 1e-3 and of 1e3 alike; the message names
    the worst element."""
    ref = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1e-3], [1.0], [1e3]])
    eps = torch.finfo(torch.float32).eps
    scale = ref.abs().amax(-1, keepdim=True)
    assert_logits_close(ref + 10 * eps * scale, ref, factor=16)  # 10 eps (+ half an ulp of rounding) of every row
    bad = ref.clone()
    bad[0, 7] += 20 * eps * scale[0, 0]
    with pytest.raises(AssertionError, match=r"1 of 3 rows exceed the bound; worst at \(0, 7\).*16 eps"):
        assert_logits_close(bad, ref, factor=16)
    assert_logits_close(ref.bfloat16(), ref, factor=1)  # bf16's eps: its own rounding passes
    masked = ref.clone()
    masked[1, 3] = float("-inf")
    assert_logits_close(masked.clone(), masked, factor=1)
    with pytest.raises(AssertionError, match="non-finite mismatch at row 1, column 3"):
        assert_logits_close(ref, masked, factor=1e6)


def test_assert_same_or_near_tie():
    """Equal sequences pass; they may part only at a step where the reference's top two are within the bound and
    the other run took a token within it; scores as logits rows or as the engine's logprob dicts."""
    ref = [5, 6, 7, 8]
    logits = torch.zeros(4, 10)
    logits[torch.arange(4), torch.tensor(ref)] = 1.0
    logits[2, 3] = 1.0 - 1e-5  # step 2: a near-tie between 7 and 3
    assert assert_same_or_near_tie(ref, ref, logits, 1e-4) is None
    assert assert_same_or_near_tie([5, 6, 3, 0], ref, logits, 1e-4) == 2  # anything after the near-tie
    with pytest.raises(AssertionError, match="part at step 1, which is no near-tie.*margin 1"):
        assert_same_or_near_tie([5, 3, 7, 8], ref, logits, 1e-4)
    with pytest.raises(AssertionError, match="took 4, 1 below the best"):  # at the near-tie, a third token
        assert_same_or_near_tie([5, 6, 4, 8], ref, logits, 1e-4)
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_same_or_near_tie([5, 6, 3, 0], ref, logits, 1e-6)  # the bound is below the margin
    with pytest.raises(AssertionError, match="prefix"):
        assert_same_or_near_tie(ref[:3], ref, logits, 1e-4)
    lps = [{5: -0.1, 1: -2.0}, {6: -0.5, 2: -0.50005}]  # as SamplingParams(logprobs=2) reports (floats here)
    assert assert_greedy_matches([[5, 2], [5, 6]], [[5, 6], [5, 6]], [lps, lps], 1e-4) == [1, None]
    with pytest.raises(AssertionError, match="sequence 0: .*not among the reference's scored tokens"):
        assert_greedy_matches([[5, 9]], [[5, 6]], [lps], 1e-4)
    with pytest.raises(AssertionError, match="do not belong to the expected run"):
        assert_same_or_near_tie([5, 6], [5, 2], lps, 1e-4)


def test_assert_same_bits_forgives_only_nan_payloads():
    """Any NaN equals any NaN (CUDA's canonical 0x7FFFFFFF against the CPU's 0xFFC00000); everything else is
    compared bit for bit: a NaN on one side only, -0.0 against +0.0, a flushed subnormal all fail."""
    from deepinfer.testing.kernels import assert_same_bits

    ref = torch.tensor([1.0, -0.0, 2.0**-140, float("-inf"), 0.0]).view(torch.int32)
    ref[4] = -0x400000  # 0xFFC00000: a negative quiet NaN
    ref = ref.view(torch.float32)
    gpu_like = ref.clone().view(torch.int32)
    gpu_like[4] = 0x7FFFFFFF
    assert_same_bits(gpu_like.view(torch.float32), ref)
    assert_same_bits(ref.bfloat16(), ref.bfloat16())
    for i, v in ((0, float("nan")), (1, 0.0), (2, 0.0), (3, float("inf"))):
        bad = ref.clone()
        bad[i] = v
        with pytest.raises(AssertionError, match="NaN on one side" if i == 0 else f"differ.*first at \\[{i}\\]"):
            assert_same_bits(bad, ref)
    with pytest.raises(AssertionError):
        assert_same_bits(ref.double(), ref)
