"""The pair-wise Triton MoE for a few tokens (nvidia/triton_moe_pairs.py) against the reference experts, with the
bounds of tests/test_triton_moe.py (float32 against experts_dense < 1e-5; bf16 / fp16 against experts_routed
< 1e-2 and no worse than it against the float32 oracle), and beside fused_experts, which it stands in for at few
tokens. Float32 against the dense oracle, out-of-range ids, strided inputs and FP8 weights: tests/test_triton_moe.py
runs its tests of those on both (EXPERTS). Without CUDA through Triton's interpreter on tiny shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import (DEV, capture_graph, examples, gen, gpu, no_host_sync, rel_err,
                                       skip_module_without_kernels)

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_moe, triton_moe_pairs as tmp  # noqa: E402
from deepinfer.backends.reference import moe as ref_moe  # noqa: E402
from test_triton_moe import make_case  # noqa: E402

FAST = examples(12)
dims = dict(d=st.sampled_from([24, 48, 72]), F=st.sampled_from([20, 48, 52]))  # masked and whole tiles


@FAST
@given(T=st.integers(1, 8), E=st.integers(1, 10), k=st.integers(1, 4), **dims, clamp=st.sampled_from([None, 0.7]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_low_precision_matches_routed_and_the_fused_kernel(T, E, k, d, F, clamp, dtype, seed):
    k = min(k, E)
    x, w13, w2, weights, ids = make_case(gen(seed), T, E, k, d, F, dtype)
    out = tmp.pair_experts(x, w13, w2, weights, ids, clamp=clamp)
    assert out.dtype == dtype
    routed = ref_moe.experts_routed(x, w13, w2, weights, ids, clamp=clamp)
    assert rel_err(out, routed) < 1e-2
    oracle = ref_moe.experts_dense(x.float(), w13.float(), w2.float(), weights, ids, clamp=clamp)
    assert rel_err(out, oracle) < 2 * rel_err(routed, oracle) + 2e-3
    # the same roundings as fused_experts (activation, each pair's weighted output): a few units of x's dtype
    assert rel_err(out, triton_moe.fused_experts(x, w13, w2, weights, ids, clamp=clamp)) < 1e-2


def shared_oracle(x, sw13, sw2, clamp):
    """The shared expert written out in float64 from its definition (no kernel, no reference op): SwiGLU of the
    gate and up halves, clamped as DeepSeek-V4, then the down projection."""
    gu = x.double() @ sw13.double().T
    g, u = gu[:, :gu.shape[1] // 2], gu[:, gu.shape[1] // 2:]
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return (g * torch.sigmoid(g) * u) @ sw2.double().T


def shared_case(g, F, slices, d, dtype):
    Fs = F * slices
    return ((torch.randn(2 * Fs, d, generator=g) * d ** -0.5).to(DEV, dtype),
            (torch.randn(d, Fs, generator=g) * Fs ** -0.5).to(DEV, dtype))


@FAST
@given(T=st.integers(1, 4), E=st.integers(1, 8), k=st.integers(1, 3), **dims, slices=st.sampled_from([1, 2, 3]),
       clamp=st.sampled_from([None, 0.7]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_the_shared_expert_rides_on_the_pairs(T, E, k, d, F, slices, clamp, dtype, seed):
    """pair_experts(shared=...) = the routed experts + the shared expert (Fs = slices x F): float32 within 1e-5 of
    a float64 oracle (experts_dense + shared_oracle); bf16 no worse against it than the unfused pieces are (the
    pair kernel alone plus the shared expert by torch in bf16, rounded where ced_swiglu rounds), within 1e-2 of
    them, and rounded as they are: bit-equal but where a float32 sum's order flips a last bit (all equal under the
    interpreter; with one rounding more or less, as the kernel had first, 20-50% were)."""
    k = min(k, E)
    g = gen(seed)
    x, w13, w2, weights, ids = make_case(g, T, E, k, d, F, dtype)
    sw13, sw2 = shared_case(g, F, slices, d, dtype)
    assert tmp.supports(x, w13, w2, weights, ids, shared=(sw13, sw2))
    out = tmp.pair_experts(x, w13, w2, weights, ids, clamp=clamp, shared=(sw13, sw2))
    assert out.dtype == dtype and out.shape == x.shape
    oracle = ref_moe.experts_dense(x.double(), w13.double(), w2.double(), weights.double(), ids, clamp=clamp) \
        + shared_oracle(x, sw13, sw2, clamp)
    if dtype == torch.float32:
        assert rel_err(out, oracle) < 1e-5
        return
    routed = tmp.pair_experts(x, w13, w2, weights, ids, clamp=clamp)
    gu = torch.nn.functional.linear(x, sw13)
    gate, up = gu.float().chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    silu = torch.nn.functional.silu(gate).to(dtype).float()  # ced_swiglu rounds silu, then its product
    apart = routed + torch.nn.functional.linear((silu * up).to(dtype), sw2)
    assert rel_err(out, apart) < 1e-2
    assert (out == apart).float().mean() >= 0.9
    assert rel_err(out, oracle) < 2 * rel_err(apart, oracle) + 2e-3


def test_a_shared_expert_it_cannot_take_is_refused():
    g = gen(5)
    x, w13, w2, weights, ids = make_case(g, 2, 4, 2, 24, 20, torch.bfloat16)
    sw13, sw2 = shared_case(g, 20, 2, 24, torch.bfloat16)
    assert tmp.supports(x, w13, w2, weights, ids, shared=(sw13, sw2))
    odd13, odd2 = shared_case(g, 10, 3, 24, torch.bfloat16)  # Fs = 30: not a multiple of F = 20
    assert not tmp.supports(x, w13, w2, weights, ids, shared=(odd13, odd2))
    assert not tmp.supports(x, w13, w2, weights, ids, shared=(sw13.float(), sw2.float()))  # not x's dtype
    assert not tmp.supports(x, w13, w2, weights, ids, shared=(sw13, sw2[:, :20]))  # sw2 not [d, Fs]
    many = tmp.MAX_PAIRS // 2  # k = 2 routed pairs a token are within MAX_PAIRS, with 2 shared slices more are not
    xs, ws, ids_ = x[:1].repeat(many, 1), weights[:1].repeat(many, 1), ids[:1].repeat(many, 1)
    assert tmp.supports(xs, w13, w2, ws, ids_) and not tmp.supports(xs, w13, w2, ws, ids_, shared=(sw13, sw2))
    with pytest.raises(ValueError, match="shared expert"):
        tmp.pair_experts(x, w13, w2, weights, ids, shared=(odd13, odd2))


def test_too_many_pairs_or_mixed_weights_are_refused():
    x, w13, w2, weights, ids = make_case(gen(4), 2, 3, 2, 24, 20)
    with pytest.raises(ValueError, match="unsupported"):
        tmp.pair_experts(x.bfloat16(), w13, w2, weights, ids)  # float32 weights, bf16 activations
    big = ids.repeat(tmp.MAX_PAIRS, 1)
    assert not tmp.supports(x.repeat(tmp.MAX_PAIRS, 1), w13, w2, weights.repeat(tmp.MAX_PAIRS, 1), big)


@gpu
@pytest.mark.parametrize("T,shared", [(1, False), (16, False), (1, True), (4, True)])
def test_gpu_ced_bench_shape_in_a_graph_with_new_routing(T, shared):
    """The CED bench config's MoE (E 32, k 4, d 2048, F 512; its shared expert Fs 512), bf16: no host sync,
    captured once and replayed with new tokens and routings, each replay against experts_routed (plus the shared
    expert by torch) and the fused kernel."""
    E, k, d, F = 32, 4, 2048, 512
    g = gen(20)
    w13 = (torch.randn(E, 2 * F, d, generator=g) * d ** -0.5).to(DEV, torch.bfloat16)
    w2 = (torch.randn(E, d, F, generator=g) * F ** -0.5).to(DEV, torch.bfloat16)
    sw = shared_case(g, F, 1, d, torch.bfloat16) if shared else None

    def tokens():
        weights, ids = ref_moe.route(torch.randn(T, E, generator=g), k)
        return torch.randn(T, d, generator=g).to(DEV, torch.bfloat16), weights.to(DEV), ids.to(DEV)

    def plus_shared(x):
        return 0 if sw is None else shared_oracle(x, *sw, 10.0).to(torch.bfloat16)

    x, weights, ids = tokens()
    static = dict(x=x, weights=weights, ids=ids)

    def run():
        return tmp.pair_experts(static["x"], w13, w2, static["weights"], static["ids"], clamp=10.0, shared=sw)

    graph, out = capture_graph(run, warmup=lambda: (run(), no_host_sync(run)))
    for _ in range(3):
        nx, nw, ni = tokens()
        static["x"].copy_(nx)
        static["weights"].copy_(nw)
        static["ids"].copy_(ni)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref_moe.experts_routed(nx, w13, w2, nw, ni, clamp=10.0) + plus_shared(nx)) < 1e-2
        assert rel_err(out, triton_moe.fused_experts(nx, w13, w2, nw, ni, clamp=10.0) + plus_shared(nx)) < 1e-2


@pytest.mark.parametrize("invariant", [False, True])
def test_the_backend_takes_the_pair_kernel_up_to_moe_pairs_max(invariant, monkeypatch):
    """NvidiaOps.moe_experts runs pair_experts up to MOE_PAIRS_MAX (token, expert) pairs and fused_experts past it,
    never in batch-invariant mode; either way the reference's function (experts_dense, float32)."""
    from deepinfer.backends.nvidia import ops as nv

    monkeypatch.setattr(nv, "MOE_PAIRS_MAX", 8)
    backend = nv.NvidiaOps(DEV)
    backend.batch_invariant = invariant  # (as backends/batch_invariant.py sets it)
    for T, want in ((1, "moe_pairs"), (2, "moe_pairs"), (3, "fused_moe")):  # k = 4: 4, 8, 12 pairs
        x, w13, w2, weights, ids = make_case(gen(T), T, 6, 4, 24, 20)
        before = dict(backend.kernel_calls)
        out = backend.moe_experts(x, w13, w2, weights, ids, clamp=0.7)
        ran = {n for n, c in backend.kernel_calls.items() if c != before.get(n, 0)}
        assert ran == ({"fused_moe"} if invariant else {want}), (T, ran)
        assert rel_err(out, ref_moe.experts_dense(x, w13, w2, weights, ids, clamp=0.7)) < 1e-5


