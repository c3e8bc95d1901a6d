"""The router on its logits product's launch (triton_ced_route.Tail, taken by triton_gemv and triton_splitk).

What must hold, for any rows, experts, top-k, bias and scaling the tail takes:
- the logits are the product's as it writes them without the tail (same bits);
- the weights and ids are the bits of the router kernel (triton_ced_route.route) run on those logits: the last
  program routes with the same formulas, and the renormalising sum runs in pick order in both;
- against an oracle that shares no code with either: the float64 product's sqrt-softplus scores, each chosen set's
  biased scores equal the reference's up to float noise (a near tie may pick either expert);
- the ticket counter is left zeroed: a second call gives the same bits, and a CUDA graph replays the launch;
- NvidiaOps.ced_moe_route takes the tail (one launch) where the logits take the GEMV or split-K kernel.
Without CUDA through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import DEV, assert_same_bits, capture_graph, examples, gen, gpu, \
    skip_module_without_kernels

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_ced_route as tcr, triton_tickets  # noqa: E402
from deepinfer.backends.nvidia import triton_gemv as tg, triton_splitk as tsk  # noqa: E402


def draw(seed: int, M: int, E: int, d: int, has_bias: bool, spread: float):
    g = gen(seed)
    x = torch.randn(M, d, generator=g).to(DEV, torch.bfloat16)
    gate = (torch.randn(E, d, generator=g) * spread * d ** -0.5).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEV) if has_bias else None
    return x, gate, bias


def oracle_check(x, gate, bias, k, scaling, w, ids):
    """The chosen sets' biased float64 scores against the best k's, and the weights of the chosen experts from
    their float64 scores (renormalised, scaled)."""
    logits = x.double().cpu() @ gate.double().cpu().T
    score = torch.sqrt(torch.nn.functional.softplus(logits))
    choice = score + (bias.double().cpu() if bias is not None else 0.0)
    ids = ids.cpu()
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (x.shape[0], k)
    assert all(len(set(r)) == k for r in ids.tolist()) and bool(((ids >= 0) & (ids < gate.shape[0])).all())
    best = choice.sort(1, descending=True).values[:, :k]
    torch.testing.assert_close(choice.gather(1, ids).sort(1, descending=True).values, best, rtol=1e-5, atol=1e-6)
    mine = score.gather(1, ids)
    want = mine / mine.sum(1, keepdim=True) * scaling
    torch.testing.assert_close(w.double().cpu(), want, rtol=1e-5, atol=1e-7)


def two_launches(product, x, gate, k, bias, scaling):
    logits = product(x, gate)
    return (logits, *tcr.route(logits, k, renormalize=True, scaling=scaling, bias=bias))


def check_tail(product, x, gate, k, bias, scaling):
    tail = tcr.Tail(x.shape[0], gate.shape[0], k, device=x.device, bias=bias, scaling=scaling)
    logits = product(x, gate, route=tail)
    ref_logits, rw, rids = two_launches(product, x, gate, k, bias, scaling)
    assert_same_bits(logits, ref_logits)
    assert_same_bits(tail.w, rw)
    assert torch.equal(tail.ids, rids)
    oracle_check(x, gate, bias, k, scaling, tail.w, tail.ids)
    assert int(triton_tickets.counter("route", x.device).item()) == 0
    again = tcr.Tail(x.shape[0], gate.shape[0], k, device=x.device, bias=bias, scaling=scaling)
    product(x, gate, route=again)
    assert_same_bits(again.w, tail.w)
    assert torch.equal(again.ids, tail.ids)


@examples(12)
@given(M=st.integers(1, tg.DOT_ROWS), E=st.sampled_from([1, 3, 12, 32, 100]), d=st.sampled_from([16, 96, 300]),
       k_frac=st.floats(0.0, 1.0), has_bias=st.booleans(), scaling=st.sampled_from([1.0, 1.5]),
       spread=st.sampled_from([1.0, 10.0]), seed=st.integers(0, 2**16))
def test_gemv_tail_routes_as_the_router_kernel(M, E, d, k_frac, has_bias, scaling, spread, seed):
    """The GEMV kernel (up to MAX_ROWS rows) and its tensor-core variant (past them) with the router in."""
    x, gate, bias = draw(seed, M, E, d, has_bias, spread)
    k = max(1, min(E, 8, round(k_frac * E)))
    dot = M > tg.MAX_ROWS
    assert tg.supports_route(x[:, None, :], gate[None], k, bias, dot)
    check_tail(lambda a, b, **kw: tg.linear(a, b, out_dtype=torch.float32, dot=dot, **kw), x, gate, k, bias,
               scaling)


@examples(8)
@given(M=st.integers(1, tsk.MAX_ROWS), E=st.sampled_from([2, 12, 32, 100]), d=st.sampled_from([40, 300]),
       knobs=st.sampled_from([dict(block_n=32), dict(block_n=16, block_k=16, max_splits=64),
                              dict(block_n=16, per_sm=1, max_splits=1)]),
       has_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_splitk_tail_routes_as_the_router_kernel(M, E, d, knobs, has_bias, seed):
    """The split-K kernel (float32 gate, bf16 rows) with the router in: one or several column tiles, one or
    several K splits (the tiles' last programs take the route ticket)."""
    x, gate, bias = draw(seed, M, E, d, has_bias, 5.0)
    k = min(E, 4)
    assert tsk.supports_route(x[:, None, :], gate[None], k, bias)
    check_tail(lambda a, b, **kw: tsk.linear(a, b, **knobs, **kw), x, gate, k, bias, 2.5)


def test_tail_refuses_what_it_cannot_carry():
    x, gate, bias = draw(1, 3, 12, 40, True, 1.0)
    tail = tcr.Tail(3, 12, 2, device=x.device, bias=bias)
    with pytest.raises(ValueError, match="route must be a Tail of 3 rows and 12 experts"):
        tg.linear(x, gate, out_dtype=torch.bfloat16, route=tail)  # (logits not float32)
    with pytest.raises(ValueError, match="route must be a Tail of 2 rows"):
        tg.linear(x[:2], gate, out_dtype=torch.float32, route=tail)  # (rows not the tail's)
    with pytest.raises(ValueError, match="route must be a Tail"):
        tsk.linear(x, gate[:11], route=tail)  # (experts not the tail's)
    with pytest.raises(ValueError, match="unsupported router: 12 experts, top_k 13"):
        tcr.Tail(3, 12, 13, device=x.device)
    wide = torch.zeros(1, 2 * tcr.MAX_TAIL_LOGITS // 64, 8, device=DEV)  # (64 rows x these experts: too many)
    assert not tsk.supports_route(torch.zeros(64, 1, 8, dtype=torch.bfloat16, device=DEV), wide, 2)
    assert tsk.supports_route(torch.zeros(32, 1, 8, dtype=torch.bfloat16, device=DEV), wide, 2)
    assert not tg.supports_route(x[:, None, :], gate[None], 2, bias[:5])  # (bias of the wrong width)


def test_ops_take_the_tail_for_the_router_logits(monkeypatch):
    """NvidiaOps.ced_moe_route: the GEMV logits and the split-K logits each with the router in (route_tail counted,
    the router kernel not called); with CED_ROUTE_TAIL off the two launches, the same bits."""
    from deepinfer.backends.nvidia import ops as nv

    monkeypatch.setattr(nv, "CED_ROUTE_LOGITS_SPLITK_MAX_ROWS", tg.MAX_ROWS + 4)
    monkeypatch.setattr(nv, "CED_ROUTE_TAIL", True)  # (shipped off: ops.py says why)
    for rows in (1, tg.MAX_ROWS, tg.MAX_ROWS + 4):
        x, gate, bias = draw(rows, rows, 12, 64, True, 3.0)
        on = nv.NvidiaOps(DEV)
        w, ids = on.ced_moe_route(x, gate, 3, bias=bias, scaling=1.5)
        assert on.kernel_calls["route_tail"] == 1 and on.kernel_calls["moe_route"] == 0, dict(on.kernel_calls)
        monkeypatch.setattr(nv, "CED_ROUTE_TAIL", False)
        off = nv.NvidiaOps(DEV)
        rw, rids = off.ced_moe_route(x, gate, 3, bias=bias, scaling=1.5)
        monkeypatch.setattr(nv, "CED_ROUTE_TAIL", True)
        assert off.kernel_calls["route_tail"] == 0 and off.kernel_calls["moe_route"] == 1
        assert_same_bits(w, rw)
        assert torch.equal(ids, rids)
        oracle_check(x, gate, bias, 3, 1.5, w, ids)


@gpu
@pytest.mark.parametrize("rows", [1, 4, 16, 64])
def test_tail_replays_in_a_graph(rows, monkeypatch):
    """Captured once, replayed on new rows: each replay routes the new logits (the counter was reset)."""
    from deepinfer.backends.nvidia import ops as nv

    monkeypatch.setattr(nv, "CED_ROUTE_TAIL", True)
    ops = nv.NvidiaOps(DEV)
    x, gate, bias = draw(rows, rows, 32, 2048, True, 3.0)
    graph, (w, ids) = capture_graph(lambda: ops.ced_moe_route(x, gate, 4, bias=bias, scaling=2.5))
    assert ops.kernel_calls["route_tail"] >= 2
    g = gen(rows + 100)
    for _ in range(3):
        x.copy_(torch.randn(rows, 2048, generator=g).to(DEV, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        oracle_check(x, gate, bias, 4, 2.5, w, ids)
