"""A CED decode step's index plans (Ops.ced_compress_plan, Ops.ced_block_slots): the Triton kernels (interpreted
on the CPU, compiled on a GPU) and the reference ops' torch formulas against a plain Python oracle written from
decode_path's contract (entry j of ratio m lives in block j // per of its row's table, slot j % per; a token at
position p belongs to group p // m, its tail slot p % size; in a padded verify batch only a real token that
completes its group writes its row's block, the rest the scratch block), on hypothesis-drawn tables, positions,
ratios and batch mixes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import DEV, examples, gpu, skip_module_without_kernels

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_ced_plan  # noqa: E402
from deepinfer.backends.nvidia.ops import NvidiaOps  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402

OPS = NvidiaOps(DEV)
REF = ReferenceOps(DEV)


def oracle_plan(pos, table, m, size, per, rows=None, real=None, scratch=0):
    at, members, groups, out = [], [], [], []
    for t, p in enumerate(pos):
        j = p // m
        groups.append(j)
        at.append(p % size if m > 1 else None)
        members.append([(j * m + i) % size for i in range(m)] if m > 1 else None)
        if rows is None:
            blk = table[t][j // per]
        else:
            row = table[rows[t]]
            own = real[t] and p % m == m - 1
            blk = row[min(j // per, len(row) - 1)] if own else scratch
        out.append(blk * per + j % per)
    return at, members, groups, out


@st.composite
def plans(draw, padded=False):
    m = draw(st.sampled_from([1, 2, 4, 8]))
    per = draw(st.sampled_from([1, 2, 4]))
    size = m + draw(st.integers(0, 5))
    R = draw(st.integers(1, 6))
    NB = draw(st.integers(1, 5))
    table = [draw(st.lists(st.integers(0, 999), min_size=NB, max_size=NB)) for _ in range(R)]
    if not padded:  # a decode step: token t is row t, at a position its table covers
        pos = [draw(st.integers(0, NB * per * m - 1)) for _ in range(R)]
        return m, per, size, table, pos, None, None
    Q = draw(st.integers(1, 4))
    rows = [t // Q for t in range(R * Q)]
    pos = []
    for r in range(R):
        start = draw(st.integers(0, NB * per * m + 3))  # the last tokens may run past the table (clamped)
        pos += range(start, start + Q)
    real = [draw(st.booleans()) for _ in rows]
    return m, per, size, table, pos, rows, real


def check(got, want):
    at, members, groups, out = got
    w_at, w_members, w_groups, w_out = want
    assert groups.dtype == out.dtype == torch.int64
    assert groups.cpu().tolist() == w_groups and out.cpu().tolist() == w_out
    if w_at[0] is None:
        assert at is None and members is None
    else:
        assert at.cpu().tolist() == w_at and members.cpu().tolist() == w_members


@examples(40)
@given(case=plans())
def test_compress_plan_decode(case):
    m, per, size, table, pos, _, _ = case
    t = torch.tensor(table, dtype=torch.long, device=DEV)
    p = torch.tensor(pos, dtype=torch.long, device=DEV)
    want = oracle_plan(pos, table, m, size, per)
    check(triton_ced_plan.compress_plan(p, t, m, size, per), want)
    check(REF.ced_compress_plan(p, t, m, size, per), want)


@examples(40)
@given(case=plans(padded=True), scratch=st.integers(0, 50))
def test_compress_plan_padded_verify(case, scratch):
    m, per, size, table, pos, rows, real = case
    t = torch.tensor(table, dtype=torch.long, device=DEV)
    p = torch.tensor(pos, dtype=torch.long, device=DEV)
    r = torch.tensor(rows, dtype=torch.long, device=DEV)
    ok = torch.tensor(real, dtype=torch.bool, device=DEV)
    want = oracle_plan(pos, table, m, size, per, rows, real, scratch)
    check(triton_ced_plan.compress_plan(p, t, m, size, per, r, ok, scratch), want)
    check(REF.ced_compress_plan(p, t, m, size, per, rows=r, real=ok, scratch_block=scratch), want)


@examples(30)
@given(R=st.integers(0, 5), NB=st.integers(0, 6), per=st.sampled_from([1, 2, 4, 16]), data=st.data())
def test_block_slots(R, NB, per, data):
    table = [data.draw(st.lists(st.integers(0, 10**6), min_size=NB, max_size=NB)) for _ in range(R)]
    t = torch.tensor(table, dtype=torch.long, device=DEV).reshape(R, NB)
    want = [[row[i // per] * per + i % per for i in range(NB * per)] for row in table]
    for got in (triton_ced_plan.block_slots(t, per), REF.ced_block_slots(t, per), OPS.ced_block_slots(t, per)):
        assert got.dtype == torch.int64 and tuple(got.shape) == (R, NB * per)
        assert got.cpu().tolist() == want


def test_ops_dispatch_and_errors():
    t = torch.tensor([[3, 7], [1, 2]], dtype=torch.long, device=DEV)
    p = torch.tensor([5, 9], dtype=torch.long, device=DEV)
    before = OPS.kernel_calls["ced_compress_plan"]
    check(OPS.ced_compress_plan(p, t, 4, 6, 2), oracle_plan([5, 9], [[3, 7], [1, 2]], 4, 6, 2))
    assert OPS.kernel_calls["ced_compress_plan"] == before + 1
    # int32 positions are not the kernels': the reference formulas run them (and give the same rows)
    got = OPS.ced_compress_plan(p.int(), t, 4, 6, 2)
    assert got[3].tolist() == oracle_plan([5, 9], [[3, 7], [1, 2]], 4, 6, 2)[3]
    assert OPS.kernel_calls["ced_compress_plan"] == before + 1
    with pytest.raises(ValueError, match="compress_plan: unsupported inputs"):
        triton_ced_plan.compress_plan(p, t, 0, 6, 2)
    with pytest.raises(ValueError, match="compress_plan: unsupported inputs"):
        triton_ced_plan.compress_plan(p, t.int(), 4, 6, 2)
    with pytest.raises(ValueError, match="block_slots: unsupported inputs"):
        triton_ced_plan.block_slots(t, 0)


@gpu
def test_gpu_plans_in_cuda_graph():
    """Captured once, replayed after the positions and table changed in place: the graph's plans follow."""
    t = torch.randint(0, 500, (64, 40), device="cuda")
    p = torch.randint(0, 40 * 4 * 4, (64,), device="cuda")
    outs = {}
    g = torch.cuda.CUDAGraph()
    triton_ced_plan.compress_plan(p, t, 4, 6, 4)  # (compiled before the capture)
    triton_ced_plan.block_slots(t, 4)
    with torch.cuda.graph(g):
        outs["plan"] = triton_ced_plan.compress_plan(p, t, 4, 6, 4)
        outs["slots"] = triton_ced_plan.block_slots(t, 4)
    for _ in range(2):
        t.copy_(torch.randint(0, 500, (64, 40), device="cuda"))
        p.copy_(torch.randint(0, 40 * 4 * 4, (64,), device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        check(outs["plan"], oracle_plan(p.tolist(), t.tolist(), 4, 6, 4))
        assert outs["slots"].tolist() == REF.ced_block_slots(t, 4).tolist()
