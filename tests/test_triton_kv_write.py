"""The Triton KV-cache write against ReferenceOps.write_kv (index_copy_ of k.to(cache.dtype)).

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported);
the GPU-only tests use Llama-3.1-8B / Qwen3-30B-A3B cache shapes and a CUDA-graph capture. The kernel must be
bit-identical to the reference, and rows it does not own must keep their bits: every cache starts
poisoned with NaN and is compared bit for bit (NaN payloads included). Its sm_90 compile test lives in
test_triton_rope.py (one subprocess builds both kernels).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import DEV, capture_graph, examples, gen, gpu, skip_module_without_kernels

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_kv_write  # noqa: E402
from deepinfer.backends.nvidia.ops import NvidiaOps  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402

REF = ReferenceOps(DEV)
FAST = examples(25)
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def poisoned_caches(layers, slots, Hk, Dk, Dv, dtype, padded: bool):
    """NaN-filled [layers, slots, Hk, D] tensors; ``padded`` makes each head row wider than D (a strided view)."""
    pad = 3 if padded else 0
    kc = torch.full((layers, slots, Hk, Dk + pad), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full((layers, slots, Hk, Dv + pad), float("nan"), dtype=dtype, device=DEV)
    return kc[..., :Dk], vc[..., :Dv]


def kv_inputs(g, T, Hk, Dk, Dv, dtype, strided: bool, scale: float = 3.0):
    if not strided:
        return ((torch.randn(T, Hk, Dk, generator=g) * scale).to(DEV, dtype),
                (torch.randn(T, Hk, Dv, generator=g) * scale).to(DEV, dtype))
    qkv = (torch.randn(T, 2 * Hk * Dk + Hk * Dv, generator=g) * scale).to(DEV, dtype)  # [q | k | v] projection
    return qkv[:, Hk * Dk:2 * Hk * Dk].view(T, Hk, Dk), qkv[:, 2 * Hk * Dk:].view(T, Hk, Dv)


@FAST
@given(T=st.integers(0, 7), Hk=st.integers(1, 4), Dk=st.sampled_from([4, 16, 24, 64]), same_dv=st.booleans(),
       cache_dtype=dtypes, x_dtype=dtypes, strided=st.booleans(), padded=st.booleans(), slots32=st.booleans(),
       layer=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_write_kv_bit_identical_to_reference(T, Hk, Dk, same_dv, cache_dtype, x_dtype, strided, padded, slots32,
                                             layer, seed):
    g = gen(seed)
    Dv = Dk if same_dv else Dk // 2 + 4
    N = 12
    kc, vc = poisoned_caches(3, N, Hk, Dk, Dv, cache_dtype, padded)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k, v = kv_inputs(g, T, Hk, Dk, Dv, x_dtype, strided)
    slots = torch.randperm(N, generator=g)[:T].to(DEV, torch.int32 if slots32 else torch.int64)
    k0, v0 = k.clone(), v.clone()
    triton_kv_write.write_kv(kc[layer], vc[layer], k, v, slots)
    REF.write_kv(kc_ref[layer], vc_ref[layer], k, v, slots.long())
    assert same_bits(kc, kc_ref) and same_bits(vc, vc_ref)  # untouched rows keep their NaN bits
    assert torch.equal(k, k0) and torch.equal(v, v0)


def test_conversions_round_like_the_reference():
    """float32 -> bf16/fp16 ties, overflow to inf, subnormals and signed zeros; a NaN stays a NaN (its
    payload after conversion differs between PyTorch's CPU and CUDA conversions, so it is not compared)."""
    vals = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 65520.0, 1e6, -1e-40, 2 ** -140, -0.0, 2 ** -20,
                         float("inf"), 3.0 + 2 ** -9, 1e-7, -65504.0], dtype=torch.float32)
    k = vals.view(3, 1, 4).to(DEV)
    v = k.clone()
    v[1, 0, 3] = float("nan")
    for cache_dtype in (torch.bfloat16, torch.float16):
        kc, vc = poisoned_caches(1, 5, 1, 4, 4, cache_dtype, False)
        vc.zero_()
        kc_ref, vc_ref = kc.clone(), vc.clone()
        slots = torch.tensor([4, 0, 2], device=DEV)
        triton_kv_write.write_kv(kc[0], vc[0], k, v, slots)
        REF.write_kv(kc_ref[0], vc_ref[0], k, v, slots)
        assert same_bits(kc, kc_ref)
        assert torch.equal(vc.isnan(), vc_ref.isnan()) and torch.equal(vc.nan_to_num(), vc_ref.nan_to_num())