@pytest.mark.parametrize("invariant", [False, True])
def test_the_backend_fuses_the_shared_expert_where_it_takes_the_pairs(invariant, monkeypatch):
    """NvidiaOps.moe_experts_shared: None while MOE_SHARED_ON_PAIRS is off; on (as shipped), the pair kernels with
    the shared expert up to MOE_PAIRS_MAX routed pairs, None past them, in batch-invariant mode and under autograd
    (the caller then runs the two apart); its result is the float64 oracle's function."""
    from deepinfer.backends.nvidia import ops as nv
    from deepinfer.backends.reference.ops import ReferenceOps

    monkeypatch.setattr(nv, "MOE_PAIRS_MAX", 8)
    backend = nv.NvidiaOps(DEV)
    backend.batch_invariant = invariant
    assert ReferenceOps(DEV).moe_experts_shared(*make_case(gen(0), 1, 6, 4, 24, 20), None, None) is None
    case = make_case(gen(0), 1, 6, 4, 24, 20)
    monkeypatch.setattr(nv, "MOE_SHARED_ON_PAIRS", False)  # the switch off: never
    assert backend.moe_experts_shared(*case, *shared_case(gen(0), 20, 1, 24, torch.float32)) is None
    monkeypatch.setattr(nv, "MOE_SHARED_ON_PAIRS", True)
    for T in (1, 2, 3):  # k = 4: 4, 8, 12 routed pairs
        g = gen(T)
        x, w13, w2, weights, ids = make_case(g, T, 6, 4, 24, 20)
        sw13, sw2 = shared_case(g, 20, 1, 24, torch.float32)
        out = backend.moe_experts_shared(x, w13, w2, weights, ids, sw13, sw2, clamp=0.7)
        if invariant or T == 3:
            assert out is None
            continue
        oracle = ref_moe.experts_dense(x.double(), w13.double(), w2.double(), weights.double(), ids, clamp=0.7) \
            + shared_oracle(x, sw13, sw2, 0.7)
        assert out is not None and rel_err(out, oracle) < 1e-5
        assert backend.moe_experts_shared(x.requires_grad_(), w13, w2, weights, ids, sw13, sw2) is None


