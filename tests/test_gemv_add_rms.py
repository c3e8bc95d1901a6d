"""A product with the residual add and the next RMSNorm on its last program (triton_gemv.linear_add_rms,
Ops.ced_linear_add_rms, CEDLayer.out_proj_add_rms).

What must hold:
- the two launches it replaces (triton_gemv.linear, then triton_ced_fused.add_rms_norm(residual, product)): h to
  the bit; the norm to the bit under the interpreter, within an ulp or a few (float32) on the GPU (the tail runs
  the norm kernel's float32 operations, but its launch's warps may sum the squares in another order);
- against a float64 oracle sharing no code with either: h within the roundings of the product and the add, the
  norm within a few bf16 ulps of the float64 RMSNorm of the returned h;
- the ticket counter is left zeroed (a second call, a graph replay on the GPU);
- NvidiaOps takes the tail where linear takes a GEMV kernel and the two ops past it, with the same bits.
Without CUDA through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import DEV, assert_same_bits, capture_graph, examples, gen, gpu, \
    skip_module_without_kernels

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_ced_fused as tcf, triton_gemv as tg, triton_tickets  # noqa: E402

ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def draw(seed, M, N, K, dtype, scale=1.0):
    g = gen(seed)
    x = (torch.randn(M, K, generator=g) * scale).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV, dtype)
    r = torch.randn(M, N, generator=g).to(DEV, dtype)
    nw = (torch.rand(N, generator=g) + 0.5).to(DEV, dtype)
    return x, w, r, nw


def assert_norm_matches(out, ref):
    """Same bits under the interpreter (one numpy sum order); on the GPU within one ulp of ref's dtype in bf16 /
    fp16 and eight in float32 (where the output keeps the last bits of an rstd summed in another order: the H100
    gave two)."""
    if DEV.type == "cpu":
        assert_same_bits(out, ref)
    else:
        assert out.dtype == ref.dtype and out.shape == ref.shape
        err = (out.double() - ref.double()).abs()
        ulps = 8 if ref.dtype == torch.float32 else 1
        assert bool((err <= ulps * 2 * ULP[ref.dtype] * ref.double().abs() + 1e-30).all()), float(err.max())


def oracle_check(x, w, r, nw, eps, h, out):
    x64, w64, r64 = x.double().cpu(), w.double().cpu(), r.double().cpu()
    y = x64 @ w64.T
    mag = x64.abs() @ w64.abs().T
    u = ULP[x.dtype]
    bound = u * (y.abs() + r64.abs() + (y + r64).abs()) + (x.shape[1] + 2) * 2.0 ** -24 * mag + 1e-30
    assert bool(((h.double().cpu() - (y + r64)).abs() <= bound).all())
    hh = h.double().cpu()
    want = hh * torch.rsqrt(hh.pow(2).mean(-1, keepdim=True) + eps) * nw.double().cpu()
    assert bool(((out.double().cpu() - want).abs() <= 4 * u * want.abs() + 1e-6 * want.abs().amax(-1, True)).all())


@examples(12)
@given(M=st.integers(1, tg.DOT_ROWS), N=st.sampled_from([1, 16, 100, 256]), K=st.sampled_from([8, 64, 200]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), scale=st.sampled_from([1e-2, 1.0, 30.0]),
       seed=st.integers(0, 2**16))
def test_linear_add_rms_is_the_product_then_add_rms_norm(M, N, K, dtype, scale, seed):
    x, w, r, nw = draw(seed, M, N, K, dtype, scale)
    dot = M > tg.MAX_ROWS
    h, out = tg.linear_add_rms(x, w, r, nw, 1e-6, dot=dot)
    y = tg.linear(x, w, dot=dot)
    rh, rout = tcf.add_rms_norm(r, y, nw, 1e-6)
    assert_same_bits(h, rh)
    assert_norm_matches(out, rout)
    oracle_check(x, w, r, nw, 1e-6, h, out)
    assert int(triton_tickets.counter("add_rms", x.device).item()) == 0
    h2, out2 = tg.linear_add_rms(x, w, r, nw, 1e-6, dot=dot)
    assert_same_bits(h2, h)
    assert_same_bits(out2, out)


def test_linear_add_rms_refuses_mismatches():
    x, w, r, nw = draw(1, 2, 16, 8, torch.bfloat16)
    for bad, what in ((r.float(), "residual torch.float32"), (r[:, :8], "residual torch.bfloat16 (2, 8)"),
                      (r.t().contiguous().t(), "stride")):
        with pytest.raises(ValueError, match="linear_add_rms: unsupported"):
            tg.linear_add_rms(x, w, bad, nw, 1e-6)
    with pytest.raises(ValueError, match="linear_add_rms: unsupported"):
        tg.linear_add_rms(x, w, r, nw[:8], 1e-6)
    with pytest.raises(ValueError, match="linear_add_rms: unsupported"):
        tg.linear_add_rms(torch.zeros(tg.MAX_ROWS + 1, 8, dtype=torch.bfloat16, device=DEV), w,
                          torch.zeros(tg.MAX_ROWS + 1, 16, dtype=torch.bfloat16, device=DEV), nw, 1e-6)


def test_ops_take_the_tail_at_gemv_rows_and_the_two_ops_past_them(monkeypatch):
    """With CED_OUT_ADD_RMS_GEMV on (shipped off: ops.py says why), and off: the two ops at every row count."""
    from deepinfer.backends.nvidia import ops as nv
    from deepinfer.backends.nvidia.ops import GEMV_DOT_MAX_ROWS, NvidiaOps
    from deepinfer.backends.reference.ops import ReferenceOps

    off = NvidiaOps(DEV)
    x, w, r, nw = draw(9, 1, 48, 32, torch.bfloat16)
    h, out = off.ced_linear_add_rms(x, w, r, nw, 1e-6)
    assert off.kernel_calls["gemv_add_rms"] == 0 and off.kernel_calls["ced_add_rms_norm"] == 1
    assert_same_bits(out, off.ced_add_rms_norm(r, off.linear(x, w), nw, 1e-6)[1])
    monkeypatch.setattr(nv, "CED_OUT_ADD_RMS_GEMV", True)
    ops = NvidiaOps(DEV)
    for rows in (1, GEMV_DOT_MAX_ROWS, GEMV_DOT_MAX_ROWS + 1):
        x, w, r, nw = draw(rows, rows, 48, 32, torch.bfloat16)
        before = ops.kernel_calls["gemv_add_rms"]
        h, out = ops.ced_linear_add_rms(x, w, r, nw, 1e-6)
        took = ops.kernel_calls["gemv_add_rms"] - before
        assert took == (rows <= GEMV_DOT_MAX_ROWS), (rows, took)
        rh, rout = ops.ced_add_rms_norm(r, ops.linear(x, w), nw, 1e-6)
        assert_same_bits(h, rh)
        assert_norm_matches(out, rout)
        oracle_check(x, w, r, nw, 1e-6, h, out)
    x, w, r, nw = draw(5, 3, 48, 32, torch.float32)
    h, out = ReferenceOps(DEV).ced_linear_add_rms(x, w, r, nw, 1e-6)  # (the torch formulas)
    oracle_check(x, w, r, nw, 1e-6, h, out)


@gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_tail_replays_in_a_graph_at_the_bench_shape(rows):
    """wo_b of the CED bench config (2048 x 8192, bf16): captured once, replayed on new rows."""
    x, w, r, nw = draw(rows, rows, 2048, 8192, torch.bfloat16)
    graph, (h, out) = capture_graph(lambda: tg.linear_add_rms(x, w, r, nw, 1e-6, dot=rows > tg.MAX_ROWS))
    g = gen(rows + 7)
    for _ in range(3):
        x.copy_(torch.randn(rows, 8192, generator=g).to(DEV, torch.bfloat16))
        r.copy_(torch.randn(rows, 2048, generator=g).to(DEV, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        rh, rout = tcf.add_rms_norm(r, tg.linear(x, w, dot=rows > tg.MAX_ROWS), nw, 1e-6)
        assert_same_bits(h, rh)
        assert_norm_matches(out, rout)
        oracle_check(x, w, r, nw, 1e-6, h, out)