def test_ops_dispatch_and_fallback():
    ops = NvidiaOps(DEV)
    g = gen(1)
    kc, vc = poisoned_caches(2, 8, 2, 16, 16, torch.bfloat16, False)
    k, v = kv_inputs(g, 3, 2, 16, 16, torch.bfloat16, True)
    slots = torch.tensor([7, 1, 3], device=DEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ops.write_kv(kc[1], vc[1], k, v, slots)
    REF.write_kv(kc_ref[1], vc_ref[1], k, v, slots)
    assert same_bits(kc, kc_ref) and same_bits(vc, vc_ref)
    assert ops.kernel_calls["write_kv"] == 1
    # A cache whose channels are not unit-stride: the reference op, same result.
    kt = torch.full((8, 16, 2), float("nan"), device=DEV).permute(0, 2, 1)  # [8 slots, 2, 16], channel stride 2
    vt, kt_ref, vt_ref = kt.clone(), kt.clone(), kt.clone()
    ops.write_kv(kt, vt, k.float(), v.float(), slots)
    REF.write_kv(kt_ref, vt_ref, k.float(), v.float(), slots)
    assert same_bits(kt, kt_ref) and same_bits(vt, vt_ref)
    assert ops.kernel_calls["write_kv"] == 1


def test_bad_inputs_name_the_argument():
    kc, vc = poisoned_caches(1, 8, 2, 16, 16, torch.float32, False)
    k, v = torch.randn(3, 2, 16, device=DEV), torch.randn(3, 2, 16, device=DEV)
    slots = torch.tensor([0, 1, 2], device=DEV)
    with pytest.raises(ValueError, match="slots must be"):
        triton_kv_write.write_kv(kc[0], vc[0], k, v, slots.float())
    with pytest.raises(ValueError, match="slots must be"):
        triton_kv_write.write_kv(kc[0], vc[0], k, v, slots[:2])
    with pytest.raises(ValueError, match="v .* must be"):
        triton_kv_write.write_kv(kc[0], vc[0], k, v[:, :1], slots)
    with pytest.raises(ValueError, match="k_cache"):
        triton_kv_write.write_kv(kc[0, :, :1], vc[0], k, v, slots)
    with pytest.raises(ValueError, match="v_cache must be 3-D"):
        triton_kv_write.write_kv(kc[0], vc[0].double(), k, v, slots)


# ------------------------------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.parametrize("Hk,D", [(8, 128), (4, 128)])  # Llama-3.1-8B, Qwen3-30B-A3B
@pytest.mark.parametrize("T", [1, 256, 8192])
def test_gpu_realistic_shapes(Hk, D, T):
    g = gen(T + Hk)
    N = 65536
    kc, vc = poisoned_caches(2, N, Hk, D, D, torch.bfloat16, False)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k, v = kv_inputs(g, T, Hk, D, D, torch.bfloat16, True)
    slots = torch.randperm(N, generator=g)[:T].to(DEV)
    triton_kv_write.write_kv(kc[1], vc[1], k, v, slots)
    REF.write_kv(kc_ref[1], vc_ref[1], k, v, slots)
    assert same_bits(kc, kc_ref) and same_bits(vc, vc_ref)
    kf, vf = k.float(), v.float()  # a float32 step into a bf16 cache rounds like .to()
    triton_kv_write.write_kv(kc[0], vc[0], kf, vf, slots)
    REF.write_kv(kc_ref[0], vc_ref[0], kf, vf, slots)
    assert same_bits(kc, kc_ref) and same_bits(vc, vc_ref)


@gpu
def test_gpu_write_kv_in_cuda_graph():
    g = gen(9)
    T, Hk, D, N = 64, 8, 128, 4096
    kc, vc = poisoned_caches(2, N, Hk, D, D, torch.bfloat16, False)
    k, v = kv_inputs(g, T, Hk, D, D, torch.bfloat16, False)
    slots = torch.randperm(N, generator=g)[:T].to(DEV)

    def run():
        triton_kv_write.write_kv(kc[1], vc[1], k, v, slots)

    graph, _ = capture_graph(run)
    for _ in range(3):
        kc.fill_(float("nan"))
        vc.fill_(float("nan"))
        k.copy_(torch.randn(k.shape, generator=g).to(k))
        v.copy_(torch.randn(v.shape, generator=g).to(v))
        slots.copy_(torch.randperm(N, generator=g)[:T].to(DEV))
        kc_ref, vc_ref = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        REF.write_kv(kc_ref[1], vc_ref[1], k, v, slots)
        assert same_bits(kc, kc_ref) and same_bits(vc, vc_ref)
