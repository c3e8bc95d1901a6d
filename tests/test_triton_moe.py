"""The fused Triton MoE (nvidia/triton_moe.py) against the reference experts (reference/moe.py).

Without CUDA the kernels run through Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py before any kernel
module is imported) on tiny shapes; with CUDA the same property tests run compiled kernels and the GPU-only
tests add Qwen3-30B-A3B / DeepSeek-V3 shapes and CUDA-graph capture.

Error bounds: float32 against experts_dense by ||out - ref|| / ||ref|| < 1e-5; bf16 against experts_routed
(which also rounds its matmuls to bf16) < 1e-2; FP8 weights against experts_dense on the weights that
models.quant dequantizes at load. Intermediate buffers start on NaN-poisoned memory, so any row the
kernels leave unwritten shows up.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import (DEV, assert_same_bits, capture_graph, examples, fp8_weights, gen, gpu,
                                       no_host_sync, poison_free_memory, rel_err, run_compile_script,
                                       skip_module_without_kernels)

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_moe, triton_moe_pairs  # noqa: E402
from deepinfer.backends.nvidia.ops import NvidiaOps  # noqa: E402
from deepinfer.backends.reference import moe as ref_moe  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402
from deepinfer.models.quant import FP8, dequantize_fp8_block  # noqa: E402

FAST = examples(12)
# the properties every implementation of fused_experts' contract keeps (triton_moe_pairs: a few tokens, no sort)
EXPERTS = {"fused": triton_moe.fused_experts, "pairs": triton_moe_pairs.pair_experts}


def make_case(g, T, E, k, d, F, dtype=torch.float32, one_expert=None):
    """Random x, w13, w2 scaled to O(1) outputs, and softmax top-k routing (or every token to one expert)."""
    x = torch.randn(T, d, generator=g)
    w13 = torch.randn(E, 2 * F, d, generator=g) * d ** -0.5
    w2 = torch.randn(E, d, F, generator=g) * F ** -0.5
    weights, ids = ref_moe.route(torch.randn(T, E, generator=g), k)
    if one_expert is not None:
        ids = torch.full_like(ids, one_expert)
    return [t.to(DEV) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


# ------------------------------------------------------------------------------------------- alignment
@FAST
@given(T=st.integers(0, 40), E=st.integers(1, 10), k=st.integers(1, 4), block_m=st.sampled_from([16, 32]),
       bad=st.booleans(), seed=st.integers(0, 2**16))
def test_align_pairs_is_a_padded_stable_sort(T, E, k, block_m, bad, seed):
    g = gen(seed)
    ids = torch.randint(0, E, (T, k), generator=g)
    if bad and ids.numel():
        ids.view(-1)[torch.randint(0, ids.numel(), (3,), generator=g)] = torch.tensor([-1, E, 2**40])
    sorted_ids, starts, counts = (t.cpu().long() for t in triton_moe.align_pairs(ids.to(DEV), E, block_m))
    flat = ids.reshape(-1)
    bucket = torch.where((flat < 0) | (flat >= E), E, flat)
    want_counts = torch.bincount(bucket, minlength=E + 1)
    assert torch.equal(counts, want_counts)
    padded = (want_counts + block_m - 1) // block_m * block_m
    assert torch.equal(starts, torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)]))
    assert int(starts[-1]) <= sorted_ids.numel() == triton_moe.max_rows(flat.numel(), E, block_m)
    for b in range(E + 1):
        seg = sorted_ids[starts[b]:starts[b] + counts[b]]
        assert torch.equal(seg, torch.nonzero(bucket == b).flatten()), f"bucket {b}"


# ------------------------------------------------------------------------------------------- fused experts
dims = dict(d=st.sampled_from([24, 48, 72]), F=st.sampled_from([20, 48, 52]))  # masked and whole 16-wide tiles


@pytest.mark.parametrize("impl", sorted(EXPERTS))
@FAST
@given(T=st.integers(0, 40), E=st.integers(1, 10), k=st.integers(1, 4), **dims, clamp=st.sampled_from([None, 0.7]),
       block_m=st.sampled_from([None, 16, 32]), seed=st.integers(0, 2**16))
def test_float32_matches_dense_oracle(impl, T, E, k, d, F, clamp, block_m, seed):
    if impl == "pairs":  # a program per pair, so T only sizes the grid; up to 16 it still crosses the block
        T %= 17  # halving point (16 programs under the interpreter) both ways, at a third of the time of 40
    k = min(k, E)
    x, w13, w2, weights, ids = make_case(gen(seed), T, E, k, d, F)
    poison_free_memory((T * k + 64) * (d + F) * 4)
    kw = {"block_m": block_m} if impl == "fused" else {}  # (the pair kernel has no M blocks)
    out = EXPERTS[impl](x, w13, w2, weights, ids, clamp=clamp, **kw)
    ref = ref_moe.experts_dense(x, w13, w2, weights, ids, clamp=clamp)
    assert out.shape == (T, d) and out.dtype == torch.float32
    if T:
        assert rel_err(out, ref) < 1e-5


@FAST
@given(T=st.integers(1, 40), E=st.integers(1, 10), k=st.integers(1, 4), **dims, clamp=st.sampled_from([None, 0.7]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_low_precision_matches_routed(T, E, k, d, F, clamp, dtype, seed):
    k = min(k, E)
    x, w13, w2, weights, ids = make_case(gen(seed), T, E, k, d, F, dtype)
    poison_free_memory((T * k + 64) * (d + F) * 4)
    out = triton_moe.fused_experts(x, w13, w2, weights, ids, clamp=clamp)
    assert out.dtype == dtype
    assert rel_err(out, ref_moe.experts_routed(x, w13, w2, weights, ids, clamp=clamp)) < 1e-2
    # No worse than the reference's routed path against the float32 oracle on the same inputs.
    oracle = ref_moe.experts_dense(x.float(), w13.float(), w2.float(), weights, ids, clamp=clamp)
    routed_err = rel_err(ref_moe.experts_routed(x, w13, w2, weights, ids, clamp=clamp), oracle)
    assert rel_err(out, oracle) < 2 * routed_err + 2e-3


@examples(6)
@given(T=st.integers(1, 24), E=st.integers(1, 6), k=st.integers(1, 3),
       knobs=st.sampled_from([dict(BN1=32, BK1=32), dict(BN2=32, BK2=32, stages2=2), dict(warps1=2, warps2=2),
                              dict(BN1=16, BK1=64, BN2=64, BK2=16)]), seed=st.integers(0, 2**16))
def test_launch_overrides_keep_the_result(T, E, k, knobs, seed):
    """benchmarks/moe_launch_sweep.py's knobs change tiles, never the function: bf16 against the routed
    reference, as the default launch."""
    k = min(k, E)
    x, w13, w2, weights, ids = make_case(gen(seed), T, E, k, 40, 24, torch.bfloat16)
    out = triton_moe.fused_experts(x, w13, w2, weights, ids, clamp=0.7, launch=knobs)
    assert rel_err(out, ref_moe.experts_routed(x, w13, w2, weights, ids, clamp=0.7)) < 1e-2


def test_wide_prefill_tiles_only_where_they_were_measured_and_fit(monkeypatch):
    """launch_config's compiled-GPU choice (the interpreter's is fixed): the wide GEMM-1 tile and three GEMM-2
    stages only at 64- and 128-row M-blocks, bf16 weights, WIDE_PREFILL_TILES on and enough shared memory for four
    stages of the tile (an sm_90's 227 KB, not an A100's ~163 KB at 128 rows); FP8 weights at 128-row blocks their
    own tiles (FP8_PREFILL_TILES), at 64 rows the earlier ones; everything else keeps the earlier tiles."""
    monkeypatch.setattr(triton_moe, "INTERPRET", False)
    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(triton_moe._SMEM, 0, triton_moe.HOPPER_SHARED_MEM)
    prefill = lambda **kw: triton_moe.launch_config(65536, 32, 512, 2048, cuda, **kw)
    wide = prefill()
    assert (wide["BLOCK_M"], wide["BN1"], wide["stages2"]) == (128, 128, 3)
    assert wide["stages1"] == 4  # 4 x 48 KB: what the A100 case below cannot hold
    chunk = triton_moe.launch_config(4096 * 4, 32, 512, 2048, cuda)  # a 4K-token chunk: 512 pairs an expert
    assert (chunk["BLOCK_M"], chunk["BN1"], chunk["BK1"], chunk["warps1"], chunk["stages1"], chunk["stages2"]) == \
        (64, 128, 64, 4, 4, 3)
    old = dict(BN1=64, BK1=64, BN2=128, warps2=8, stages2=4)
    fp8 = prefill(w_bytes=1)
    assert {key: fp8[key] for key in old} == dict(old, BK1=128, BN2=64, warps2=4)
    assert (fp8["warps1"], fp8["stages1"], fp8["stages2"]) == (8, 4, 4)
    assert prefill(w_bytes=1, block_m=64)["BN1"] == 64 and prefill(w_bytes=1, block_m=64)["BK1"] == 64, \
        "FP8 weights at 64-row blocks were not swept"
    monkeypatch.setattr(triton_moe, "FP8_PREFILL_TILES", False)
    assert {key: prefill(w_bytes=1)[key] for key in old} == old
    old = dict(BN1=64, stages2=4)
    from deepinfer.backends.nvidia import triton_attention

    monkeypatch.setitem(triton_attention._SM_COUNT, 0, 132)  # the decode branch reads the SM count
    assert triton_moe.launch_config(64, 32, 512, 2048, cuda)["BLOCK_M"] == 16  # decode: untouched branch
    monkeypatch.setitem(triton_moe._SMEM, 0, 166912)  # an A100's opt-in shared memory a block
    assert {key: prefill()[key] for key in old} == old
    monkeypatch.setitem(triton_moe._SMEM, 0, triton_moe.HOPPER_SHARED_MEM)
    monkeypatch.setattr(triton_moe, "WIDE_PREFILL_TILES", False)
    assert {key: prefill()[key] for key in old} == old
    assert {key: prefill(block_m=64)[key] for key in old} == old


@examples(8)
@given(T=st.integers(1, 12), k=st.integers(1, 8), d=st.sampled_from([8, 24, 100, 1100]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), seed=st.integers(0, 2**16))
def test_k_sum_adds_each_tokens_pairs_in_order(T, k, d, dtype, seed):
    """PDL_CHAIN's k-sum kernel: token t's rows t*k .. t*k+k-1 added in that order in float32, rounded once (an
    oracle of torch adds, bit for bit; d crosses the kernel's tile both ways)."""
    g = gen(seed)
    pairs = (torch.randn(T * k, d, generator=g) * torch.logspace(-3, 3, d)).to(dtype)
    want = torch.zeros(T, d, dtype=torch.float32)
    for j in range(k):
        want = want + pairs.view(T, k, d)[:, j].float()
    out = triton_moe.k_sum(pairs.to(DEV), T, k, {})
    assert out.dtype == dtype and out.shape == (T, d)
    assert torch.equal(out.cpu(), want.to(dtype))


@examples(6)
@given(T=st.integers(1, 40), E=st.integers(1, 10), k=st.integers(1, 4), **dims,
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_pdl_chain_keeps_the_result(T, E, k, d, F, dtype, seed):
    """PDL_CHAIN changes the launches and the k-sum's kernel, not the function: against the routed reference as
    the default path (float32: against the dense oracle)."""
    k = min(k, E)
    x, w13, w2, weights, ids = make_case(gen(seed), T, E, k, d, F, dtype)
    poison_free_memory((T * k + 64) * (d + F) * 4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_moe, "PDL_CHAIN", True)
        out = triton_moe.fused_experts(x, w13, w2, weights, ids, clamp=0.7)
    assert out.dtype == dtype and out.shape == (T, d)
    if dtype == torch.float32:
        assert rel_err(out, ref_moe.experts_dense(x, w13, w2, weights, ids, clamp=0.7)) < 1e-5
    else:
        assert rel_err(out, ref_moe.experts_routed(x, w13, w2, weights, ids, clamp=0.7)) < 1e-2


def test_idle_experts_and_all_tokens_to_one_expert():
    g = gen(1)
    x, w13, w2, weights, ids = make_case(g, 0, 3, 2, 24, 20)  # no tokens
    assert triton_moe.fused_experts(x, w13, w2, weights, ids).shape == (0, 24)
    # E = 9 experts, only 2 used: every other segment is empty.
    x, w13, w2, weights, ids = make_case(g, 20, 9, 2, 40, 36)
    ids = torch.where(torch.arange(20, device=DEV)[:, None] % 2 == 0, torch.tensor([3, 7], device=DEV),
                      torch.tensor([7, 3], device=DEV))
    out = triton_moe.fused_experts(x, w13, w2, weights, ids)
    assert rel_err(out, ref_moe.experts_dense(x, w13, w2, weights, ids)) < 1e-5
    # Every token to the last expert, 37 tokens (several M-blocks of one expert), k = 1 and k = 3.
    for k in (1, 3):
        x, w13, w2, weights, ids = make_case(g, 37, 6, k, 24, 20, one_expert=5)
        out = triton_moe.fused_experts(x, w13, w2, weights, ids, block_m=16)
        assert rel_err(out, ref_moe.experts_dense(x, w13, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("impl", sorted(EXPERTS))
def test_out_of_range_ids_contribute_zero(impl):
    """The router's bug, not checked (a host sync): such a pair adds nothing; the others are unaffected."""
    x, w13, w2, weights, ids = make_case(gen(2), 7, 4, 2, 24, 20)
    bad = ids.clone()
    bad[1, 0], bad[4, 1] = -1, 4
    out = EXPERTS[impl](x, w13, w2, weights, bad)
    keep = weights.clone()
    keep[1, 0] = keep[4, 1] = 0.0
    assert rel_err(out, ref_moe.experts_dense(x, w13, w2, keep, ids.clamp(0, 3))) < 1e-5
    with pytest.raises(ValueError, match="ids must lie"):  # the reference path does check
        NvidiaOps(DEV).moe_experts(x, w13, w2, weights, bad, impl="dense")


@pytest.mark.parametrize("impl", sorted(EXPERTS))
def test_strided_inputs_and_int32_ids(impl):
    x, w13, w2, weights, ids = make_case(gen(3), 11, 5, 2, 40, 20)
    xs = torch.cat([x, x], dim=1)[:, ::2]  # column stride 2
    w13t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2F, d] with a unit row stride
    out = EXPERTS[impl](xs, w13t, w2, weights.t().contiguous().t(), ids.int())
    assert rel_err(out, ref_moe.experts_dense(xs, w13t, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("impl", sorted(EXPERTS))
@examples(3)
@given(T=st.integers(1, 12), E=st.integers(1, 3), d=st.sampled_from([136, 160]), F=st.sampled_from([72, 136]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_fp8_block_scaled_matches_dequantized_oracle(impl, T, E, d, F, dtype, seed):
    g = gen(seed)
    k = min(2, E)
    x, _, _, weights, ids = make_case(g, T, E, k, 8, 8)
    x = torch.randn(T, d, generator=g).to(DEV, dtype)
    q13, s13, w13 = fp8_weights(g, E, 2 * F, d)
    q2, s2, w2 = fp8_weights(g, E, d, F)
    out = EXPERTS[impl](x, q13, q2, weights, ids, clamp=5.0, w13_scale=s13, w2_scale=s2)
    ref = ref_moe.experts_dense(x.float(), w13, w2, weights, ids, clamp=5.0)
    assert out.dtype == dtype
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_bad_inputs_raise_value_errors_naming_the_argument():
    x, w13, w2, weights, ids = make_case(gen(4), 3, 2, 1, 24, 20)
    cases = [
        (dict(x=x[None]), "x must be"),
        (dict(w13=w13[:, :-1]), "w13 must be"),
        (dict(w2=w2[:, :, :-1]), "w2 must be"),
        (dict(ids=ids.float()), "ids must be an integer"),
        (dict(weights=weights[:, :0]), "weights must match"),
        (dict(clamp=-1.0), "clamp must be"),
        (dict(w13=w13.double(), w2=w2.double(), x=x.double()), "x must be one of"),
        (dict(w13=w13.half()), "w13/w2 must have x's dtype"),
        (dict(w13=w13.to(FP8)), "both be float8_e4m3fn"),
        (dict(w13=w13.to(FP8), w2=w2.to(FP8)), "need w13_scale"),
        (dict(w13_scale=torch.ones(2, 1, 1, device=DEV)), "must be given together"),
        (dict(w13_scale=torch.ones(2, 1, 1, device=DEV), w2_scale=torch.ones(2, 1, 1, device=DEV)),
         "for float8_e4m3fn weights"),
        (dict(w13=w13.to(FP8), w2=w2.to(FP8), w13_scale=torch.ones(2, 2, 1, device=DEV),
              w2_scale=torch.ones(2, 1, 1, device=DEV)), r"w13_scale must have shape \(2, 1, 1\)"),
        (dict(w13=w13.to(FP8), w2=w2.to(FP8), w13_scale=torch.ones(2, 1, 1, device=DEV),
              w2_scale=torch.ones(2, 1, 1, device=DEV, dtype=torch.float64)), "w2_scale must be float32"),
        (dict(block_m=24), "block_m must be"),
        (dict(launch=dict(BN3=16)), r"launch: unknown keys \['BN3'\]"),
        (dict(launch=dict(BN1=48)), r"launch: BN1 must be a power of two in \[16, 256\], got 48"),
        (dict(launch=dict(BK2=0)), r"launch: BK2 must be a power of two"),
        (dict(launch=dict(warps1=3)), r"launch: warps1 must be a power of two in \[1, 16\]"),
        (dict(launch=dict(stages2=0)), r"launch: stages2 must be an int in \[1, 8\], got 0"),
        (dict(launch=dict(BN2=64.0)), r"launch: BN2 must be a power of two"),
        (dict(launch=dict(stages1=True)), r"launch: stages1 must be an int"),
        (dict(w13=w13.to(FP8), w2=w2.to(FP8), w13_scale=torch.ones(2, 1, 1, device=DEV),
              w2_scale=torch.ones(2, 1, 1, device=DEV), launch=dict(BK1=256)), "FP8 weights need BK1 and BK2"),
    ]
    base = dict(x=x, w13=w13, w2=w2, weights=weights, ids=ids)
    for change, msg in cases:
        kw = {**base, **change}
        args = [kw.pop(n) for n in ("x", "w13", "w2", "weights", "ids")]
        with pytest.raises(ValueError, match=msg):
            triton_moe.fused_experts(*args, **kw)


def test_ops_dispatch_counts_and_falls_back():
    ops = NvidiaOps(DEV)
    x, w13, w2, weights, ids = make_case(gen(5), 9, 4, 2, 24, 20)
    out = ops.moe_experts(x, w13, w2, weights, ids, clamp=0.5)
    assert ops.kernel_calls["fused_moe"] == 1
    assert rel_err(out, ref_moe.experts_dense(x, w13, w2, weights, ids, clamp=0.5)) < 1e-5
    # impl="dense" and unsupported dtypes run the reference op, and count no kernel call.
    torch.testing.assert_close(ops.moe_experts(x, w13, w2, weights, ids, impl="dense"),
                               ref_moe.experts_dense(x, w13, w2, weights, ids))
    x64, w13_64, w2_64 = x.double(), w13.double(), w2.double()
    torch.testing.assert_close(ops.moe_experts(x64, w13_64, w2_64, weights, ids),
                               ref_moe.experts_routed(x64, w13_64, w2_64, weights, ids))
    assert ops.kernel_calls["fused_moe"] == 1
    with pytest.raises(ValueError, match="impl must be"):
        ops.moe_experts(x, w13, w2, weights, ids, impl="sparse")


@examples(4)
@given(T=st.integers(1, 12), E=st.integers(1, 4), k=st.integers(1, 2), d=st.sampled_from([48, 136]),
       F=st.sampled_from([40, 136]), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       impl=st.sampled_from(["routed", "dense"]), seed=st.integers(0, 2**16))
def test_ops_fp8_experts_match_the_reference_op(T, E, k, d, F, dtype, impl, seed):
    """Ops.moe_experts with FP8 weights and block scales: NvidiaOps runs the kernel ("routed"; "dense" falls back
    to the reference), the reference op dequantizes; both give the experts of the dequantized weights."""
    g = gen(seed)
    k = min(k, E)
    _, _, _, weights, ids = make_case(g, T, E, k, 8, 8)
    x = torch.randn(T, d, generator=g).to(DEV, dtype)
    q13, s13, _ = fp8_weights(g, E, 2 * F, d)
    q2, s2, _ = fp8_weights(g, E, d, F)
    ops = NvidiaOps(DEV)
    kw = dict(clamp=3.0, impl=impl, w13_scale=s13, w2_scale=s2)
    out = ops.moe_experts(x, q13, q2, weights, ids, **kw)
    ref = ReferenceOps(DEV).moe_experts(x, q13, q2, weights, ids, **kw)
    assert ops.kernel_calls["fused_moe"] == (impl == "routed")
    assert out.dtype == dtype and rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_moe_experts_pairs_is_the_fused_kernel_before_its_k_sum(monkeypatch):
    """NvidiaOps.moe_experts_pairs: where moe_experts takes the fused kernel with its k-sum kernel, a PairSum whose
    value is moe_experts' result bit for bit; None where moe_experts would take the pair kernels or the reference,
    with PDL_CHAIN or MOE_KSUM_IN_NORM off, or in batch-invariant mode."""
    from deepinfer.backends.nvidia import ops as nv
    from deepinfer.pair_sum import PairSum

    monkeypatch.setattr(triton_moe, "PDL_CHAIN", True)
    x, w13, w2, weights, ids = make_case(gen(8), 9, 4, 2, 24, 20)
    ops = NvidiaOps(DEV)
    got = ops.moe_experts_pairs(x, w13, w2, weights, ids, clamp=0.5)
    assert isinstance(got, PairSum) and got.k == 2 and got.pairs.shape == (18, 24)
    assert ops.kernel_calls["fused_moe"] == 1
    assert_same_bits(got.value(), ops.moe_experts(x, w13, w2, weights, ids, clamp=0.5))
    few = [t[:2] for t in (x, weights, ids)]  # 4 pairs: the pair kernels
    assert nv.MOE_PAIRS_MAX >= 4 and ops.moe_experts_pairs(few[0], w13, w2, few[1], few[2]) is None
    assert ops.moe_experts_pairs(x.double(), w13.double(), w2.double(), weights, ids) is None  # the reference
    for module, knob in ((triton_moe, "PDL_CHAIN"), (nv, "MOE_KSUM_IN_NORM")):
        with monkeypatch.context() as m:
            m.setattr(module, knob, False)
            assert ops.moe_experts_pairs(x, w13, w2, weights, ids) is None, knob
    ops.batch_invariant = True
    assert ops.moe_experts_pairs(x, w13, w2, weights, ids) is None


def test_moe_layer_runs_the_kernel():
    """The model's MoE block reaches the kernel through ops.moe_experts."""
    from deepinfer.models.moe import MoEBlock

    ops = NvidiaOps(DEV)
    layer = MoEBlock(24, 20, 4, 2, ops, layer=0).to(DEV)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen(6)) * 0.2)
        x = torch.randn(5, 24, generator=gen(7)).to(DEV)
        out = layer(x)
        from deepinfer.backends.nvidia import ops as nv  # 5 tokens x top-2: the pair kernel up to MOE_PAIRS_MAX

        assert ops.kernel_calls["moe_pairs" if 10 <= nv.MOE_PAIRS_MAX else "fused_moe"] == 1
        w, i = ref_moe.route(x @ layer.gate_weight.t(), 2)
        assert rel_err(out, ref_moe.experts_dense(x, layer.w13, layer.w2, w, i)) < 1e-5


# ------------------------------------------------------------------------------------------- GPU only
def _qwen3_weights(seed, dtype=torch.bfloat16):
    """Qwen3-30B-A3B's expert shapes: E=128, d=2048, F=768 (random, drawn on the GPU)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    E, d, F = 128, 2048, 768
    w13 = (torch.randn(E, 2 * F, d, generator=g, device=DEV) * d ** -0.5).to(dtype)
    w2 = (torch.randn(E, d, F, generator=g, device=DEV) * F ** -0.5).to(dtype)
    return w13, w2


def _tokens(seed, T, E=128, k=8, d=2048, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, d, generator=g, device=DEV).to(dtype)
    weights, ids = ref_moe.route(torch.randn(T, E, generator=g, device=DEV), k)
    return x, weights, ids


def _time_us(fn, reps=20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


@gpu
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_gpu_qwen3_moe_shapes_bf16(T):
    w13, w2 = _qwen3_weights(10)
    x, weights, ids = _tokens(11, T)
    poison_free_memory(T * 8 * 2048 * 2 * 4)
    out = triton_moe.fused_experts(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    ref = ref_moe.experts_routed(x, w13, w2, weights, ids)
    assert rel_err(out, ref) < 1e-2
    assert torch.equal(out, triton_moe.fused_experts(x, w13, w2, weights, ids)), "deterministic"
    fused = _time_us(lambda: triton_moe.fused_experts(x, w13, w2, weights, ids))
    routed = _time_us(lambda: ref_moe.experts_routed(x, w13, w2, weights, ids), reps=3)
    print(f"\nqwen3 moe T={T}: fused {fused:.1f} us, reference routed {routed:.1f} us")


@gpu
def test_gpu_qwen3_float32_clamp_and_skewed_routing():
    w13, w2 = _qwen3_weights(12, torch.float32)
    x, weights, ids = _tokens(13, 64, dtype=torch.float32)
    out = triton_moe.fused_experts(x, w13, w2, weights, ids, clamp=3.0)
    assert rel_err(out, ref_moe.experts_dense(x, w13, w2, weights, ids, clamp=3.0)) < 1e-5
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    x, weights, ids = _tokens(14, 1024)
    ids = torch.where(ids[:, :1] % 2 == 0, ids, ids % 4)  # half the tokens crowd onto experts 0..3
    out = triton_moe.fused_experts(x, w13, w2, weights, ids)
    assert rel_err(out, ref_moe.experts_routed(x, w13, w2, weights, ids)) < 1e-2


@gpu
@pytest.mark.parametrize("T,skew,fp8,bm", [(4096, False, False, 128), (3001, True, False, 128),
                                          (2048, False, False, 64), (1501, True, False, 64),
                                          (4096, False, True, 128), (3001, True, True, 128)])
def test_gpu_prefill_sized_m_blocks(T, skew, fp8, bm, monkeypatch):
    """Prefill-sized M-blocks (64 rows from a mean of 33 pairs an expert, 128 from 513) on launch_config's prefill
    tiles (bf16 weights: WIDE_PREFILL_TILES, 64 and 128 rows; block-scaled FP8 weights: FP8_PREFILL_TILES) and on
    the earlier ones: both match the reference's routed experts (on the weights FP8 dequantizes to), partial blocks
    and crowded experts included."""
    E, k, d, F = 8, 2, 2048, 768
    g = torch.Generator(device=DEV).manual_seed(19)
    if fp8:
        w13, s13, ref13 = fp8_weights(torch.Generator().manual_seed(19), E, 2 * F, d)
        w2, s2, ref2 = fp8_weights(torch.Generator().manual_seed(20), E, d, F)
        scales = dict(w13_scale=s13, w2_scale=s2)
    else:
        w13 = (torch.randn(E, 2 * F, d, generator=g, device=DEV) * d ** -0.5).bfloat16()
        w2 = (torch.randn(E, d, F, generator=g, device=DEV) * F ** -0.5).bfloat16()
        scales = {}
    x, weights, ids = _tokens(20, T, E=E, k=k, d=d)
    if skew:
        ids = torch.where(torch.arange(T, device=DEV)[:, None] % 3 == 0, ids % 2, ids)
    w_bytes = w13.element_size()
    assert triton_moe.launch_config(T * k, E, F, d, DEV, w_bytes=w_bytes)["BLOCK_M"] == bm
    ref = ref_moe.experts_dense(x.float(), ref13, ref2, weights, ids) if fp8 else \
        ref_moe.experts_routed(x, w13, w2, weights, ids)
    outs, cfgs = {}, {}
    for new in (True, False):
        monkeypatch.setattr(triton_moe, "WIDE_PREFILL_TILES", new)
        monkeypatch.setattr(triton_moe, "FP8_PREFILL_TILES", new)
        cfgs[new] = triton_moe.launch_config(T * k, E, F, d, DEV, w_bytes=w_bytes)
        outs[new] = triton_moe.fused_experts(x, w13, w2, weights, ids, **scales)
        assert rel_err(outs[new], ref) < 1e-2, new
    assert (cfgs[True] != cfgs[False]) == (not fp8 or bm == 128), cfgs  # FP8 at 64 rows: no tiles of its own
    assert rel_err(outs[True], outs[False]) < 1e-2


@gpu
def test_gpu_deepseek_v3_fp8_shapes():
    """E=256, k=8, d=7168, F=2048, 128x128 block-scaled FP8, 16 tokens, against experts_dense on the
    weights models.quant dequantizes (only the experts the routing uses)."""
    E, k, d, F, T = 256, 8, 7168, 2048, 16
    g = torch.Generator(device=DEV).manual_seed(15)

    def rand_fp8(*shape):  # drawn 16 experts at a time: float32 temporaries of all 256 would need ~90 GB
        q = torch.empty(shape, dtype=FP8, device=DEV)
        for e in range(0, E, 16):
            q[e:e + 16] = (torch.randn(16, *shape[1:], generator=g, device=DEV) * 64).clamp_(-448, 448).to(FP8)
        return q

    q13, q2 = rand_fp8(E, 2 * F, d), rand_fp8(E, d, F)
    s13 = (torch.rand(E, 2 * F // 128, d // 128, generator=g, device=DEV) + 0.5) * (d ** -0.5 / 64)
    s2 = (torch.rand(E, d // 128, F // 128, generator=g, device=DEV) + 0.5) * (F ** -0.5 / 64)
    x, weights, ids = _tokens(16, T, E=E, k=k, d=d)
    out = triton_moe.fused_experts(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    used = torch.unique(ids)
    remap = torch.zeros(E, dtype=torch.long, device=DEV)
    remap[used] = torch.arange(used.numel(), device=DEV)
    w13 = torch.stack([dequantize_fp8_block(q13[e], s13[e]) for e in used.tolist()])
    w2 = torch.stack([dequantize_fp8_block(q2[e], s2[e]) for e in used.tolist()])
    ref = ref_moe.experts_dense(x.float(), w13, w2, weights, remap[ids])
    assert rel_err(out, ref) < 1e-2
    fused = _time_us(lambda: triton_moe.fused_experts(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2))
    print(f"\ndeepseek-v3 fp8 moe T={T}: fused {fused:.1f} us")


@gpu
def test_gpu_cuda_graph_capture_and_replay_with_new_routing():
    """No host sync (checked with torch's sync debug mode) and buffers sized from shapes: capture once,
    replay with new tokens and routings, including the most skewed and the most spread ones."""
    ops = NvidiaOps(DEV)
    T = 32
    w13, w2 = _qwen3_weights(17)
    x, weights, ids = _tokens(18, T)
    static = dict(x=x.clone(), weights=weights.clone(), ids=ids.clone())

    def run():
        return ops.moe_experts(static["x"], w13, w2, static["weights"], static["ids"])

    graph, out = capture_graph(run, warmup=lambda: (run(), no_host_sync(run)))  # compile outside the sync check
    for case in range(3):
        nx, nw, ni = _tokens(19 + case, T)
        if case == 1:
            ni = torch.full_like(ni, 127)  # every pair on one expert
        elif case == 2:
            ni = (torch.arange(T * 8, device=DEV) % 128).view(T, 8)  # all 128 experts, 2 pairs each
        static["x"].copy_(nx)
        static["weights"].copy_(nw)
        static["ids"].copy_(ni)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref_moe.experts_routed(nx, w13, w2, nw, ni)) < 1e-2
    assert ops.kernel_calls["fused_moe"] == 3


@gpu
def test_gpu_pdl_chain_same_bits_in_every_mode(monkeypatch):
    """With PDL_CHAIN the five launches overlap their neighbours (PDL modes 1-3) or not (0): the same bits, eager and
    in a CUDA graph, and no host sync."""
    from deepinfer.backends.nvidia import triton_pdl

    monkeypatch.setattr(triton_moe, "PDL_CHAIN", True)
    w13, w2 = _qwen3_weights(23)
    x, weights, ids = _tokens(24, 48)
    outs = {}
    for mode in (0, 1, 2, 3):
        monkeypatch.setattr(triton_pdl, "MODE", mode)
        monkeypatch.setattr(triton_pdl, "_by_device", {})

        def run():
            return triton_moe.fused_experts(x, w13, w2, weights, ids)

        outs[mode] = run()
        graph, out = capture_graph(run, warmup=lambda: (run(), no_host_sync(run)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, outs[mode]), mode
    for mode in (1, 2, 3):
        assert torch.equal(outs[mode], outs[0]), mode
    assert rel_err(outs[0], ref_moe.experts_routed(x, w13, w2, weights, ids)) < 1e-2


@gpu
def test_gpu_ced_same_bits_with_the_k_sum_in_the_norm(tmp_path, monkeypatch):
    """MOE_KSUM_IN_NORM moves the fused MoE's k-sum into the next add + RMSNorm kernel: CED prefill (fused MoE) and
    greedy decoding with log-probabilities are identical bit for bit with it on and off, and on, the norm adds the
    pair rows."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.backends.nvidia import ops as nv
    from deepinfer.testing.ced import build_ced_checkpoint
    from test_ced_decode_path import GPU_CFG

    build_ced_checkpoint(tmp_path, seed=12, **GPU_CFG)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 26)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    results, calls = {}, {}
    for on in (False, True):
        monkeypatch.setattr(nv, "MOE_KSUM_IN_NORM", on)
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", num_kv_blocks=96, block_size=4, backend="nvidia",
                  enforce_eager=False)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        calls[on] = llm.engine.ops.kernel_calls["ced_add_rms_norm_pairs"]
        results[on] = [(list(o.outputs[0].token_ids),
                        [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
                       for o in outs]
        del llm
        torch.cuda.empty_cache()
    assert calls[False] == 0 and calls[True] > 0
    assert results[True] == results[False]


# ------------------------------------------------------------------------------------------- compiled path
_COMPILE_SCRIPT = r'''
import json
import torch
from deepinfer.backends.nvidia import triton_attention, triton_moe as tm
from deepinfer.testing.kernels import compile_sm90, sass_row

assert not tm.INTERPRET
report = {}


def compile_(fn, name, sig, const, div16=(), **opts):
    k = compile_sm90(fn, sig, const, div16, **opts)
    report[name] = sass_row(k, r"\b(HMMA|HGMMA|STL|LDL)\b", smem=k.metadata.shared)


ints = lambda *names: {n: "i32" for n in names}
triton_attention._SM_COUNT[0] = 132  # an H200 (the SM count the launch configs read)
tm._SMEM[0] = tm.HOPPER_SHARED_MEM  # and its shared memory a block (launch_config's wide prefill tiles read it)
compile_(tm._count_kernel, "count", dict(ids_ptr="*i64", chunk_counts_ptr="*i32", **ints("N", "E", "CHUNK")),
         dict(S=64, EB=512, CHUNK_I=0), num_warps=4)
compile_(tm._place_kernel, "place", dict(ids_ptr="*i64", chunk_counts_ptr="*i32", sorted_ptr="*i32",
         starts_ptr="*i32", counts_ptr="*i32", **ints("N", "E", "CHUNK", "NUM_CHUNKS")),
         dict(BLOCK_M=16, S=64, EB=512, RB=8, CHUNK_I=0, NUM_CHUNKS_I=0), num_warps=4)
for pairs, fp8 in ((8, False), (64 * 8, False), (4096 * 8, False), (128 * 1024, False), (16 * 8, True),
                   (4096 * 8, True), (128 * 1024, True)):
    cfg = tm.launch_config(pairs, 128, 768, 2048, torch.device("cuda", 0), w_bytes=1 if fp8 else 2)
    BM, w, tag = cfg["BLOCK_M"], ("*fp8e4nv" if fp8 else "*bf16"), f"{'fp8' if fp8 else 'bf16'}_BM{cfg['BLOCK_M']}"
    compile_(tm._gemm1_swiglu_kernel, "gemm1_" + tag,
             dict(x_ptr="*bf16", w_ptr=w, ws_ptr="*fp32", act_ptr="*bf16", sorted_ptr="*i32", starts_ptr="*i32",
                  counts_ptr="*i32", clamp="fp32", **ints("stride_xt", "stride_we", "stride_wn", "stride_se",
                  "stride_sn", "stride_at", "F", "D", "E", "TOPK", "NUM_N")),
             dict(stride_xk=1, stride_wk=1, stride_sk=1, EB=256, BLOCK_M=BM, BLOCK_N=cfg["BN1"], BLOCK_K=cfg["BK1"],
                  HAS_CLAMP=True, FP8_W=fp8, EVEN_K=True, EVEN_N=True, DOT_PRECISION="tf32", D_I=0),
             div16=("stride_xt", "stride_we", "stride_wn", "stride_at", "F", "D"),
             num_warps=cfg["warps1"], num_stages=cfg["stages1"])
    compile_(tm._gemm2_kernel, "gemm2_" + tag,
             dict(act_ptr="*bf16", w_ptr=w, ws_ptr="*fp32", rw_ptr="*fp32", out_ptr="*bf16", sorted_ptr="*i32",
                  starts_ptr="*i32", counts_ptr="*i32", **ints("stride_at", "stride_we", "stride_wn", "stride_se",
                  "stride_sn", "stride_ot", "F", "D", "E", "NUM_N")),
             dict(stride_wk=1, stride_sk=1, EB=256, BLOCK_M=BM, BLOCK_N=cfg["BN2"], BLOCK_K=cfg["BK2"], FP8_W=fp8,
                  EVEN_K=True, EVEN_N=True, DOT_PRECISION="tf32", F_I=0),
             div16=("stride_at", "stride_we", "stride_wn", "stride_ot", "F", "D"),
             num_warps=cfg["warps2"], num_stages=cfg["stages2"])
cfg = tm.launch_config(64, 128, 768, 2048, torch.device("cuda", 0))  # PDL_CHAIN's launches: waits and late signals
for pdl in (2, 3):
    k = compile_sm90(tm._gemm1_swiglu_kernel,
                     dict(x_ptr="*bf16", w_ptr="*bf16", ws_ptr="*fp32", act_ptr="*bf16", sorted_ptr="*i32",
                          starts_ptr="*i32", counts_ptr="*i32", clamp="fp32", **ints("stride_xt", "stride_we",
                          "stride_wn", "stride_se", "stride_sn", "stride_at", "F", "D", "E", "TOPK", "NUM_N")),
                     dict(stride_xk=1, stride_wk=1, stride_sk=1, EB=256, BLOCK_M=16, BLOCK_N=cfg["BN1"],
                          BLOCK_K=cfg["BK1"], HAS_CLAMP=True, FP8_W=False, EVEN_K=True, EVEN_N=True,
                          DOT_PRECISION="tf32", D_I=0, PDL=pdl), (), launch_pdl=True,
                     num_warps=cfg["warps1"], num_stages=cfg["stages1"])
    ks = compile_sm90(tm._ksum_kernel, dict(pairs_ptr="*bf16", out_ptr="*bf16", **ints("D", "stride_pt", "stride_ot")),
                      dict(TOPK=8, BLOCK_D=1024, PDL=pdl), (), launch_pdl=True, num_warps=4)
    for name, kern in (("pdl_gemm1", k), ("pdl_ksum", ks)):
        ptx = kern.asm["ptx"]
        report[f"{name}_{pdl}"] = dict(wait=ptx.count("griddepcontrol.wait"),
                                       signal=ptx.count("griddepcontrol.launch_dependents"), smem=kern.metadata.shared)
print(json.dumps(report))
'''


def test_kernels_compile_for_hopper():
    """The compiled path, which CPU CI never runs: the kernels build for sm_90 at the block sizes that
    launch_config picks for Qwen3-30B-A3B (decode, prefill; bf16 and FP8) without local-memory spills, on
    tensor cores (warpgroup MMAs from BLOCK_M 64), within the H200's 227 KB of shared memory."""
    report = run_compile_script(_COMPILE_SCRIPT)
    assert {"gemm1_bf16_BM16", "gemm1_bf16_BM64", "gemm1_bf16_BM128", "gemm2_fp8_BM16", "gemm2_fp8_BM64",
            "gemm1_fp8_BM128", "gemm2_fp8_BM128"} <= set(report)
    for pdl in (2, 3):  # every program waits; the signal at the start (2) or after the main loop (3)
        for name in ("pdl_gemm1", "pdl_ksum"):
            row = report.pop(f"{name}_{pdl}")
            assert (row["wait"], row["signal"]) == (1, 1) and row["smem"] <= 227 * 1024, (name, pdl, row)
    for name, row in report.items():
        assert row["smem"] <= 227 * 1024, (name, row)
        sass = row.get("sass")
        if sass is None:
            continue  # no cuobjdump in this triton install
        assert sass.get("STL", 0) == 0 and sass.get("LDL", 0) == 0, f"{name}: local-memory spills: {sass}"
        if name.startswith("gemm"):
            mma = "HMMA" if name.endswith("BM16") else "HGMMA"
            assert sass.get(mma, 0) > 0, (name, sass)
