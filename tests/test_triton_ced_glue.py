"""The kernels that replace a CED decode step's glue (the MoE router, the decoder's candidate pool, the SWA key with
its ring write) against the reference ops and torch formulas they replace.

Without CUDA the kernels run under Triton's interpreter on hypothesis-drawn shapes. What must hold:
- router (triton_ced_route): the reference route's ids, in its order, and its weights within a few float32 ulp;
  equal selection scores go to the lower expert id;
- pool (triton_ced_pool): exactly functional.pool_candidates, ties between block maxima included;
- SWA key (triton_ced_swa): without fake quantisation within 2 ulp of rms -> rope (the norm's sum order); with
  it, exactly the FP8 fake quantisation of that, and the ring holds exactly the reference's codes of the key;
- the dispatch: NvidiaOps counts its kernels and falls back to the reference op for what they do not take.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import (DEV, assert_same_bits, capture_graph, examples, gen, gpu, no_host_sync,
                                       run_compile_script, skip_module_without_kernels)

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_ced_compress as tcc  # noqa: E402
from deepinfer.backends.nvidia import triton_ced_fused as tcf  # noqa: E402
from deepinfer.backends.nvidia import triton_ced_pool as tcp  # noqa: E402
from deepinfer.backends.nvidia import triton_ced_route as tcr  # noqa: E402
from deepinfer.backends.nvidia import triton_ced_swa as tcs  # noqa: E402
from deepinfer.backends.nvidia.ops import NvidiaOps  # noqa: E402
from deepinfer.backends.reference import lowbit  # noqa: E402
from deepinfer.backends.reference.moe import route  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402
from deepinfer.models.ced import functional as fn  # noqa: E402

FAST = examples(15)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


# ------------------------------------------------------------------------------------------------ router
@FAST
@given(T=st.integers(0, 5), E=st.sampled_from([1, 2, 7, 32, 100, 384]), k_frac=st.floats(0.0, 1.0),
       has_bias=st.booleans(), renorm=st.booleans(), scaling=st.sampled_from([1.0, 1.5, 2.5]),
       dtype=st.sampled_from(DTYPES), spread=st.sampled_from([1.0, 10.0, 40.0]), seed=st.integers(0, 2**16))
def test_route_matches_reference(T, E, k_frac, has_bias, renorm, scaling, dtype, spread, seed):
    g = gen(seed)
    k = max(1, min(E, 8, round(k_frac * E)))
    logits = (torch.randn(T, E, generator=g) * spread).to(dtype).to(DEV)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEV) if has_bias else None
    w, ids = tcr.route(logits, k, renormalize=renorm, scaling=scaling, bias=bias)
    rw, rids = route(logits.cpu(), k, scoring="sqrt_softplus", renormalize=renorm, scaling=scaling,
                     bias=None if bias is None else bias.cpu())
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (T, k)
    assert torch.equal(ids.cpu(), rids)
    assert ((w.cpu() - rw).abs() <= 8 * 2.0 ** -23 * rw.abs().clamp_min(1e-30)).all()


@FAST
@given(T=st.integers(1, 40), E=st.sampled_from([2, 7, 32, 100]), rows=st.sampled_from([2, 4, 16]),
       has_bias=st.booleans(), renorm=st.booleans(), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_route_rows_a_program_are_the_bits_of_one_a_program(T, E, rows, has_bias, renorm, ties, seed):
    """Several tokens a program (ROWS; T not a multiple of it, padded expert counts, tied logits): the weights and
    ids of one token a program, bit for bit, and the reference's ids where no scores tie."""
    g = gen(seed)
    k = min(E, 4)
    logits = torch.randn(T, E, generator=g) * 4
    if ties:
        logits = logits.round()  # many equal scores: ties go to the lower expert either way
    logits = logits.to(DEV)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEV) if has_bias else None
    w1, ids1 = tcr.route(logits, k, renormalize=renorm, scaling=1.5, bias=bias, rows=1)
    wr, idsr = tcr.route(logits, k, renormalize=renorm, scaling=1.5, bias=bias, rows=rows)
    assert torch.equal(ids1, idsr) and torch.equal(w1.view(torch.int32), wr.view(torch.int32))
    if not ties:  # (torch.topk, the reference's, breaks ties its own way)
        _, rids = route(logits.cpu(), k, scoring="sqrt_softplus", renormalize=renorm, scaling=1.5,
                        bias=None if bias is None else bias.cpu())
        assert torch.equal(idsr.cpu(), rids)


