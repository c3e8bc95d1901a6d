"""The structured-outputs bitmask op: the reference (reference/bitmask.py) against a per-token loop and against
xgrammar's own CPU apply, and the Triton kernel (nvidia/triton_bitmask.py) against the reference, under
Triton's interpreter without CUDA (tests/conftest.py sets TRITON_INTERPRET=1) and at real sizes on a GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.backends.reference.bitmask import allowed_mask, apply_token_bitmask
from deepinfer.testing.kernels import DEV, HAS_CUDA, examples, gen

VOCABS = [1, 31, 32, 33, 100, 257] + ([4096, 128256, 151936] if HAS_CUDA else [])


@st.composite
def cases(draw):
    V = draw(st.sampled_from(VOCABS))
    S = draw(st.integers(1, 6))
    rows = draw(st.lists(st.integers(0, S - 1), unique=True, max_size=S))
    extra_words = draw(st.integers(0, 2))  # a bitmask may be wider than the vocabulary (xgrammar pads it)
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    return V, S, rows, extra_words, seed, dtype


def make(case, device="cpu"):
    V, S, rows, extra, seed, dtype = case
    g = gen(seed)
    logits = torch.randn(S, V, generator=g).to(dtype)
    W = (V + 31) // 32 + extra
    bitmask = torch.randint(-2**31, 2**31, (len(rows), W), generator=g, dtype=torch.int64).to(torch.int32)
    return logits.to(device), bitmask.to(device), torch.tensor(rows, dtype=torch.int64, device=device)


def loop_oracle(logits, bitmask, rows):
    out = logits.clone()
    for i, r in enumerate(rows.tolist()):
        for v in range(logits.shape[1]):
            word = int(bitmask[i, v // 32]) & 0xFFFFFFFF
            if not (word >> (v % 32)) & 1:
                out[r, v] = float("-inf")
    return out


@given(cases())
@examples(40)
def test_reference_matches_a_loop_over_tokens(case):
    if case[0] > 257:
        return
    logits, bitmask, rows = make(case)
    want = loop_oracle(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, want)


def test_reference_matches_xgrammar_apply():
    xgr = pytest.importorskip("xgrammar")
    g = gen(3)
    logits = torch.randn(5, 1000, generator=g)
    bitmask = torch.randint(-2**31, 2**31, (5, 32), generator=g, dtype=torch.int64).to(torch.int32)
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask, torch.arange(5))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    assert allowed_mask(bitmask, 1000).sum() == torch.isfinite(ours).sum()


def test_reference_refuses_a_narrow_bitmask():
    with pytest.raises(ValueError, match="covers 32 tokens, logits have 40"):
        apply_token_bitmask(torch.zeros(1, 40), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))


@given(cases())
@examples(30)
def test_triton_kernel_matches_reference(case):
    from deepinfer.testing.kernels import skip_module_without_kernels

    skip_module_without_kernels()
    from deepinfer.backends.nvidia import triton_bitmask
    from deepinfer.backends.nvidia.ops import NvidiaOps

    logits, bitmask, rows = make(case, DEV)
    want = logits.clone()
    apply_token_bitmask(want, bitmask, rows)
    assert triton_bitmask.supports(logits, bitmask, rows)
    ops = NvidiaOps(DEV)
    ops.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, want)
    assert ops.kernel_calls["apply_token_bitmask"] == 1
