"""The logits guard's kernel (backends/nvidia/triton_guard.py) against a per-element oracle: rows holding a NaN or
+inf, or all -inf, are zeroed in place and flagged (or'ed with the previous flags); other rows are left bit for
bit. Under the interpreter on the CPU, and compiled on a GPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.backends.nvidia import triton_guard

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SPECIALS = [math.nan, math.inf, -math.inf]


def oracle_bad(rows: list) -> list:
    return [any(math.isnan(v) or v == math.inf for v in r) or (len(r) > 0 and all(v == -math.inf for v in r))
            for r in rows]


@st.composite
def cases(draw):
    R = draw(st.integers(1, 5))
    V = draw(st.integers(1, 150))
    rows = []
    for _ in range(R):
        kind = draw(st.sampled_from(["finite", "nan", "pinf", "ninf_some", "ninf_all", "mixed"]))
        base = draw(st.lists(st.floats(-50, 50, width=32), min_size=V, max_size=V))
        if kind == "ninf_all":
            base = [-math.inf] * V
        elif kind != "finite":
            at = draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=3))
            val = {"nan": math.nan, "pinf": math.inf, "ninf_some": -math.inf}.get(kind)
            for i in at:
                base[i] = val if val is not None else draw(st.sampled_from(SPECIALS))
        rows.append(base)
    prev = draw(st.none() | st.lists(st.booleans(), min_size=R, max_size=R))
    return rows, prev, draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_guard_zeroes_and_flags_the_bad_rows(case, device):
    rows, prev, dtype = case
    if device == "cpu" and not triton_guard.INTERPRET:
        pytest.skip("the kernel runs on the CPU only under TRITON_INTERPRET=1")
    lg = torch.tensor(rows, dtype=torch.float32).to(dtype).to(device)
    held = [[float(v) for v in r] for r in lg.float().cpu()]  # the values as the dtype holds them
    want = oracle_bad(held)
    if prev is not None:
        want = [a or b for a, b in zip(want, prev)]
    before = lg.clone()
    prev_t = torch.tensor(prev, dtype=torch.bool, device=device) if prev is not None else None
    out = triton_guard.guard_logits(lg, prev_t)
    assert out.dtype == torch.bool and out.tolist() == want
    bad_now = oracle_bad(held)
    for i, b in enumerate(bad_now):
        if b:
            assert (lg[i] == 0).all(), (i, lg[i])
        else:  # untouched, NaN-free by construction
            assert torch.equal(lg[i], before[i])


def test_unsupported_inputs_are_refused():
    with pytest.raises(ValueError, match="guard_logits"):
        triton_guard.guard_logits(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="prev_bad"):
        triton_guard.guard_logits(torch.zeros(2, 4), torch.zeros(3, dtype=torch.bool))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a GPU")
def test_gpu_vocab_sized_rows_match_the_reference_ops():
    """Vocabulary-sized rows (several 4096-wide tiles) against the reference backend's guard."""
    from deepinfer.backends.reference.ops import ReferenceOps

    g = torch.Generator(device="cuda").manual_seed(0)
    lg = torch.randn(9, 129280, device="cuda", generator=g)
    lg[1, 70000] = math.nan
    lg[3, 129279] = math.inf
    lg[5] = -math.inf
    lg[7, :5] = -math.inf
    ref = lg.clone()
    prev = torch.zeros(9, dtype=torch.bool, device="cuda")
    prev[8] = True
    want = ReferenceOps().guard_logits(ref, prev)
    got = triton_guard.guard_logits(lg, prev)
    assert torch.equal(got, want) and got.tolist() == [False, True, False, True, False, True, False, False, True]
    assert torch.equal(lg, ref)