def test_route_rows_choice_and_bad_rows(monkeypatch):
    monkeypatch.setattr(tcr, "ROWS_FROM", 0)
    assert tcr.rows_per_program(1 << 14, 32) == 1  # off
    monkeypatch.setattr(tcr, "ROWS_FROM", 2048)
    assert tcr.rows_per_program(2047, 32) == 1 and tcr.rows_per_program(2048, 32) == tcr.ROWS
    assert tcr.rows_per_program(1 << 14, 1024) == 1  # at most 1024 logits a program
    logits = torch.zeros(3, 8, device=DEV)
    for bad in (0, 3, True, 2.0, 2048):
        with pytest.raises(ValueError, match="rows must be"):
            tcr.route(logits, 2, rows=bad)


@FAST
@given(T=st.integers(0, 4), E=st.sampled_from([2, 7, 32, 100]), d=st.sampled_from([8, 48, 300]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_route_from_hidden_matches_the_gate_product_then_route(T, E, d, dtype, seed):
    """The router with its gate GEMV: the reference's ids and weights for F.linear(x.float(), gate), up to the
    float32 rounding of the logits' sums (another order): where the sets differ, their selection scores agree."""
    g = gen(seed)
    k = min(E, 4)
    x = torch.randn(T, d, generator=g).to(dtype)
    gate = torch.randn(E, d, generator=g) / d ** 0.5
    logits = torch.nn.functional.linear(x.float(), gate)
    bias = torch.randn(E, generator=g) * 0.1
    w, ids = tcr.route_from_hidden(x.to(DEV), gate.to(DEV), k, scaling=1.5, bias=bias.to(DEV))
    rw, rids = ReferenceOps("cpu").ced_moe_route(x, gate, k, bias=bias, scaling=1.5)
    choice = torch.sqrt(torch.nn.functional.softplus(logits)) + bias
    for t in range(T):  # same set, or a set whose selection scores are the reference's up to float noise
        if not torch.equal(ids[t].cpu(), rids[t]):
            a, b = choice[t, ids[t].cpu()].sort().values, choice[t, rids[t]].sort().values
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.allclose(w[t].cpu(), rw[t], rtol=1e-5, atol=1e-7)


def test_route_ties_go_to_the_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0]], device=DEV)
    w, ids = tcr.route(logits, 3, renormalize=True, scaling=1.0)
    assert ids.tolist() == [[1, 2, 4]]
    assert torch.allclose(w.cpu(), torch.full((1, 3), 1 / 3))


# ------------------------------------------------------------------------------------------------ add + norm, SwiGLU
@FAST
@given(T=st.integers(0, 4), N=st.sampled_from([1, 16, 100, 256]), dtype=st.sampled_from(DTYPES),
       extra=st.booleans(), seed=st.integers(0, 2**16))
def test_add_rms_norm_matches_add_then_rms(T, N, dtype, extra, seed):
    g = gen(seed)
    x, r = (torch.randn(T, N, generator=g) * 4).to(dtype), torch.randn(T, N, generator=g).to(dtype)
    e = torch.randn(T, N, generator=g).to(dtype) if extra else None
    w = 1 + 0.1 * torch.randn(N, generator=g)
    h, out = tcf.add_rms_norm(x.to(DEV), r.to(DEV), w.to(DEV), 1e-6, None if e is None else e.to(DEV))
    rh, rout = ReferenceOps("cpu").ced_add_rms_norm(x, r, w, 1e-6, e)
    assert_same_bits(h.cpu(), rh)  # the adds round as torch's
    bound = (4 if dtype == torch.float32 else 1) * ulp(torch.maximum(out.cpu().abs(), rout.abs()), dtype)
    assert ((out.cpu().double() - rout.double()).abs() <= bound).all()  # the norm's sum order: 1 ulp


@FAST
@given(T=st.integers(0, 4), N=st.sampled_from([1, 16, 100, 256]), k=st.integers(1, 8), dtype=st.sampled_from(DTYPES),
       extra=st.booleans(), seed=st.integers(0, 2**16))
def test_add_rms_norm_adds_pair_rows_as_the_k_sum_then_the_add(T, N, k, dtype, extra, seed):
    """A MoE's pair rows [T * k, N] in place of the residual (ksum = k): the bits of triton_moe.k_sum's [T, N] then
    the plain add + norm, and the k rows' float32 sum in pair order (written here), rounded once, as the term."""
    from deepinfer.backends.nvidia import triton_moe

    g = gen(seed)
    x = (torch.randn(T, N, generator=g) * 4).to(dtype).to(DEV)
    pairs = (torch.randn(T * k, N, generator=g) * torch.rand(T * k, 1, generator=g) * 3).to(dtype).to(DEV)
    e = torch.randn(T, N, generator=g).to(dtype).to(DEV) if extra else None
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(DEV)
    h, out = tcf.add_rms_norm(x, pairs, w, 1e-6, e, ksum=k)
    wh, wout = tcf.add_rms_norm(x, triton_moe.k_sum(pairs, T, k, {}), w, 1e-6, e)
    assert_same_bits(h, wh)
    assert_same_bits(out, wout)
    acc = torch.zeros(T, N, dtype=torch.float32, device=DEV)
    for j in range(k):  # in pair order, one float32 add at a time
        acc = acc + pairs.view(T, k, N)[:, j].float()
    term = acc.to(dtype) if e is None else (acc.to(dtype) + e)
    assert_same_bits(h, x + term)


