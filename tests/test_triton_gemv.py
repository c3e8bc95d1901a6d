"""The skinny-product kernel (nvidia/triton_gemv.py) against a float64 product, and the backend's dispatch to it
(NvidiaOps.linear / grouped_linear up to GEMV_MAX_ROWS rows). The oracle is torch's float64 einsum; the bound is
one rounding of the output to its dtype plus float32 accumulation over K, scaled by sum |x w| (so it holds for
any magnitudes). Without CUDA through Triton's interpreter on small shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from deepinfer.testing.compare import assert_same_routing, ced_router_case
from deepinfer.testing.kernels import DEV, assert_same_bits, bf16x3, capture_graph, examples, gen, gpu, \
    no_host_sync, skip_module_without_kernels

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_gemv as tg, triton_splitk as tsk  # noqa: E402

UNIT = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}  # half an ulp, relative
TINY = {torch.float32: 2.0 ** -149, torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}  # half a subnormal step


def check(out, x, w):
    """out [M, G, N] against x [M, G, K] @ w[g].T in float64: |out - ref| <= half an ulp of ref in out's dtype
    (half a subnormal step below its normal range) plus K float32 roundings of sum |x w|."""
    ref = torch.einsum("mgk,gnk->mgn", x.double().cpu(), w.double().cpu())
    mag = torch.einsum("mgk,gnk->mgn", x.double().cpu().abs(), w.double().cpu().abs())
    K = x.shape[-1]
    bound = UNIT[out.dtype] * ref.abs() * 1.01 + (K + 2) * 2.0 ** -24 * mag + TINY[out.dtype]
    err = (out.double().cpu() - ref).abs()
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert bool((err <= bound).all()), float((err / bound).max())


@examples(25)
@given(M=st.integers(1, tg.MAX_ROWS), G=st.integers(1, 3), N=st.integers(1, 70), K=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), scale=st.sampled_from([1e-3, 1.0, 50.0]),
       seed=st.integers(0, 2**16))
def test_grouped_gemv_matches_float64(M, G, N, K, dtype, scale, seed):
    g = gen(seed)
    x = (torch.randn(M, G, K, generator=g) * scale).to(DEV, dtype)
    w = torch.randn(G, N, K, generator=g).to(DEV, dtype)
    check(tg.grouped_gemv(x, w), x, w)


@examples(6)
@given(M=st.integers(1, tg.MAX_ROWS), G=st.integers(1, 3), N=st.integers(1, 70), K=st.integers(1, 700),
       tile=st.sampled_from([256, 8192]), normed=st.booleans(), seed=st.integers(0, 2**16))
def test_early_weight_tile_keeps_the_bits(M, G, N, K, tile, normed, seed):
    """EARLY_W (the first weight tile loaded before the PDL wait, the first K step peeled off the loop): the bits
    of the plain loop, with one K step or several (tile 256), with and without the norm prologue (one group)."""
    g = gen(seed)
    G = 1 if normed else G
    x = torch.randn(M, G, K, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(G, N, K, generator=g) * K ** -0.5).to(DEV, torch.bfloat16)
    kw = dict(tile=tile, norm_in=(torch.rand(K, generator=g).to(DEV, torch.bfloat16) + 0.5, 1e-6) if normed else None)
    was = tg.EARLY_W
    try:
        tg.EARLY_W = False
        off = tg.grouped_gemv(x, w, **kw)
        tg.EARLY_W = True
        on = tg.grouped_gemv(x, w, **kw)
    finally:
        tg.EARLY_W = was
    assert_same_bits(on, off)
    if not normed:
        check(on, x, w)


@examples(12)
@given(M=st.integers(1, tg.DOT_ROWS), G=st.integers(1, 3), N=st.integers(1, 70), K=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), mixed=st.booleans(),
       seed=st.integers(0, 2**16))
def test_tensor_core_variant_matches_float64(M, G, N, K, dtype, mixed, seed):
    """dot=True (rows padded to 16, 32 or 64, one MMA per K step; float32 and mixed operands through an "ieee" dot):
    the same bound as the CUDA-core kernel, up to DOT_ROWS rows."""
    g = gen(seed)
    x = torch.randn(M, G, K, generator=g).to(DEV, dtype)
    w = torch.randn(G, N, K, generator=g).to(DEV, torch.float32 if mixed else dtype)
    out = tg.grouped_gemv(x, w, dot=True, out_dtype=torch.float32 if mixed else None)
    check(out, x.float() if mixed else x, w)


@examples(8)
@given(M=st.integers(1, tg.MAX_ROWS), N=st.integers(1, 40), K=st.integers(1, 300),
       xdtype=st.sampled_from([torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_mixed_dtypes_compute_in_float32(M, N, K, xdtype, seed):
    """A bf16 / fp16 row against a float32 weight into a float32 output (CED's router logits, x.float() @ gate.T):
    both widened exactly, so the bound is K float32 roundings of sum |x w|."""
    g = gen(seed)
    x = torch.randn(M, 1, K, generator=g).to(DEV, xdtype)
    w = torch.randn(1, N, K, generator=g).to(DEV)
    check(tg.grouped_gemv(x, w, out_dtype=torch.float32), x.float(), w)


@examples(8)
@given(M=st.integers(1, tg.MAX_ROWS), N=st.integers(1, 90), K=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_linear_of_strided_rows_matches_float64(M, N, K, seed):
    """x a column slice of a wider tensor (row stride != K), as a model's views are."""
    g = gen(seed)
    wide = torch.randn(M, K + 7, generator=g).to(DEV, torch.bfloat16)
    x = wide[:, 3:3 + K]
    w = torch.randn(N, K, generator=g).to(DEV, torch.bfloat16)
    out = tg.linear(x, w)
    assert out.shape == (M, N)
    check(out[:, None, :], x[:, None, :], w[None])


def test_launch_config_fills_the_gpu_and_keeps_the_tile():
    """BLOCK_N is the widest power of two (at most 64, at most N rounded up) whose grid has PROGRAMS_PER_SM programs
    per SM, or 1; BLOCK_K keeps BLOCK_N x BLOCK_K at TILE elements while K allows."""
    from deepinfer.backends.nvidia.triton_attention import sm_count

    want = tg.PROGRAMS_PER_SM * sm_count(torch.device(DEV))
    for G, N, K in ((1, 2048, 8192), (1, 512, 2048), (8, 1024, 1024), (1, 8192, 1024), (1, 3, 5000), (2, 40, 7)):
        bm, bn, bk = tg.block_sizes(1, G, N, K, torch.device(DEV))
        start = min(64, 1 << (N - 1).bit_length())
        grid = lambda b: G * -(-N // b)  # noqa: E731
        assert bm == 1 and 1 <= bn <= start and bn & (bn - 1) == 0
        assert grid(bn) >= want or bn == 1, (G, N, bn)  # full, or as narrow as it goes
        assert bn == start or grid(2 * bn) < want, (G, N, bn)  # and no narrower than needed
        assert bk == max(16, min(1 << (K - 1).bit_length(), tg.TILE // bn))
    assert tg.block_sizes(5, 1, 64, 64, torch.device(DEV))[0] == 8


def test_dot_block_sizes_pad_the_rows_and_bound_the_x_tile():
    """The tensor-core variant: rows padded to 16 / 32 / 64; block_sizes' columns (16 at least); past 16 rows the K
    step at most DOT_X_TILE / BLOCK_M, so an x tile never grows past DOT_X_TILE elements."""
    dev = torch.device(DEV)
    for M, want_bm in ((1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64)):
        for G, N, K in ((1, 8192, 1024), (1, 1024, 2048), (8, 1024, 1024), (1, 40, 7)):
            bm, bn, bk = tg.dot_block_sizes(M, G, N, K, dev)
            _, bn16, bk16 = tg.block_sizes(M, G, N, K, dev, min_n=16)
            assert (bm, bn) == (want_bm, bn16)
            assert bk == (bk16 if bm == 16 else max(16, min(bk16, tg.DOT_X_TILE // bm)))
            assert bm == 16 or bm * bk <= max(tg.DOT_X_TILE, bm * 16)


def test_bad_inputs_are_refused_with_their_shapes():
    x = torch.randn(2, 1, 16, device=DEV)
    with pytest.raises(ValueError, match="unsupported inputs"):
        tg.grouped_gemv(x, torch.randn(1, 4, 8, device=DEV))  # K differs
    with pytest.raises(ValueError, match="unsupported inputs"):
        tg.grouped_gemv(x.double(), torch.randn(1, 4, 16, device=DEV, dtype=torch.float64))  # float64
    with pytest.raises(ValueError, match="unsupported inputs"):
        tg.grouped_gemv(x, torch.randn(1, 4, 16, device=DEV), out_dtype=torch.int32)
    with pytest.raises(ValueError, match="unsupported inputs"):
        tg.grouped_gemv(torch.randn(tg.MAX_ROWS + 1, 1, 16, device=DEV), torch.randn(1, 4, 16, device=DEV))
    with pytest.raises(ValueError, match=rf"unsupported inputs.*M <= {tg.DOT_ROWS},"):  # the limit in force
        tg.grouped_gemv(torch.randn(tg.DOT_ROWS + 1, 1, 16, device=DEV), torch.randn(1, 4, 16, device=DEV), dot=True)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        tg.linear(torch.randn(16, device=DEV), torch.randn(4, 16, device=DEV))
    empty = tg.grouped_gemv(torch.randn(1, 1, 0, device=DEV), torch.randn(1, 3, 0, device=DEV))
    assert empty.shape == (1, 1, 3) and not empty.any()


def test_the_backend_takes_the_tensor_core_variant_past_gemv_max_rows(monkeypatch):
    """Rows in (GEMV_MAX_ROWS, GEMV_DOT_MAX_ROWS] take dot=True, fewer the CUDA-core kernel, more cuBLAS."""
    from deepinfer.backends.nvidia import ops as nv

    monkeypatch.setattr(nv, "GEMV_MAX_ROWS", 1)
    monkeypatch.setattr(nv, "GEMV_DOT_MAX_ROWS", 4)
    backend = nv.NvidiaOps(DEV)
    seen = []
    real = tg.grouped_gemv
    monkeypatch.setattr(tg, "grouped_gemv", lambda *a, **k: seen.append(k.get("dot")) or real(*a, **k))
    w = torch.randn(24, 40, generator=gen(4)).to(DEV)
    for rows in (1, 3, 4, 5):
        x = torch.randn(rows, 40, generator=gen(rows)).to(DEV)
        torch.testing.assert_close(backend.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert seen == [False, True, True]  # 5 rows: cuBLAS
    monkeypatch.setattr(nv, "GEMV_DOT_MAX_ROWS", tg.DOT_ROWS)  # the variant's whole range
    seen.clear()
    for rows in (17, 33, tg.DOT_ROWS, tg.DOT_ROWS + 1):
        x = torch.randn(rows, 40, generator=gen(rows)).to(DEV)
        torch.testing.assert_close(backend.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert seen == [True, True, True]  # past DOT_ROWS: cuBLAS


@st.composite
def rope_cases(draw):
    dot = draw(st.booleans())
    M = draw(st.integers(1, tg.DOT_ROWS if dot else tg.MAX_ROWS))
    heads, D = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4, 8, 16, 34, 64]))
    R = 2 * draw(st.integers(1, D // 2))
    return dot, M, heads, D, R, draw(st.integers(1, 90)), draw(st.sampled_from([torch.float32, torch.bfloat16]))


@examples(20)
@given(case=rope_cases(), big=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_epilogue_is_the_gemv_then_the_rope_kernel(case, big, seed):
    """linear(..., rope=(pos, inv_freq, heads)) stores what the GEMV then triton_ced_fused's rope kernel store,
    bit for bit, for both kernels (CUDA cores and tensor cores), any head width and rotary part; and it is the
    rotation of the float64 product by float64 angles, within the roundings' bound."""
    from deepinfer.backends.nvidia import triton_ced_fused as tcf

    dot, M, heads, D, R, K, dtype = case
    g = gen(seed)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(heads * D, K, generator=g) * K ** -0.5).to(DEV, dtype)
    pos = torch.randint(0, 60000 if big else 50, (M,), generator=g).to(DEV)
    inv = tcf.inv_freq(R, 10000.0, DEV)
    fused = tg.linear(x, w, dot=dot, rope=(pos, inv, heads)).view(M, heads, D)
    plain = tg.linear(x, w, dot=dot)
    assert_same_bits(fused, tcf.rope(plain.view(M, heads, D), pos, inv))
    # the independent check: float64 product and angles (cos / sin of float32 angles differ from float64 ones by
    # the angle's own rounding, ~pos * 2^-24 radians, times the value)
    y = (x.double().cpu() @ w.double().cpu().T).view(M, heads, D)
    ang = pos.double().cpu()[:, None] * inv.double().cpu()[None, :]
    a, b = y[..., D - R::2], y[..., D - R + 1::2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    want = y.clone()
    want[..., D - R::2], want[..., D - R + 1::2] = a * cos - b * sin, b * cos + a * sin
    mag = (x.double().cpu().abs() @ w.double().cpu().abs().T).view(M, heads, D).amax(-1, keepdim=True)
    slack = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    bound = mag * (slack + (K + 4) * 2.0 ** -24 + pos.double().cpu().amax() * 2.0 ** -23) + 1e-30
    assert bool(((fused.double().cpu() - want).abs() <= bound).all())


def test_rope_epilogue_dispatch_and_errors(monkeypatch):
    """NvidiaOps.ced_linear_rope takes the epilogue where linear takes a GEMV kernel (one launch), else the linear
    and the rope op; both give the reference ops' values. Bad rope arguments are refused by name."""
    from deepinfer.backends.nvidia import ops as nv, triton_ced_fused as tcf
    from deepinfer.backends.reference.ops import ReferenceOps

    monkeypatch.setattr(nv, "CED_QUERY_ROPE_GEMV", True)  # (shipped off: ops.py says why)
    backend, ref = nv.NvidiaOps(DEV), ReferenceOps(DEV)
    g = gen(7)
    w = torch.randn(2 * 16, 40, generator=g).to(DEV)
    for rows in (0, 1, nv.GEMV_DOT_MAX_ROWS, nv.GEMV_DOT_MAX_ROWS + 1):  # (0: a pass without queries)
        x = torch.randn(rows, 40, generator=g).to(DEV)
        pos = torch.arange(rows, device=DEV) * 37
        before = backend.kernel_calls["gemv_rope"]
        got = backend.ced_linear_rope(x, w, pos, 8, 10000.0, 2)
        assert backend.kernel_calls["gemv_rope"] == before + (0 < rows <= nv.GEMV_DOT_MAX_ROWS)
        assert got.shape == (rows, 2, 16)
        torch.testing.assert_close(got, ref.ced_linear_rope(x, w, pos, 8, 10000.0, 2), rtol=1e-5, atol=1e-5)
    x, pos = torch.randn(1, 40, device=DEV), torch.zeros(1, dtype=torch.long, device=DEV)
    inv = tcf.inv_freq(8, 1e4, DEV)
    for bad in ((pos, inv, 3), (pos.int(), inv, 2), (pos, tcf.inv_freq(34, 1e4, DEV), 2)):
        with pytest.raises(ValueError, match="rope must be"):
            tg.linear(x, w, rope=bad)


@pytest.mark.parametrize("invariant", [False, True])
def test_the_backend_takes_the_kernel_up_to_gemv_max_rows(invariant, monkeypatch):
    """NvidiaOps.linear / grouped_linear run the kernel up to GEMV_MAX_ROWS rows, cuBLAS past them, in batch-invariant
    mode, and for tensors that need a gradient; either way F.linear's function."""
    from deepinfer.backends.nvidia import ops as nv

    monkeypatch.setattr(nv, "GEMV_MAX_ROWS", 2)
    monkeypatch.setattr(nv, "GEMV_DOT_MAX_ROWS", 0)  # (the tensor-core variant's own test: above)
    backend = nv.NvidiaOps(DEV)
    backend.batch_invariant = invariant
    g = gen(3)
    w = torch.randn(24, 40, generator=g).to(DEV)
    wg = torch.randn(3, 8, 40, generator=g).to(DEV)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 40, generator=g).to(DEV)
        for call, args in ((backend.linear, (x, w)), (backend.grouped_linear, (x[:, None].expand(rows, 3, 40), wg))):
            before = backend.kernel_calls["gemv"]
            out = call(*args)
            took = backend.kernel_calls["gemv"] - before
            assert took == (0 if invariant or rows > 2 else 1), (rows, invariant)
            ref = F.linear(x, w) if call == backend.linear else torch.einsum("tgi,goi->tgo", *args)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    xg = torch.randn(1, 40, generator=g).to(DEV).requires_grad_()
    before = backend.kernel_calls["gemv"]
    backend.linear(xg, w).sum().backward()  # autograd: cuBLAS (the kernel has no backward)
    assert backend.kernel_calls["gemv"] == before and xg.grad is not None


@examples(20)
@given(M=st.integers(5, 40), G=st.integers(1, 4), N=st.integers(1, 50), K=st.integers(1, 90),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_grouped_linear_past_the_gemv_writes_its_layout_in_place(M, G, N, K, dtype, strided, seed):
    """Past the GEMV's rows grouped_linear is one batched GEMM reading x [M, G, K] and writing [M, G, N] through
    strides (a contiguous result: out_proj's flatten is then a view, not a copy kernel); x may be a view with a
    row stride wider than G K (a slice of the attention output)."""
    from deepinfer.backends.nvidia import ops as nv

    g = gen(seed)
    backend = nv.NvidiaOps(DEV)
    base = torch.randn(M, G, K + (3 if strided else 0), generator=g)
    x = base[..., :K].to(DEV, dtype) if not strided else base.to(DEV, dtype)[..., :K]
    w = torch.randn(G, N, K, generator=g).to(DEV, dtype)
    before = backend.kernel_calls["grouped_bmm"]
    out = backend.grouped_linear(x, w)
    assert backend.kernel_calls["grouped_bmm"] == before + 1 and out.is_contiguous()
    check(out, x, w)


@gpu
def test_gpu_grouped_linear_at_the_bench_shape_launches_no_copy():
    """CED's output projection at 64 rows (8 groups of 1024 x 1024, bf16): the batched GEMM's kernels only, no
    copy or elementwise kernel around them, and the float64 product's values."""
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.backends.nvidia import ops as nv

    g = gen(9)
    backend = nv.NvidiaOps(DEV)
    x = (torch.randn(64, 8, 1024, generator=g)).to(DEV, torch.bfloat16)
    w = (torch.randn(8, 1024, 1024, generator=g) * 1024 ** -0.5).to(DEV, torch.bfloat16)
    backend.grouped_linear(x, w)  # (cuBLAS's first call)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = backend.grouped_linear(x, w)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names and not [n for n in names if "copy" in n.lower() or "elementwise" in n.lower()], names
    check(out, x, w)


@gpu
@pytest.mark.parametrize("G,N,K", [(1, 2048, 8192), (8, 1024, 1024), (1, 8192, 1024), (1, 512, 2048)])
def test_gpu_ced_bench_projections_in_a_graph(G, N, K):
    """The CED bench config's decode projections, bf16, one row: no host sync, captured once and replayed with new
    rows, each replay against the float64 product."""
    g = gen(7)
    w = (torch.randn(G, N, K, generator=g) * K ** -0.5).to(DEV, torch.bfloat16)
    x = torch.zeros(1, G, K, device=DEV, dtype=torch.bfloat16)
    graph, out = no_host_sync(lambda: capture_graph(lambda: tg.grouped_gemv(x, w)))
    for _ in range(3):
        x.copy_(torch.randn(1, G, K, generator=g).to(DEV, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, w)


@pytest.mark.parametrize("invariant", [False, True])
def test_ced_router_logits_take_the_kernel_up_to_their_limit(invariant, monkeypatch):
    """NvidiaOps.ced_moe_route computes the logits (bf16 rows against the float32 gate) with the GEMV kernel up to
    CED_ROUTE_LOGITS_GEMV_MAX_ROWS rows (its tensor-core variant past MAX_ROWS), then with triton_splitk up to
    CED_ROUTE_LOGITS_SPLITK_MAX_ROWS, never in batch-invariant mode.
    The routing matches the reference's: compared by the float64 biased scores of what each side chose (a near tie
    may pick either expert) and by the chosen weights, never by copying one side's choice into the other."""
    from deepinfer.backends.nvidia import ops as nv
    from deepinfer.backends.reference.ops import ReferenceOps

    limit = tg.MAX_ROWS + 1
    monkeypatch.setattr(nv, "CED_ROUTE_LOGITS_GEMV_MAX_ROWS", limit)  # the last row count on the variant
    monkeypatch.setattr(nv, "CED_ROUTE_LOGITS_SPLITK_MAX_ROWS", limit + 3)
    backend = nv.NvidiaOps(DEV)
    backend.batch_invariant = invariant
    g = gen(9)
    gate, bias = ced_router_case(g, DEV)
    d, k = gate.shape[1], 3
    for rows in (1, 2, limit, limit + 1, limit + 3, limit + 4):
        x = torch.randn(rows, d, generator=g).to(DEV, torch.bfloat16)
        before = backend.kernel_calls["gemv"], backend.kernel_calls["splitk"]
        w, ids = backend.ced_moe_route(x, gate, k, bias=bias, scaling=1.5)
        took = backend.kernel_calls["gemv"] - before[0], backend.kernel_calls["splitk"] - before[1]
        want = (0, 0) if invariant or rows > limit + 3 else (1, 0) if rows <= limit else (0, 1)
        assert took == want, (rows, invariant, took)
        assert_same_routing(x, gate, bias, (w, ids), ReferenceOps(DEV).ced_moe_route(x, gate, k, bias=bias,
                                                                                      scaling=1.5))


@examples(25)
@given(M=st.integers(1, tsk.MAX_ROWS), G=st.integers(1, 3), N=st.integers(1, 150), K=st.integers(1, 700),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), scale=st.sampled_from([1e-3, 1.0, 50.0]),
       knobs=st.sampled_from([{}, dict(block_k=32, block_n=32), dict(block_k=16, block_n=16, max_splits=64),
                              dict(per_sm=1, max_splits=2), dict(swap=True), dict(block_k=32, swap=True)]),
       seed=st.integers(0, 2**16))
def test_split_k_matches_float64(M, G, N, K, dtype, scale, knobs, seed):
    """triton_splitk (rows padded to an MMA's, K split over programs, the last program of a column tile summing the
    partials; with ``swap`` the weight tile as the MMA's M side): the same bound as the GEMV kernel, for every split
    count the knobs give; the ticket counters are left zeroed, and a second call gives the same bits (the partials
    are summed in split order, whichever program finished last)."""
    g = gen(seed)
    x = (torch.randn(M, G, K, generator=g) * scale).to(DEV, dtype)
    w = torch.randn(G, N, K, generator=g).to(DEV, dtype)
    out = tsk.grouped_splitk(x, w, **knobs)
    check(out, x, w)
    assert not tsk._counter_buffer(torch.device(DEV)).any()
    assert torch.equal(tsk.grouped_splitk(x, w, **knobs), out)


@examples(10)
@given(M=st.integers(1, tsk.MAX_ROWS), N=st.integers(1, 80), K=st.integers(1, 400),
       scale=st.sampled_from([1e-3, 1.0, 50.0]), seed=st.integers(0, 2**16))
def test_split_k_of_a_float32_weight_computes_in_float32(M, N, K, scale, seed):
    """bf16 rows against a float32 weight (CED's router logits) into float32: the kernel splits the weight into
    three bf16 terms, so its sum runs over 3K exact products. The bound is check's over those 3K terms (bf16x3: torch's
    casts, their sum asserted to be w exactly); the reference stays x.double() @ w.double()."""
    g = gen(seed)
    x = (torch.randn(M, 1, K, generator=g) * scale).to(DEV, torch.bfloat16)
    w = torch.randn(1, N, K, generator=g).to(DEV) * torch.rand(1, N, K, generator=g).to(DEV) ** 3
    out = tsk.grouped_splitk(x, w)
    assert out.dtype == torch.float32
    check(out, torch.cat([x, x, x], -1).float(), torch.cat(bf16x3(w), -1).float())


def test_split_k_plan_fills_the_gpu_within_its_limits():
    """Splits bring the grid to per_sm programs an SM where K has the tiles, never more than max_splits or K's
    tiles, each split a whole number of K tiles and none empty; rows padded to 16, 32 or 64."""
    from deepinfer.backends.nvidia.triton_attention import sm_count

    dev = torch.device(DEV)
    want = tsk.PROGRAMS_PER_SM * sm_count(dev)
    for M, G, N, K in ((16, 1, 2048, 8192), (64, 8, 1024, 1024), (5, 1, 8192, 1024), (33, 1, 512, 2048),
                       (1, 1, 3, 5000), (7, 2, 40, 7)):
        p = tsk.plan(M, G, N, K, dev)
        tiles, k_tiles = G * -(-N // tsk.BLOCK_N), -(-K // tsk.BLOCK_K)
        assert p["BLOCK_M"] == max(16, 1 << (M - 1).bit_length()) and p["n_tiles"] * G == tiles
        assert 1 <= p["SPLITS"] <= min(tsk.MAX_SPLITS, k_tiles)
        assert (p["SPLITS"] - 1) * p["K_STEPS"] < k_tiles <= p["SPLITS"] * p["K_STEPS"]  # no split empty
        assert tiles * p["SPLITS"] >= min(want, tiles * min(tsk.MAX_SPLITS, k_tiles)) or p["K_STEPS"] > 1


def test_split_k_writes_a_strided_out_and_refuses_bad_inputs():
    g = gen(11)
    x = torch.randn(6, 2, 50, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(2, 30, 50, generator=g).to(DEV, torch.bfloat16)
    wide = torch.zeros(6, 2, 40, device=DEV, dtype=torch.bfloat16)
    out = tsk.grouped_splitk(x, w, out=wide[..., 5:35], block_k=16)
    assert out.data_ptr() == wide[..., 5:35].data_ptr() and not wide[..., :5].any() and not wide[..., 35:].any()
    check(out, x, w)
    for bad_x, bad_w, why in ((x, w[:, :, :49], "K differs"), (x.float(), w.float(), "float32"),
                              (x, w.half(), "mixed dtypes"),
                              (x.half(), w.float(), "fp16 rows against a float32 weight"),
                              (torch.randn(tsk.MAX_ROWS + 1, 2, 50, device=DEV).bfloat16(), w, "too many rows")):
        with pytest.raises(ValueError, match=rf"unsupported inputs.*M <= {tsk.MAX_ROWS}"):
            tsk.grouped_splitk(bad_x, bad_w)
    with pytest.raises(ValueError, match=r"out must be \[6, 2, 30\]"):
        tsk.grouped_splitk(x, w, out=torch.empty(6, 2, 31, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        tsk.linear(x, w)
    for knobs, msg in ((dict(block_k=48), r"block_k must be a power of two in \[16, 512\], got 48"),
                       (dict(block_n=0), "block_n must be a power of two"), (dict(num_warps=6), "num_warps"),
                       (dict(num_stages=0), r"num_stages must be an int in \[1, 8\], got 0"),
                       (dict(per_sm=0), "per_sm must be an int"), (dict(max_splits=2.0), "max_splits must be an int"),
                       (dict(swap=1), "swap must be a bool")):
        with pytest.raises(ValueError, match=msg):
            tsk.grouped_splitk(x, w, **knobs)
    with pytest.raises(ValueError, match=r"swap must be a bool, and True only for same-dtype operands.*float32"):
        tsk.grouped_splitk(x, w.float(), swap=True)  # (the router's float32 weight: its split-weight path only)
    assert not tsk.grouped_splitk(x[..., :0], w[..., :0]).any()


@pytest.mark.parametrize("swap", [False, True])
def test_the_backend_takes_split_k_past_the_gemv_rows(swap, monkeypatch):
    """Rows in (max(GEMV_MAX_ROWS, GEMV_DOT_MAX_ROWS), SPLITK_MAX_ROWS] take triton_splitk (linear and
    grouped_linear; swapped where SPLITK_SWAP says), more rows and batch-invariant mode cuBLAS; either way
    F.linear's function."""
    from deepinfer.backends.nvidia import ops as nv

    monkeypatch.setattr(nv, "SPLITK_SWAP", swap)
    monkeypatch.setattr(nv, "GEMV_MAX_ROWS", 1)
    monkeypatch.setattr(nv, "GEMV_DOT_MAX_ROWS", 2)
    monkeypatch.setattr(nv, "SPLITK_MAX_ROWS", 5)
    g = gen(12)
    w = torch.randn(24, 40, generator=g).to(DEV, torch.bfloat16)
    wg = torch.randn(3, 8, 40, generator=g).to(DEV, torch.bfloat16)
    for invariant in (False, True):
        backend = nv.NvidiaOps(DEV)
        backend.batch_invariant = invariant
        for rows in (2, 3, 5, 6):
            x = torch.randn(rows, 40, generator=g).to(DEV, torch.bfloat16)
            xg = torch.randn(rows, 3, 40, generator=g).to(DEV, torch.bfloat16)
            before = backend.kernel_calls["splitk"]
            check(backend.linear(x, w)[:, None], x[:, None], w[None])
            check(backend.grouped_linear(xg, wg), xg, wg)
            took = backend.kernel_calls["splitk"] - before
            assert took == (2 if 3 <= rows <= 5 and not invariant else 0), (rows, invariant, took)


@gpu
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("M,G,N,K", [(16, 1, 2048, 8192), (64, 8, 1024, 1024), (5, 1, 8192, 1024),
                                     (33, 1, 512, 2048)])
def test_gpu_split_k_in_a_graph(M, G, N, K, swap):
    """The CED bench config's decode projections at 5-64 rows, bf16, either MMA orientation: no host sync, captured
    once and replayed with new rows (the ticket counters reset by each replay), each replay against the float64
    product."""
    g = gen(8)
    w = (torch.randn(G, N, K, generator=g) * K ** -0.5).to(DEV, torch.bfloat16)
    x = torch.zeros(M, G, K, device=DEV, dtype=torch.bfloat16)
    graph, out = no_host_sync(lambda: capture_graph(lambda: tsk.grouped_splitk(x, w, swap=swap)))
    for _ in range(3):
        x.copy_(torch.randn(M, G, K, generator=g).to(DEV, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, w)
    assert not tsk._counter_buffer(torch.device(DEV)).any()


_COMPILE_SCRIPT = r'''
import json
import torch
from deepinfer.backends.nvidia import triton_attention, triton_gemv as tg, triton_splitk as tsk
from deepinfer.testing.kernels import compile_sm90, sass_row

assert not tg.INTERPRET
pat = r"\b(LDG\.E\.128|LDGSTS\.E\.BYPASS\.128|HMMA|HGMMA|STL|LDL)\b"
ints = {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_xg", "stride_wg", "stride_wn", "stride_om",
                           "stride_og")}
# As a launch at the bench shapes specialises them (every stride and size a multiple of 16; unaligned strides leave
# the weight loads 2 bytes wide: aligned shapes are what the engine's weights have)
div16 = ("N", "K", "stride_xm", "stride_xg", "stride_wg", "stride_wn", "stride_om", "stride_og")
sig = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", **ints)
report = {}
for bm in (1, 8):  # the shipped launch: tile 8192, BLOCK_N from 64 down, 8 warps
    k = compile_sm90(tg._gemv_kernel, sig, dict(BLOCK_M=bm, BLOCK_N=16, BLOCK_K=512, K_I=0), div16, num_warps=8)
    report[f"gemv_m{bm}"] = sass_row(k, pat)
# its first weight tile before the PDL wait (EARLY_W), under PDL as a Hopper launch takes it
k = compile_sm90(tg._gemv_kernel, sig, dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, K_I=0, EARLY_W=True, PDL=2), div16,
                 num_warps=8)
report["gemv_m1_early"] = sass_row(k, pat)
k = compile_sm90(tg._dot_kernel, sig, dict(BLOCK_N=16, BLOCK_K=512, K_I=0, WIDEN=False, PRECISION="tf32"), div16,
                 num_warps=4)
report["dot_bf16"] = sass_row(k, pat)
# the variant at 32 and 64 rows, as dot_block_sizes sizes W_q_b (8192 x 1024) and W_q_a (1024 x 2048) on an H200
triton_attention._SM_COUNT[0] = 132
for M in (32, 64):
    for N, K in ((8192, 1024), (1024, 2048)):
        bm, bn, bk = tg.dot_block_sizes(M, 1, N, K, torch.device("cuda", 0))
        k = compile_sm90(tg._dot_kernel, sig, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_I=0, WIDEN=False,
                                                    PRECISION="tf32", PDL=2), div16, num_warps=4, launch_pdl=True)
        report[f"dot_bf16_m{M}_n{N}"] = sass_row(k, pat, smem=k.metadata.shared)
# W_q_b's GEMV at one row and on the variant: CED's query RoPE on the store; the query latent's RMSNorm in its
# prologue (norm_in); both
rope = dict(pos_ptr="*i64", inv_ptr="*fp32", HEAD_D="i32", HALF="i32")
normin = dict(nin_w="*bf16", nin_eps="fp32")
for name, extra, flags in (("rope", rope, dict(ROPE=True)), ("normin", normin, dict(NORM_IN=True)),
                           ("normin_rope", {**rope, **normin}, dict(ROPE=True, NORM_IN=True))):
    k = compile_sm90(tg._gemv_kernel, dict(sig, **extra), dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, K_I=0, **flags),
                     div16, num_warps=8)
    report[f"gemv_m1_{name}"] = sass_row(k, pat)
    k = compile_sm90(tg._dot_kernel, dict(sig, **extra), dict(BLOCK_N=16, BLOCK_K=512, K_I=0, WIDEN=False,
                                                              PRECISION="tf32", **flags), div16, num_warps=4)
    report[f"dot_bf16_{name}"] = sass_row(k, pat)
# CED's router logits (bf16 rows, float32 gate and logits) with the router on the last program (Tail): the GEMV at
# one row, split-K at 64
tsig = dict(tail_count="*i32", tail_w="*fp32", tail_ids="*i64", tail_bias="*fp32", tail_scale="fp32")
tail = dict(ROUTE=True, TOPK=4, BLOCK_E=32, BLOCK_TK=4, HAS_BIAS=True, RENORM=True)
k = compile_sm90(tg._gemv_kernel, dict(sig, w_ptr="*fp32", out_ptr="*fp32", **tsig),
                 dict(BLOCK_M=1, BLOCK_N=1, BLOCK_K=2048, K_I=0, **tail), div16, num_warps=8)
report["gemv_m1_route"] = sass_row(k, pat)
ssig = dict(sig, w_ptr="*fp32", out_ptr="*fp32", part_ptr="*fp32", count_ptr="*i32", N_TILES="i32", **tsig)
k = compile_sm90(tsk._splitk_kernel, ssig, dict(SPLITS=16, K_STEPS=1, BLOCK_M=64, BLOCK_N=32, BLOCK_K=128,
                                                SPLIT_W=True, **tail), div16, num_warps=4)
report["splitk_m64_route"] = sass_row(k, pat)
# The bench projections at 16 rows, the rows as the MMA's M (mma.sync) or the weight tile (swap: wgmma)
mma_pat = r"\b(LDG\.E\.128|LDGSTS\.E\.BYPASS\.128|HMMA|HGMMA\.64x16x16|HGMMA|STL|LDL)\b"
ssig = dict(sig, part_ptr="*fp32", count_ptr="*i32", N_TILES="i32")
for swap in (False, True):
    k = compile_sm90(tsk._splitk_kernel, ssig, dict(SPLITS=4, K_STEPS=4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                                                    SWAP=swap), div16, num_warps=4, num_stages=3)
    report["splitk_m16" + ("_swap" if swap else "")] = sass_row(k, mma_pat)
print(json.dumps(report))
'''


def test_kernels_compile_for_hopper():
    """The compiled path CPU CI never runs: both kernels build for sm_90; where cuobjdump exists, 16-byte weight
    loads and no local-memory spills, and the variant's products on the tensor cores."""
    from deepinfer.testing.kernels import run_compile_script

    report = run_compile_script(_COMPILE_SCRIPT)
    assert set(report) == {"gemv_m1", "gemv_m8", "dot_bf16", "gemv_m1_rope", "dot_bf16_rope", "gemv_m1_route",
                           "splitk_m64_route", "gemv_m1_normin", "dot_bf16_normin", "gemv_m1_normin_rope",
                           "dot_bf16_normin_rope", "splitk_m16", "splitk_m16_swap", "gemv_m1_early",
                           "dot_bf16_m32_n8192", "dot_bf16_m32_n1024", "dot_bf16_m64_n8192", "dot_bf16_m64_n1024"}
    for name, row in report.items():
        assert row.get("smem", 0) <= 227 * 1024, (name, row)  # within the H200's / H100's shared memory per block
        sass = row.get("sass")
        if sass is None:
            continue  # no cuobjdump in this triton install
        if not name.endswith("_rope"):  # (libdevice's cosf / sinf keep a local array for huge angles)
            assert sass.get("STL", 0) == 0 and sass.get("LDL", 0) == 0, f"{name}: local-memory spills: {sass}"
        assert sass.get("LDG.E.128", 0) + sass.get("LDGSTS.E.BYPASS.128", 0) > 0, (name, sass)  # 16-byte loads
    for name in ("dot_bf16", "dot_bf16_m32_n8192", "dot_bf16_m64_n1024"):
        dot = report[name].get("sass")
        if dot is not None:
            assert dot.get("HMMA", 0) + dot.get("HGMMA", 0) > 0, (name, dot)
    plain, swap = report["splitk_m16"].get("sass"), report["splitk_m16_swap"].get("sass")
    if swap is not None:  # swap: the weight tile as wgmma's 64-row M side, the 16 rows its N
        assert plain.get("HMMA", 0) > 0 and not any(op.startswith("HGMMA") for op in plain), plain
        assert swap.get("HGMMA.64x16x16", 0) > 0 and swap.get("HMMA", 0) == 0, swap