@pytest.mark.parametrize("on", [False, True])
def test_the_ced_layer_takes_the_shared_expert_on_the_pairs_where_the_backend_does(on, monkeypatch):
    """CEDLayer.moe_parts through NvidiaOps: with MOE_SHARED_ON_PAIRS the sum comes back as one tensor (shared None),
    without it the two apart; either way the reference module's function (test_moe_fp8.old_ced_moe, float32), the
    same chosen experts."""
    from deepinfer.backends.nvidia import ops as nv
    from test_moe_fp8 import draw_ced, old_ced_moe

    monkeypatch.setattr(nv, "MOE_SHARED_ON_PAIRS", on)
    model = draw_ced(4, 2, 1, 1.5, 0.5, 3, nv.NvidiaOps(DEV)).to(DEV)
    layer = model.layers[1]
    x = torch.randn(3, 32, generator=gen(4)).to(DEV)
    with torch.no_grad():
        routed, shared, ids = layer.moe_parts(x)
        want, want_ids = old_ced_moe(layer, x)
    assert (shared is None) == on and torch.equal(ids, want_ids)
    assert model.ops.kernel_calls["moe_pairs_shared"] == (1 if on else 0)
    assert rel_err(routed if shared is None else routed + shared, want) < 1e-5


@pytest.mark.parametrize("fp8_max,want", [(0, "fused_moe"), (8, "moe_pairs")])
def test_fp8_weights_take_the_pair_kernel_only_up_to_their_own_limit(fp8_max, want, monkeypatch):
    """FP8 block-scaled weights follow MOE_PAIRS_MAX_FP8 (0 by the H200 bench: slower at one or two tokens), not
    MOE_PAIRS_MAX; the output is the dequantised weights' function either way."""
    from deepinfer.backends.nvidia import ops as nv
    from deepinfer.testing.kernels import fp8_weights

    monkeypatch.setattr(nv, "MOE_PAIRS_MAX", 64)
    monkeypatch.setattr(nv, "MOE_PAIRS_MAX_FP8", fp8_max)
    backend = nv.NvidiaOps(DEV)
    g = gen(11)
    E, d, F, k = 4, 256, 128, 2
    q13, s13, dq13 = fp8_weights(g, E, 2 * F, d, DEV)
    q2, s2, dq2 = fp8_weights(g, E, d, F, DEV)
    x = torch.randn(1, d, generator=g).to(DEV, torch.bfloat16)
    weights, ids = ref_moe.route(torch.randn(1, E, generator=g), k)
    weights, ids = weights.to(DEV), ids.to(DEV)
    before = dict(backend.kernel_calls)
    out = backend.moe_experts(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    ran = {n for n, c in backend.kernel_calls.items() if c != before.get(n, 0)}
    assert ran == {want}
    assert rel_err(out, ref_moe.experts_dense(x.float(), dq13, dq2, weights, ids)) < 1e-2