@FAST
@given(T=st.integers(0, 4), N=st.sampled_from([1, 16, 100, 256]), k=st.integers(1, 5), dtype=st.sampled_from(DTYPES),
       extra=st.booleans(), seed=st.integers(0, 2**16))
def test_add_moe_is_the_torch_adds(T, N, k, dtype, extra, seed):
    """add_moe (engine_path.finish's one launch): x + (residual + extra) with torch's roundings, bit for bit; with
    pair rows (k > 1) the residual is their float32 sum in pair order (written here), rounded once."""
    g = gen(seed)
    x = (torch.randn(T, N, generator=g) * 4).to(dtype).to(DEV)
    pairs = (torch.randn(T * k, N, generator=g) * torch.rand(T * k, 1, generator=g) * 3).to(dtype).to(DEV)
    e = torch.randn(T, N, generator=g).to(dtype).to(DEV) if extra else None
    acc = torch.zeros(T, N, dtype=torch.float32, device=DEV)
    for j in range(k):
        acc = acc + pairs.view(T, k, N)[:, j].float()
    r = acc.to(dtype)
    want = x + (r if e is None else r + e)
    assert_same_bits(tcf.add_moe(x, pairs, e, ksum=k), want)
    if k == 1:
        assert_same_bits(tcf.add_moe(x, pairs, e), want)


def test_add_moe_dispatch_and_refusals():
    """NvidiaOps.ced_add: the kernel for plain rows and a PairSum's rows (never taking its value), the torch adds
    for mixed dtypes and in batch-invariant mode (the same bits); add_moe refuses shapes it does not take."""
    from deepinfer.backends.nvidia import triton_moe
    from deepinfer.pair_sum import PairSum

    g = gen(9)
    ops = NvidiaOps(DEV)
    h = torch.randn(2, 40, generator=g).bfloat16().to(DEV)
    pairs = torch.randn(6, 40, generator=g).bfloat16().to(DEV)
    sh = torch.randn(2, 40, generator=g).bfloat16().to(DEV)
    got = ops.ced_add(h, PairSum(pairs, 3, lambda p, k: pytest.fail("the kernel adds the rows")), sh)
    assert ops.kernel_calls["ced_add_pairs"] == 1
    summed = triton_moe.k_sum(pairs, 2, 3, {})
    assert_same_bits(got, h + (summed + sh))
    assert_same_bits(ops.ced_add(h, summed), h + summed) and ops.kernel_calls["ced_add"] == 1
    assert_same_bits(ops.ced_add(h, summed.float()), h + summed.float())  # mixed dtypes: torch's promotion
    assert ops.kernel_calls["ced_add"] == 1
    ops.batch_invariant = True
    assert_same_bits(ops.ced_add(h, summed, sh), h + (summed + sh)) and ops.kernel_calls["ced_add"] == 1
    for bad in ((h, pairs), (h, summed[:, :8]), (h[0], summed[0])):
        assert not tcf.supports_add(*bad)
        with pytest.raises(ValueError, match="add_moe: unsupported"):
            tcf.add_moe(*bad)
    assert not tcf.supports_add(h, pairs, ksum=4) and tcf.supports_add(h, pairs, ksum=3)


