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


def test_too_many_pairs_or_mixed_weights_are_refused():
    x, w13, w2, weights, ids = make_case(gen(4), 2, 3, 2, 24, 20)
    with pytest.raises(ValueError, match="unsupported"):
        tmp.pair_experts(x.bfloat16(), w13, w2, weights, ids)  # float32 weights, bf16 activations
    big = ids.repeat(tmp.MAX_PAIRS, 1)
    assert not tmp.supports(x.repeat(tmp.MAX_PAIRS, 1), w13, w2, weights.repeat(tmp.MAX_PAIRS, 1), big)


@gpu
@pytest.mark.parametrize("T", [1, 16])
def test_gpu_ced_bench_shape_in_a_graph_with_new_routing(T):
    """The CED bench config's MoE (E 32, k 4, d 2048, F 512), bf16: no host sync, captured once and replayed
    with new tokens and routings, each replay against experts_routed and the fused kernel."""
    E, k, d, F = 32, 4, 2048, 512
    g = gen(20)
    w13 = (torch.randn(E, 2 * F, d, generator=g) * d ** -0.5).to(DEV, torch.bfloat16)
    w2 = (torch.randn(E, d, F, generator=g) * F ** -0.5).to(DEV, torch.bfloat16)

    def tokens():
        weights, ids = ref_moe.route(torch.randn(T, E, generator=g), k)
        return torch.randn(T, d, generator=g).to(DEV, torch.bfloat16), weights.to(DEV), ids.to(DEV)

    x, weights, ids = tokens()
    static = dict(x=x, weights=weights, ids=ids)

    def run():
        return tmp.pair_experts(static["x"], w13, w2, static["weights"], static["ids"], clamp=10.0)

    graph, out = capture_graph(run, warmup=lambda: (run(), no_host_sync(run)))
    for _ in range(3):
        nx, nw, ni = tokens()
        static["x"].copy_(nx)
        static["weights"].copy_(nw)
        static["ids"].copy_(ni)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref_moe.experts_routed(nx, w13, w2, nw, ni, clamp=10.0)) < 1e-2
        assert rel_err(out, triton_moe.fused_experts(nx, w13, w2, nw, ni, clamp=10.0)) < 1e-2


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
