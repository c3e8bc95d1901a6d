"""CED's RMSNorm in a GEMV's prologue (triton_gemv's ``norm_in``, Ops.ced_query, CEDLayer.query without cq).

What must hold:
- the product of the normed rows as the two launches compute it (triton_ced_fused.rms_norm, then the GEMV): the
  same bits under the interpreter; on the GPU within the bound below (the prologue sums each row's squares in K
  chunks, the norm kernel in one block, so a normed value may differ by an ulp);
- against a float64 oracle sharing no code with either: the float64 norm's product, within one rounding of each
  normed value and of the output plus float32 accumulation over K (scaled by the magnitudes, so any scale holds);
- NvidiaOps.ced_query takes it where linear takes a GEMV kernel and CED_QUERY_NORM_GEMV is on (with the RoPE on
  the store where CED_QUERY_ROPE_GEMV is on too), else ced_rms_norm then ced_linear_rope (same bits); bad arguments
  are refused by name.
Without CUDA through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import DEV, assert_same_bits, capture_graph, examples, gen, gpu, \
    skip_module_without_kernels

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_ced_fused as tcf, triton_gemv as tg  # noqa: E402

ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}  # half an ulp, relative


def draw(seed, M, N, K, dtype, scale):
    g = gen(seed)
    x = (torch.randn(M, K, generator=g) * scale).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV, dtype)
    return x, w, nw


def oracle_bound(x, w, nw, eps):
    """(the float64 product of the float64 norm, the bound for a result rounded to x's dtype)."""
    x64, w64, n64 = x.double().cpu(), w.double().cpu(), nw.double().cpu()
    xn = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * n64
    y = xn @ w64.T
    mag = xn.abs() @ w64.abs().T
    u = ULP[x.dtype]
    return y, u * y.abs() + (3 * u + (x.shape[1] + 4) * 2.0 ** -24) * mag + 1e-30


def close_to(out, ref, xn=None, w=None, exact=DEV.type == "cpu"):
    """Same bits under the interpreter (``exact``); on the GPU, or where the sums' order differs, within two
    roundings of the normed rows' product, plus (given the normed rows xn and the weight) an ulp of each normed value
    carried through the product (|xn| @ |w|.T: in float32 with a single output column that term is the larger
    one)."""
    if exact:
        assert_same_bits(out, ref)
    else:
        u = ULP[out.dtype]
        err = (out.double() - ref.double()).abs().cpu()
        bound = 4 * u * ref.double().abs().cpu().amax(-1, keepdim=True) + 1e-30
        if xn is not None:
            bound = bound + 2 * u * (xn.double().abs() @ w.double().abs().T).cpu()
        assert bool((err <= bound).all())


@examples(12)
@given(M=st.integers(1, tg.DOT_ROWS), N=st.sampled_from([1, 16, 100]), K=st.sampled_from([8, 200, 1024]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), scale=st.sampled_from([1e-3, 1.0, 40.0]),
       seed=st.integers(0, 2**16))
def test_norm_in_is_the_norm_then_the_product(M, N, K, dtype, scale, seed):
    x, w, nw = draw(seed, M, N, K, dtype, scale)
    dot = M > tg.MAX_ROWS
    got = tg.grouped_gemv(x[:, None, :], w[None], dot=dot, norm_in=(nw, 1e-6))[:, 0]
    xn = tcf.rms_norm(x, nw, 1e-6)
    close_to(got, tg.linear(xn, w, dot=dot), xn, w)
    want, bound = oracle_bound(x, w, nw, 1e-6)
    assert bool(((got.double().cpu() - want).abs() <= bound).all())


@pytest.mark.parametrize("M", [1, 3, tg.MAX_ROWS + 1])
def test_norm_in_over_several_k_chunks(M):
    """A small tile (the launch's ``tile`` knob) gives the prologue several K chunks to sum, as the bench shapes do
    on the GPU: against the float64 oracle, and the two launches within a rounding of the normed rows (the sums'
    order differs from the norm kernel's one block)."""
    x, w, nw = draw(11 + M, M, 24, 1000, torch.bfloat16, 3.0)
    dot = M > tg.MAX_ROWS
    got = tg.grouped_gemv(x[:, None, :], w[None], dot=dot, tile=256, norm_in=(nw, 1e-6))[:, 0]
    want, bound = oracle_bound(x, w, nw, 1e-6)
    assert bool(((got.double().cpu() - want).abs() <= bound).all())
    close_to(got, tg.linear(tcf.rms_norm(x, nw, 1e-6), w, dot=dot), exact=False)


def test_norm_in_refuses_what_it_cannot_take():
    x, w, nw = draw(1, 2, 16, 32, torch.bfloat16, 1.0)
    with pytest.raises(ValueError, match=r"norm_in must be \(weight \[K=32\]"):
        tg.grouped_gemv(x[:, None, :], w[None], norm_in=(nw[:16], 1e-6))
    with pytest.raises(ValueError, match="norm_in must be"):
        tg.grouped_gemv(x[:, None, :], w[None], out_dtype=torch.float32, norm_in=(nw, 1e-6))
    with pytest.raises(ValueError, match="norm_in must be"):
        tg.grouped_gemv(torch.stack([x, x], 1), torch.stack([w, w]), norm_in=(nw, 1e-6))  # (two groups)


@gpu
@pytest.mark.parametrize("rows", [1, 4, tg.MAX_ROWS + 1])
def test_prologue_replays_in_a_graph_at_the_bench_shape(rows):
    """W_q_b of the CED bench config (1024 -> 16 heads x 512, bf16): captured once, replayed on new rows; each
    replay against the two launches and the float64 oracle."""
    x, w, nw = draw(rows, rows, 8192, 1024, torch.bfloat16, 1.0)
    dot = rows > tg.MAX_ROWS
    graph, out = capture_graph(lambda: tg.grouped_gemv(x[:, None, :], w[None], dot=dot, norm_in=(nw, 1e-6)))
    g = gen(rows + 5)
    for scale in (1e-2, 1.0, 30.0):
        x.copy_((torch.randn(rows, 1024, generator=g) * scale).to(DEV, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        got = out[:, 0]
        xn = tcf.rms_norm(x, nw, 1e-6)
        close_to(got, tg.linear(xn, w, dot=dot), xn, w)
        want, bound = oracle_bound(x, w, nw, 1e-6)
        assert bool(((got.double().cpu() - want).abs() <= bound).all())


@pytest.mark.parametrize("rope_on", [False, True])
def test_ops_take_the_prologue_only_where_asked(rope_on, monkeypatch):
    from deepinfer.backends.nvidia import ops as nv

    monkeypatch.setattr(nv, "CED_QUERY_ROPE_GEMV", rope_on)
    x, w, nw = draw(3, 2, 48, 64, torch.bfloat16, 2.0)
    qa = torch.cat([x, x[:, :5]], 1)[:, :64]  # (a column slice of a wider product, as the joined projection's)
    pos = torch.tensor([7, 300], device=DEV)
    args = (1e-6, w, pos, 8, 1e4, 3)  # (3 heads of 16, the last 8 channels rotated)
    off = nv.NvidiaOps(DEV)
    a = off.ced_query(qa, nw, *args)
    assert off.kernel_calls["gemv_rms_in"] == 0 and off.kernel_calls["ced_rms_norm"] == 1 and a.shape == (2, 3, 16)
    assert_same_bits(a, off.ced_linear_rope(off.ced_rms_norm(qa, nw, 1e-6), w, pos, 8, 1e4, 3))
    monkeypatch.setattr(nv, "CED_QUERY_NORM_GEMV", True)
    on = nv.NvidiaOps(DEV)
    b = on.ced_query(qa, nw, *args)
    assert on.kernel_calls["gemv_rms_in"] == 1 and on.kernel_calls["ced_rms_norm"] == 0
    assert on.kernel_calls["ced_rope"] == (0 if rope_on else 1), dict(on.kernel_calls)
    close_to(b.flatten(1), a.flatten(1))
    big, bpos = draw(4, nv.GEMV_DOT_MAX_ROWS + 1, 48, 64, torch.bfloat16, 2.0)[0], torch.arange(5, device=DEV)
    assert_same_bits(on.ced_query(big, nw, 1e-6, w, bpos, 8, 1e4, 3),  # (past the GEMV rows: the two ops)
                     on.ced_linear_rope(on.ced_rms_norm(big, nw, 1e-6), w, bpos, 8, 1e4, 3))
    assert on.kernel_calls["gemv_rms_in"] == 1


def test_query_without_cq_takes_the_prologue(monkeypatch):
    """CEDLayer.query(need_cq=False) on the CUDA dispatch (the nvidia ops under the interpreter) with the prologue on:
    one gemv_rms_in a call, no ced_rms_norm, and q close to query()'s (the norm kernel, then the GEMV)."""
    from deepinfer.backends.nvidia import ops as nv
    from deepinfer.models.ced import functional as fn, model as ced_model
    from deepinfer.models.ced.config import CEDConfig
    from deepinfer.testing.ced import REPLAY_CONFIG

    cfg = CEDConfig(**REPLAY_CONFIG, vocab_size=64)
    layer = ced_model.CEDLayer(cfg, 0).to(DEV, torch.bfloat16)
    g = gen(2)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ops = nv.NvidiaOps(DEV)
    monkeypatch.setattr(nv, "CED_QUERY_NORM_GEMV", True)
    monkeypatch.setattr(ced_model.CEDLayer, "_kernels", lambda self, x: ops)
    monkeypatch.setattr(fn, "_fused", lambda o, name, *ts: getattr(o, name, None) if o is not None else None)
    x, pos = torch.randn(2, cfg.hidden_size, generator=g).to(DEV, torch.bfloat16), torch.tensor([3, 40], device=DEV)
    with torch.no_grad():
        q, cq = layer.query(x, pos)
        assert ops.kernel_calls["gemv_rms_in"] == 0 and cq is not None
        q2, cq2 = layer.query(x, pos, need_cq=False)
    assert ops.kernel_calls["gemv_rms_in"] == 1 and cq2 is None
    close_to(q2.flatten(1), q.flatten(1))