def test_pair_sum_contract_and_dispatch():
    """PairSum: shape / dtype of its sum, value taken once, bad pair counts refused; NvidiaOps adds it in the add +
    RMSNorm kernel where it can and takes its value for the reference otherwise (mixed dtypes, batch-invariant)."""
    from deepinfer.pair_sum import PairSum, dense

    g = gen(4)
    pairs = torch.randn(6, 40, generator=g).bfloat16().to(DEV)
    calls = []
    ps = PairSum(pairs, 3, lambda p, k: calls.append(k) or p.view(-1, k, 40).float().sum(1).to(p.dtype))
    assert ps.shape == (2, 40) and ps.dtype == torch.bfloat16 and ps.device == pairs.device
    assert dense(ps) is ps.value() and calls == [3] and dense(pairs) is pairs
    for bad in ((pairs, 4), (pairs, 0), (pairs[0], 1)):
        with pytest.raises(ValueError, match="PairSum: pairs must be"):
            PairSum(*bad, lambda p, k: p)
    ops = NvidiaOps(DEV)
    h, w = torch.randn(2, 40, generator=g).bfloat16().to(DEV), (1 + 0.1 * torch.randn(40, generator=g)).to(DEV)
    got = ops.ced_add_rms_norm(h, PairSum(pairs, 3, lambda p, k: pytest.fail("the kernel adds the rows")), w, 1e-6)
    assert ops.kernel_calls["ced_add_rms_norm_pairs"] == 1
    from deepinfer.backends.nvidia import triton_moe

    want = ops.ced_add_rms_norm(h, triton_moe.k_sum(pairs, 2, 3, {}), w, 1e-6)
    assert_same_bits(got[0], want[0])
    assert_same_bits(got[1], want[1])
    taken = []
    ps = PairSum(pairs.float(), 3, lambda p, k: taken.append(k) or triton_moe.k_sum(p, 2, k, {}))
    ops.ced_add_rms_norm(h, ps, w, 1e-6)  # float32 rows beside a bf16 x: the reference, on the rows' sum
    assert taken == [3] and ops.kernel_calls["ced_add_rms_norm_pairs"] == 1
    ops.batch_invariant = True
    taken.clear()
    ps = PairSum(pairs, 3, lambda p, k: taken.append(k) or triton_moe.k_sum(p, 2, k, {}))
    got_h, _ = ops.ced_add_rms_norm(h, ps, w, 1e-6)
    assert taken == [3]
    assert_same_bits(got_h, h + ps.value())


@FAST
@given(T=st.integers(0, 4), F=st.sampled_from([1, 16, 40, 1500]), dtype=st.sampled_from(DTYPES),
       limit=st.sampled_from([0.5, 10.0]), seed=st.integers(0, 2**16))
def test_swiglu_matches_clamped_silu_times_up(T, F, dtype, limit, seed):
    gu = (torch.randn(T, 2 * F, generator=gen(seed)) * 6).to(dtype)
    out = tcf.swiglu(gu.to(DEV), limit)
    ref = ReferenceOps("cpu").ced_swiglu(gu, limit)
    # exp from numpy (libdevice on the GPU) against torch's vectorised one: a few float32 ulp, rounded away in
    # 16-bit dtypes but for an ulp
    bound = (4 if dtype == torch.float32 else 1) * ulp(ref.abs(), dtype)
    assert out.dtype == dtype and ((out.cpu().double() - ref.double()).abs() <= bound).all()


# ------------------------------------------------------------------------------------------------ pool
@FAST
@given(Tq=st.integers(0, 4), J=st.integers(0, 70), block=st.integers(1, 9), nblocks=st.integers(1, 12),
       levels=st.sampled_from([3, 1000]), seed=st.integers(0, 2**16))
def test_pool_candidates_match_functional(Tq, J, block, nblocks, levels, seed):
    g = gen(seed)
    scores = torch.randint(0, levels, (Tq, J), generator=g).float() - levels // 2  # few levels: tied blocks
    nvis = torch.randint(0, J + 3, (Tq,), generator=g)
    visible = torch.arange(J)[None, :] < nvis[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))  # as the indexer leaves them
    out = tcp.pool_candidates(scores.to(DEV), nvis.to(DEV), block, nblocks)
    assert torch.equal(out.cpu(), fn.pool_candidates(scores, visible, block, nblocks))


# ------------------------------------------------------------------------------------------------ SWA key
def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.pow(2.0, torch.floor(torch.log2(x.double().abs().clamp_min(2.0 ** -126))) - MANTISSA[dtype])


def swa_case(seed, T, D, R, dtype, S=3, ring=5):
    g = gen(seed)
    y = (torch.randn(T, D, generator=g) * 3).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV)
    pos = torch.randint(0, 5000, (T,), generator=g).to(DEV)
    slot = torch.randperm(S, generator=g)[:T].to(DEV) if T <= S else torch.arange(T, device=DEV) % S
    codes = torch.randint(0, 255, (S, ring, D), generator=g, dtype=torch.uint8).to(DEV)
    scales = torch.randint(0, 255, (S, ring, D // 32), generator=g, dtype=torch.uint8).to(DEV)
    return y, w, pos, slot, (codes, scales), tcf.inv_freq(R, 10000.0, DEV)


@FAST
@given(T=st.integers(0, 3), D=st.sampled_from([32, 64, 96, 160]), frac=st.sampled_from([1.0, 0.5, 0.25]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_swa_kv_ring_matches_norm_rope_and_fake_quantisation(T, D, frac, dtype, seed):
    R = max(2, int(D * frac) // 2 * 2)
    y, w, pos, slot, ring, inv = swa_case(seed, T, D, R, dtype)
    plain_ring = tuple(t.clone() for t in ring)
    plain = tcs.swa_kv_ring(y, w, 1e-6, pos, inv, plain_ring, slot, fake=False)
    # The reference with the kernel's frequencies: the device's pow may differ from the CPU's by an ulp, which at
    # position 5000 moves an angle by far more than the kernel's roundings (the H200 failed that way)
    with mock.patch.object(fn, "rope_inv_freq", lambda *a: inv.cpu()):
        ref = fn.apply_rope(fn.rms(y.cpu(), w.cpu(), 1e-6), pos.cpu(), R, 10000.0)
    assert plain.dtype == dtype and plain.shape == (T, D)
    row = ref.double().abs().amax(-1, keepdim=True) if T else ref.double()
    # a few ulps of the row's largest value: the device's rsqrt, sin and cos are not the CPU's (3 ulps seen on the
    # H200 in float32)
    assert ((plain.cpu().double() - ref.double()).abs() <= 8 * ulp(row, dtype)).all()
    kv = tcs.swa_kv_ring(y, w, 1e-6, pos, inv, ring, slot, fake=True)
    assert_same_bits(kv.cpu(), lowbit.fake_quantize(plain.cpu(), "fp8_e4m3_pow2"))
    codes, scales = lowbit.quantize(kv.cpu(), "fp8_e4m3_pow2")
    at = pos.cpu() % ring[0].shape[1]
    for got, want in ((ring[0], codes), (ring[1], scales)):
        assert torch.equal(got.cpu()[slot.cpu(), at], want)
    pc, ps = lowbit.quantize(plain.cpu(), "fp8_e4m3_pow2")  # without fake quantisation: the codes of the key
    assert torch.equal(plain_ring[0].cpu()[slot.cpu(), at], pc)
    assert torch.equal(plain_ring[1].cpu()[slot.cpu(), at], ps)
    untouched = torch.ones(ring[0].shape[:2], dtype=torch.bool)
    untouched[slot.cpu(), at] = False
    fresh = swa_case(seed, T, D, R, dtype)[4]  # the same random ring before the writes
    assert torch.equal(ring[0].cpu()[untouched], fresh[0].cpu()[untouched])


# ------------------------------------------------------------------------------------------------ dispatch
def test_ops_dispatch_count_and_fall_back():
    ops, ref = NvidiaOps(DEV), ReferenceOps(DEV)
    g = gen(3)
    logits = torch.randn(4, 16, generator=g).to(DEV)
    bias = torch.randn(16, generator=g).to(DEV) * 0.1
    kw = dict(scoring="sqrt_softplus", renormalize=True, scaling=1.5, bias=bias)
    for a, b in zip(ops.moe_route(logits, 3, **kw), ref.moe_route(logits, 3, **kw)):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)
    assert ops.kernel_calls["moe_route"] == 1
    for other in (dict(scoring="softmax"), dict(scoring="sqrt_softplus", n_group=4, topk_group=2)):
        a, b = ops.moe_route(logits, 2, **other), ref.moe_route(logits, 2, **other)
        assert_same_bits(a[0], b[0])
        assert torch.equal(a[1], b[1])
    assert ops.kernel_calls["moe_route"] == 1

    x, gate = torch.randn(3, 40, generator=g).to(DEV), torch.randn(16, 40, generator=g).to(DEV)
    ops.ced_moe_route(x, gate, 3, bias=bias, scaling=1.5)  # (default: the logits' GEMV, then the route kernel)
    assert ops.kernel_calls["ced_moe_route"] == 0 and ops.kernel_calls["moe_route"] == 2
    with mock.patch("deepinfer.backends.nvidia.ops.CED_ROUTE_GEMV_MAX_ROWS", tcr.MAX_HIDDEN_ROWS):
        ops.ced_moe_route(x, gate, 3, bias=bias, scaling=1.5)  # the GEMV inside the router kernel
        assert ops.kernel_calls["ced_moe_route"] == 1
        big = torch.randn(300, 40, generator=g).to(DEV)  # past MAX_HIDDEN_ROWS: the GEMM, then the route kernel
        ops.ced_moe_route(big, gate, 3, bias=bias, scaling=1.5)
        assert ops.kernel_calls["ced_moe_route"] == 1 and ops.kernel_calls["moe_route"] == 3

    h, r = x.bfloat16(), torch.randn(3, 40, generator=g).bfloat16().to(DEV)
    ops.ced_add_rms_norm(h, r, gate[0], 1e-6, r)
    ops.ced_swiglu(h, 10.0)
    assert ops.kernel_calls["ced_add_rms_norm"] == 1 and ops.kernel_calls["ced_swiglu"] == 1
    ops.ced_add_rms_norm(h, r.float(), gate[0], 1e-6)  # mixed dtypes: the reference
    ops.ced_swiglu(h.double(), 10.0)
    assert ops.kernel_calls["ced_add_rms_norm"] == 1 and ops.kernel_calls["ced_swiglu"] == 1

    scores = torch.randn(2, 20, generator=g).to(DEV)
    nvis = torch.tensor([20, 7], device=DEV)
    assert torch.equal(ops.ced_pool_candidates(scores, nvis, 4, 2), ref.ced_pool_candidates(scores, nvis, 4, 2))
    assert ops.kernel_calls["ced_pool_candidates"] == 1
    ops.ced_pool_candidates(scores.double(), nvis, 4, 2)  # float64: the reference
    assert ops.kernel_calls["ced_pool_candidates"] == 1

    y, w, pos, slot, ring, _ = swa_case(4, 2, 64, 16, torch.bfloat16)
    ring_ref = tuple(t.clone() for t in ring)
    args = (1e-6, pos, 16, 10000.0, "fp8_e4m3_pow2", True)
    a = ops.ced_swa_kv(y, w, *args, ring, slot)
    b = ref.ced_swa_kv(y, w, *args, ring_ref, slot)
    assert ops.kernel_calls["ced_swa_kv"] == 1
    assert ((a.float() - b.float()).abs() <= 0.07 * b.float().abs().amax()).all()  # an FP8 step at most
    f32_ring = lowbit.quantize(torch.zeros(3, 5, 64, device=DEV), "fp32")  # a ring in the raw format
    ops.ced_swa_kv(y, w, 1e-6, pos, 16, 10000.0, "fp32", True, f32_ring, slot)  # no kernel for fp32 rings
    assert ops.kernel_calls["ced_swa_kv"] == 1


def test_batch_invariant_ops_run_the_composition_a_mixed_step_runs():
    """Batch-invariant mode: a decode step's fused CED ops give the bits of what a mixed step's path computes
    (engine_path: finish's adds then ced_rms_norm; rms -> rope -> fake; the gate matmul then moe_route), so a
    request's tokens do not depend on whether its step held prefill chunks (the H200 saw them differ)."""
    ops = NvidiaOps(DEV)
    ops.batch_invariant = True
    g = gen(5)
    h, r, e = (torch.randn(3, 40, generator=g).bfloat16().to(DEV) for _ in range(3))
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(DEV)
    got_h, got_x = ops.ced_add_rms_norm(h, r, w, 1e-6, e)
    want_h = h + (r + e)
    assert_same_bits(got_h, want_h)
    assert_same_bits(got_x, ops.ced_rms_norm(want_h, w, 1e-6))
    x, gate = torch.randn(3, 40, generator=g).to(DEV), torch.randn(16, 40, generator=g).to(DEV)
    bias = torch.randn(16, generator=g).to(DEV) * 0.1
    got = ops.ced_moe_route(x, gate, 3, bias=bias, scaling=1.5)
    want = ops.moe_route(torch.nn.functional.linear(x, gate), 3, scoring="sqrt_softplus", renormalize=True,
                         scaling=1.5, bias=bias)
    assert_same_bits(got[0], want[0])
    assert torch.equal(got[1], want[1])
    y, w, pos, slot, ring, _ = swa_case(4, 2, 64, 16, torch.bfloat16)
    kv = ops.ced_swa_kv(y, w, 1e-6, pos, 16, 10000.0, "fp8_e4m3_pow2", True, ring, slot)
    assert_same_bits(kv, fn.fake(fn.apply_rope(fn.rms(y, w, 1e-6, ops=ops), pos, 16, 10000.0, ops=ops),
                                 "fp8_e4m3_pow2", True, ops=ops))
    assert not any(ops.kernel_calls[k] for k in ("ced_add_rms_norm", "ced_moe_route", "ced_swa_kv",
                                                 "ced_compress_write"))


def test_reference_swa_kv_is_the_layer_formula_and_the_ring_write():
    """ReferenceOps.ced_swa_kv = CEDLayer.swa_kv's formula, then CEDCache.ring_write's quantisation and slots."""
    y, w, pos, slot, ring, _ = swa_case(6, 3, 64, 16, torch.float32)
    y, w, pos, slot = y.cpu(), w.cpu(), pos.cpu(), slot.cpu()
    ring = tuple(t.cpu() for t in ring)
    kv = ReferenceOps("cpu").ced_swa_kv(y, w, 1e-6, pos, 16, 10000.0, "fp8_e4m3_pow2", True, ring, slot)
    want = lowbit.fake_quantize(fn.apply_rope(fn.rms(y, w, 1e-6), pos, 16, 10000.0), "fp8_e4m3_pow2")
    assert_same_bits(kv, want)
    codes, scales = lowbit.quantize(want, "fp8_e4m3_pow2")
    assert torch.equal(ring[0][slot, pos % 5], codes)
    assert torch.equal(ring[1][slot, pos % 5], scales)


@FAST
@given(Tq=st.integers(0, 4), R=st.integers(1, 3), J=st.integers(1, 40), K=st.integers(0, 20),
       seed=st.integers(0, 2**16))
def test_entry_rows_match_the_indexed_table(Tq, R, J, K, seed):
    g = gen(seed)
    table = torch.randint(0, 1000, (R, J), generator=g)
    q_rows = torch.randint(0, R, (Tq,), generator=g)
    ids = torch.randint(-1, J, (Tq, K), generator=g)
    out, count = tcp.entry_rows(table.to(DEV), q_rows.to(DEV), ids.to(DEV), count=True)
    assert torch.equal(out.cpu(), ReferenceOps("cpu").ced_entry_rows(table, q_rows, ids))
    assert torch.equal(count.cpu(), (ids >= 0).sum(1))


# ------------------------------------------------------------------------------------------------ compressor
@FAST
@given(G=st.integers(0, 4), m=st.sampled_from([1, 2, 4]), C=st.sampled_from([32, 64, 96]),
       fmt=st.sampled_from(["fp4_e2m1_e4m3", "mxfp4"]), kv=st.booleans(), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_compress_write_matches_the_entry_formulas(G, m, C, fmt, kv, dtype, seed):
    """The codes written equal the reference op's (CEDLayer.entries then write_entries) but where the float
    noise of the softmax and norm moves a value across an FP4 rounding boundary (rare: at most 2% of the bytes);
    with fake quantisation they are exactly the codes of the dequantized plain ones (the kernel's own logic)."""
    g = gen(seed)
    v = (torch.randn(G * m, C, generator=g) * 2).to(dtype)
    z = (torch.randn(G * m, C, generator=g)).to(dtype) if m > 1 else None
    w = (1 + 0.1 * torch.randn(C, generator=g)) if kv else None
    ids = torch.randint(0, 3000, (G,), generator=g)
    N = 2 * G + 1
    rows = torch.randperm(N, generator=g)[:G]
    R = 16 if kv else 0
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731

    def store():
        codes, scales = lowbit.quantize(torch.zeros(N, C), fmt)
        return codes.to(DEV), scales.to(DEV)

    plain, fake, ref = store(), store(), tuple(t.cpu() for t in store())
    inv = tcf.inv_freq(R, 10000.0, DEV) if R else None
    tcc.compress_write(dev(v), dev(z), m, dev(w), 1e-6, dev(ids), inv, fmt, False, plain, dev(rows))
    tcc.compress_write(dev(v), dev(z), m, dev(w), 1e-6, dev(ids), inv, fmt, True, fake, dev(rows))
    ReferenceOps("cpu").ced_compress_write(v, z, m, w, 1e-6, ids, R, 10000.0, fmt, False, ref, rows)
    back = lowbit.dequantize(plain[0].cpu()[rows], plain[1].cpu()[rows], fmt, dtype=dtype)
    want = lowbit.quantize(back, fmt)
    assert torch.equal(fake[0].cpu()[rows], want[0]) and torch.equal(fake[1].cpu()[rows], want[1])
    differ = int((plain[0].cpu() != ref[0]).sum()) + int((plain[1].cpu() != ref[1]).sum())
    assert differ <= max(1, 0.02 * (ref[0].numel() + ref[1].numel()))
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[rows] = False
    assert not plain[0].cpu()[untouched].any()  # only the rows asked for are written


# ------------------------------------------------------------------------------------------------ on a GPU
@gpu
def test_gpu_glue_kernels_at_bench_shapes_replay_in_a_graph():
    """The CED bench config's shapes (d 2048, D 512, 32 experts top-4, index dh 128, pool 256 blocks of 8),
    batch 16 in bf16: every op captured in one CUDA graph (no host sync) and replayed on new inputs equals the
    reference op, within the tolerances above."""
    ops, ref = NvidiaOps(DEV), ReferenceOps(DEV)
    g = gen(11)
    T, d, D, E, J = 16, 2048, 512, 32, 4000
    x = torch.randn(T, d, generator=g).bfloat16().to(DEV)
    gate, bias = (torch.randn(E, d, generator=g) / 45).to(DEV), (torch.randn(E, generator=g) * 0.1).to(DEV)
    y = torch.randn(T, D, generator=g).bfloat16().to(DEV)
    wn = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV)
    pos = torch.randint(0, 60000, (T,), generator=g).to(DEV)
    slots = torch.arange(T, device=DEV)
    scores = torch.randn(T, J, generator=g).to(DEV)
    nvis = torch.randint(0, J + 1, (T,), generator=g).to(DEV)
    v, z = (torch.randn(2 * T, D, generator=g).bfloat16().to(DEV) for _ in range(2))
    ids = torch.arange(T, device=DEV) * 7

    def fresh_stores():
        ring = lowbit.quantize(torch.zeros(T + 1, 140, D, device=DEV), "fp8_e4m3_pow2")
        return ring, lowbit.quantize(torch.zeros(T * 8, D, device=DEV), "fp4_e2m1_e4m3")

    ring, kv = fresh_stores()

    def step(o):
        return (o.ced_moe_route(x, gate, 4, bias=bias, scaling=1.5), o.ced_swa_kv(
            y, wn, 1e-6, pos, 64, 10000.0, "fp8_e4m3_pow2", True, ring, slots),
            o.ced_pool_candidates(scores, nvis, 8, 256), o.ced_add_rms_norm(y, y, wn, 1e-6, y),
            o.ced_swiglu(torch.cat([y, y], 1), 10.0),
            o.ced_compress_write(v, z, 2, wn, 1e-6, ids, 64, 10000.0, "fp4_e2m1_e4m3", True, kv, ids))

    graph, out = no_host_sync(lambda: capture_graph(lambda: step(ops)))
    for t in (x, y, scores, v):  # new inputs, then a replay
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype).to(DEV))
    graph.replay()
    got_ring, got_kv = tuple(t.clone() for t in ring), tuple(t.clone() for t in kv)
    ring, kv = fresh_stores()
    want = step(ref)
    (w, i), kv_out, pool, (h, n), act, _ = out
    (rw, ri), rkv, rpool, (rh, rn), ract, _ = want
    choice = torch.sqrt(torch.nn.functional.softplus(torch.nn.functional.linear(x.float(), gate))) + bias
    same = (i.sort(1).values == ri.sort(1).values).all(1)  # else a near-tie: the chosen scores agree
    assert torch.allclose(choice.gather(1, i).sort(1).values, choice.gather(1, ri).sort(1).values, atol=1e-5)
    assert torch.allclose(w[same], rw[same], rtol=1e-5, atol=1e-6)
    assert (kv_out.float() - rkv.float()).abs().max() <= 0.07 * rkv.float().abs().max()
    assert torch.equal(pool, rpool) and torch.equal(h, rh)
    assert (n.float() - rn.float()).abs().max() <= 2 ** -6 * rn.float().abs().max()
    assert (act.float() - ract.float()).abs().max() <= 2 ** -6 * ract.float().abs().max()
    for a, b in zip(got_kv, kv):
        assert (a != b).float().mean() <= 0.02
    for a, b in zip(got_ring, ring):
        assert (a != b).float().mean() <= 0.02


_ROUTE_COMPILE = r'''
import json
from deepinfer.backends.nvidia import triton_ced_route as tcr
from deepinfer.testing.kernels import compile_sm90, sass_row

sig = dict(logits_ptr="*fp32", gate_ptr="*fp32", bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64", stride_l="i32",
           stride_g="i32", stride_w="i32", stride_i="i32", E="i32", DIN="i32", scaling="fp32", T="i32")
k = compile_sm90(tcr._route_kernel, sig,
                 dict(K=4, BLOCK_E=32, BLOCK_K=4, HAS_BIAS=True, RENORM=True, FROM_HIDDEN=False, BLOCK_D=16, DIN_I=0,
                      ROWS=tcr.ROWS), ("stride_l", "E", "T"), num_warps=4)
print(json.dumps(sass_row(k, r"\b(STL|LDL)\b", smem=k.metadata.shared)))
'''


def test_route_rows_a_program_compiles_for_hopper():
    """The several-tokens launch (ROWS, the bench router's 32 experts, top-4) builds for sm_90 without spills."""
    row = run_compile_script(_ROUTE_COMPILE)
    assert row["smem"] <= 227 * 1024, row
    assert row.get("sass", {}).get("STL", 0) == 0, row
