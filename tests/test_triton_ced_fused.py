"""CED's fused RMSNorm and RoPE kernels (backends/nvidia/triton_ced_fused.py) against the torch formulas they
replace on CUDA (models/ced/functional.py rms / apply_rope, the CPU path and oracle).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1) on drawn shapes; with CUDA the same
property tests run compiled kernels, and the GPU-only tests add the CED bench shapes. What must hold:
- rope: the copied channels bit for bit; the rotated ones within 1 ulp of the output dtype (float32: 4 eps of
  |a| + |b|), since the interpreter's cos/sin are numpy's. On the GPU (libdevice, torch's own cosf/sinf, FMA
  fusion off) bit for bit at the bench shapes;
- rms: within 1 ulp of the output dtype (float32: 4 ulp): the kernel sums the squares in another order than
  torch's reduction, so the mean may differ in its last bit (and rsqrt by an ulp under the interpreter);
- the dispatch: functional takes the kernels only for CUDA tensors without gradient and ops that offer them, so
  the CPU path is the torch formula; NvidiaOps counts the launches and falls back to the reference op.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import (DEV, assert_same_bits, examples, gen, gpu, run_compile_script,
                                       skip_module_without_kernels)

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_ced_fused as tcf  # noqa: E402
from deepinfer.backends.nvidia.ops import NvidiaOps  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402
from deepinfer.models.ced import functional as fn  # noqa: E402

FAST = examples(25)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
MIN_EXP = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |x| (float64), subnormals included."""
    e = torch.floor(torch.log2(x.double().abs().clamp_min(2.0 ** MIN_EXP[dtype])))
    return torch.pow(2.0, e - MANTISSA[dtype])


def assert_within_ulps(out: torch.Tensor, ref: torch.Tensor, n: float) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(o).any()
    bound = n * ulp(torch.maximum(o.abs(), r.abs()), ref.dtype)
    bad = (o - r).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements off by more than {n} ulp, e.g. {o[bad][:3]} vs {r[bad][:3]}"


def values(g, shape, dtype, scale_exp):
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 2.0 ** scale_exp).to(dtype).to(DEV)


# ------------------------------------------------------------------------------------------------ RMSNorm
@FAST
@given(lead=st.sampled_from([(0,), (1,), (3,), (2, 3)]), N=st.sampled_from([1, 7, 16, 48, 100, 256]),
       dtype=st.sampled_from(DTYPES), w_dtype=st.sampled_from(DTYPES), scale_exp=st.integers(-6, 6),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_rms_norm_matches_torch_formula(lead, N, dtype, w_dtype, scale_exp, strided, seed):
    g = gen(seed)
    x = values(g, (*lead, N + 3 if strided else N), dtype, scale_exp)
    x = x[..., :N] if strided else x  # rows with a stride past N
    w = values(g, (N,), w_dtype, 0)
    out = tcf.rms_norm(x, w, 1e-6)
    ref = fn.rms(x.cpu(), w.cpu(), 1e-6)
    assert out.dtype == dtype and out.is_contiguous()
    assert_within_ulps(out, ref.to(out.device), 4 if dtype == torch.float32 else 1)


def test_rms_norm_rounds_once_after_the_weight():
    """The weight is applied in float32 before the one rounding (Ops.rms_norm, Llama's, rounds before it):
    a row whose normalised value needs a float32 weight product to round as torch's formula does."""
    x = torch.tensor([[1.0, 3.0, 5.0, 7.0]], dtype=torch.bfloat16, device=DEV)
    w = torch.tensor([1.001, 0.999, 1.0039, 1.0], dtype=torch.float32, device=DEV)
    got = tcf.rms_norm(x, w, 1e-6)
    assert_same_bits(got.cpu(), fn.rms(x.cpu(), w.cpu(), 1e-6))
    llama = ReferenceOps("cpu").rms_norm(x.cpu(), w.cpu().bfloat16(), 1e-6)
    assert not torch.equal(got.cpu(), llama.to(got.dtype))  # not the two-rounding Llama norm


# ------------------------------------------------------------------------------------------------ RoPE
@FAST
@given(T=st.integers(0, 5), mid=st.sampled_from([(), (1,), (3,), (2, 2)]), D=st.sampled_from([8, 16, 24, 40, 64]),
       frac=st.sampled_from([1.0, 0.5, 0.25]), dtype=st.sampled_from(DTYPES), inverse=st.booleans(),
       theta=st.sampled_from([10000.0, 1e6]), max_pos=st.sampled_from([16, 70000]), pos32=st.booleans(),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_matches_torch_formula(T, mid, D, frac, dtype, inverse, theta, max_pos, pos32, strided, seed):
    g = gen(seed)
    R = max(2, int(D * frac) // 2 * 2)
    x = values(g, (T, *mid, D + 5 if strided else D), dtype, 1)
    x = x[..., :D] if strided else x
    pos = torch.randint(0, max_pos, (T,), generator=g).to(DEV, torch.int32 if pos32 else torch.int64)
    out = tcf.rope(x, pos, tcf.inv_freq(R, theta, x.device), inverse)
    ref = fn.apply_rope(x.cpu(), pos.cpu(), R, theta, inverse).to(out.device)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert_same_bits(out[..., :D - R].cpu(), ref[..., :D - R].cpu())
    o, r = out[..., D - R:].double().cpu(), ref[..., D - R:].double().cpu()
    if dtype == torch.float32:  # cos/sin within ~1 ulp: 4 eps of the pair's magnitude
        pair = x[..., D - R:].double().cpu().abs().reshape(*x.shape[:-1], R // 2, 2).sum(-1)
        bound = 4 * 2.0 ** -23 * pair.repeat_interleave(2, -1) + ulp(r, dtype)
        assert ((o - r).abs() <= bound).all()
    else:
        assert_within_ulps(out[..., D - R:], ref[..., D - R:], 1)


@FAST
@given(T=st.integers(0, 5), mid=st.sampled_from([(), (1,), (3,), (2, 2)]), D=st.sampled_from([8, 24, 64]),
       frac=st.sampled_from([1.0, 0.25]), dtype=st.sampled_from(DTYPES), inverse=st.booleans(),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_in_place_equals_out_of_place(T, mid, D, frac, dtype, inverse, strided, seed):
    """``inplace``: the same bits as the out-of-place kernel, written into x and x returned, its unrotated
    channels untouched; a strided x (not contiguous) gets a new tensor and stays as it was."""
    g = gen(seed)
    R = max(2, int(D * frac) // 2 * 2)
    x = values(g, (T, *mid, D + 5 if strided else D), dtype, 1)
    x = x[..., :D] if strided else x
    pos = torch.randint(0, 70000, (T,), generator=g).to(DEV)
    inv = tcf.inv_freq(R, 10000.0, x.device)
    want = tcf.rope(x, pos, inv, inverse)
    before = x.clone()
    got = tcf.rope(x, pos, inv, inverse, inplace=True)
    assert_same_bits(got.cpu(), want.cpu())
    if not x.is_contiguous():  # (a strided slice of one row still is)
        assert got.data_ptr() != x.data_ptr()
        assert_same_bits(x.cpu(), before.cpu())
    else:
        assert got.data_ptr() == x.data_ptr() or x.numel() == 0
        assert_same_bits(x[..., :D - R].cpu(), before[..., :D - R].cpu())


def test_rope_inverse_undoes_rope():
    g = gen(5)
    x = values(g, (4, 3, 32), torch.float32, 0)
    pos = torch.tensor([0, 1, 500, 65535], device=DEV)
    inv = tcf.inv_freq(16, 10000.0, x.device)
    back = tcf.rope(tcf.rope(x, pos, inv), pos, inv, inverse=True)
    assert (back - x).abs().max() < 1e-5


def test_inv_freq_is_the_model_formula_kept_per_device():
    a = tcf.inv_freq(16, 10000.0, DEV)
    assert a is tcf.inv_freq(16, 10000.0, DEV)
    assert_same_bits(a.cpu(), fn.rope_inv_freq(16, 10000.0, DEV).cpu())
    assert tcf.inv_freq(16, 500.0, DEV) is not a


# ------------------------------------------------------------------------------------------------ dispatch
def test_ops_dispatch_count_and_fall_back():
    ops = NvidiaOps(DEV)
    g = gen(1)
    x, w = values(g, (3, 64), torch.bfloat16, 0), values(g, (64,), torch.float32, 0)
    pos = torch.arange(3, device=DEV)
    assert_within_ulps(ops.ced_rms_norm(x, w, 1e-6), fn.rms(x, w, 1e-6), 1)
    ops.ced_rope(x, pos, 16, 10000.0)
    assert ops.kernel_calls["ced_rms_norm"] == 1 and ops.kernel_calls["ced_rope"] == 1
    # Unsupported: float64, float positions -> the reference op.
    x64 = x.double()
    assert_same_bits(ops.ced_rms_norm(x64, w, 1e-6), fn.rms(x64, w, 1e-6))
    assert_same_bits(ops.ced_rope(x64, pos, 16, 10000.0, True), fn.apply_rope(x64, pos, 16, 10000.0, True))
    assert_same_bits(ops.ced_rope(x, pos.float(), 16, 10000.0), fn.apply_rope(x, pos.float(), 16, 10000.0))
    assert ops.kernel_calls["ced_rms_norm"] == 1 and ops.kernel_calls["ced_rope"] == 1
    ref = ReferenceOps(DEV)
    assert_same_bits(ref.ced_rms_norm(x, w, 1e-6), fn.rms(x, w, 1e-6))
    assert_same_bits(ref.ced_rope(x, pos, 16, 10000.0, True), fn.apply_rope(x, pos, 16, 10000.0, True))
    with pytest.raises(ValueError, match="rope: unsupported"):
        tcf.rope(x, pos[:2], tcf.inv_freq(16, 10000.0, x.device))


def test_functional_takes_the_kernels_only_on_cuda_without_grad():
    ops = NvidiaOps(DEV)
    g = gen(2)
    x, w = values(g, (2, 32), torch.float32, 0), values(g, (32,), torch.float32, 0)
    pos = torch.arange(2, device=DEV)
    fn.rms(x, w, 1e-6, ops=ops)
    fn.apply_rope(x, pos, 8, 10000.0, ops=ops)
    launched = 2 if x.is_cuda else 0  # the CPU always runs the torch formula (the oracle and training path)
    assert sum(ops.kernel_calls.values()) == launched
    wg = w.clone().requires_grad_(True)
    y = fn.rms(x, wg, 1e-6, ops=ops)
    y.sum().backward()  # a gradient to carry: the torch formula, whatever the device
    assert wg.grad is not None and sum(ops.kernel_calls.values()) == launched
    fn.rms(x, w, 1e-6, ops=object())  # ops without the fused kernels: the formula
    assert sum(ops.kernel_calls.values()) == launched


# ------------------------------------------------------------------------------------------------ GPU
@gpu
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_bench_shapes_bit_for_bit_on_gpu(inverse):
    """The CED bench's rope calls (q [64, 16, 512], kv [64, 512], R = 64) in bf16 and float32, positions up to
    the bench's max: libdevice cos/sin and no FMA give torch's CUDA bits."""
    g = gen(7)
    pos = torch.randint(0, 65536, (64,), generator=g).to(DEV)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((64, 16, 512), (64, 512)):
            x = values(g, shape, dtype, 0)
            out = tcf.rope(x, pos, tcf.inv_freq(64, 10000.0, x.device), inverse)
            assert_same_bits(out, fn.apply_rope(x, pos, 64, 10000.0, inverse))


@gpu
def test_rms_bench_shapes_on_gpu():
    """The bench's norms (hidden 2048, q latent 1024, kv latent 512) in bf16: within 1 ulp, nearly all equal."""
    g = gen(8)
    for N in (2048, 1024, 512):
        x, w = values(g, (64, N), torch.bfloat16, 0), values(g, (N,), torch.bfloat16, 0)
        out, ref = tcf.rms_norm(x, w, 1e-6), fn.rms(x, w, 1e-6)
        assert_within_ulps(out, ref, 1)
        assert (out != ref).float().mean() < 1e-2


@gpu
def test_ced_layer_pieces_take_the_kernels_on_gpu():
    """A bf16 CED model on CUDA with NvidiaOps: query, swa_kv, out_proj and c_norm launch the fused kernels
    (one each per rms / rope) and agree with the torch formulas on the same device (ops None: ReferenceOps)."""
    from deepinfer.models.ced.config import CEDConfig
    from deepinfer.models.ced.model import CEDForCausalLM

    cfg = CEDConfig(fake_quant=False)
    ops = NvidiaOps(DEV)
    model = CEDForCausalLM(cfg, ops=ops)
    model.init_weights(0)
    model = model.to(DEV, torch.bfloat16)
    layer = model.layers[1]
    g = gen(9)
    x, pos = values(g, (5, cfg.hidden_size), torch.bfloat16, 0), torch.arange(5, device=DEV) * 37

    def pieces():
        q, cq = layer.query(x, pos)
        return q, cq, layer.swa_kv(x, pos), layer.out_proj(q, pos), model.c_norm(x)

    with torch.no_grad():
        fast = pieces()
        assert (ops.kernel_calls["ced_rms_norm"], ops.kernel_calls["ced_rope"]) == (3, 3)
        model.ops = None
        slow = pieces()
    for a, b in zip(fast, slow):  # (out_proj left the q it was given as it was: fast[0] is the query's)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
    assert_within_ulps(fast[1], slow[1], 1)  # cq: one rms of the same input
    assert_within_ulps(fast[4], slow[4], 1)
    with torch.no_grad():  # the engine's call: its temporary rotated in place, the same bits
        model.ops = ops
        o = fast[0].clone()
        assert torch.equal(layer.out_proj(o, pos, reuse_input=True), fast[3])
        assert not torch.equal(o, fast[0])


# ------------------------------------------------------------------------------------------------ sm_90 build
_COMPILE_SCRIPT = r'''
import json
from deepinfer.backends.nvidia import triton_ced_fused as tcf
from deepinfer.testing.kernels import compile_sm90, sass_row

assert not tcf.INTERPRET
report = {}
for dt in ("bf16", "fp32"):
    p = "*" + dt
    k = compile_sm90(tcf._ced_rms_kernel, dict(x_ptr=p, w_ptr=p, o_ptr=p, stride_x="i32", stride_o="i32", N="i32",
                                               eps="fp32"), dict(BLOCK=2048), div16=["stride_x", "stride_o", "N"],
                     num_warps=4, enable_fp_fusion=False)
    report[f"rms_{dt}"] = sass_row(k, r"\b(STL|LDL)\b", fma="fma.rn" in k.asm["ptx"],
                                   rsqrt="rsqrt.approx" in k.asm["ptx"])
    cfg = tcf.launch_config(16, 32, 448)
    ints = "stride_xt stride_xm stride_ot stride_om M D HALF"
    k = compile_sm90(tcf._ced_rope_kernel, dict(x_ptr=p, o_ptr=p, pos_ptr="*i64", inv_ptr="*fp32",
                                                **{n: "i32" for n in ints.split()}),
                     dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_R=cfg["BLOCK_R"], BLOCK_P=cfg["BLOCK_P"], INVERSE=False),
                     div16=["stride_xt", "stride_xm", "stride_ot", "stride_om", "M", "D", "HALF"],
                     num_warps=cfg["num_warps"], enable_fp_fusion=False)
    report[f"rope_{dt}"] = sass_row(k, r"\b(STL|LDL)\b", approx="cos.approx" in k.asm["ptx"]
                                    or "sin.approx" in k.asm["ptx"])

print(json.dumps(report))
'''


def test_fused_kernels_compile_for_hopper():
    """Both kernels build for sm_90 with libdevice: rms has no FMA contraction (x * rstd, then * w, rounded
    apart) and an rsqrt; rope takes the full-range cosf/sinf, not cos.approx/sin.approx. Nothing spills: rms
    uses no local memory; rope only what libdevice's cosf/sinf use for their large-argument reduction
    (Payne-Hanek, |angle| > ~1e5; torch's cos/sin kernels run the same code): a kernel of cos + sin alone has
    4 STL / 6 LDL at sm_90, rope two inlined copies of it (8 / 12)."""
    report = run_compile_script(_COMPILE_SCRIPT)
    assert set(report) == {"rms_bf16", "rms_fp32", "rope_bf16", "rope_fp32"}
    for name, row in report.items():
        if name.startswith("rms"):
            assert not row["fma"] and row["rsqrt"], (name, row)
        else:
            assert not row["approx"], (name, row)
        sass = row.get("sass")
        if sass is None:
            continue  # no cuobjdump in this triton install
        allowed = {"STL": 0, "LDL": 0} if name.startswith("rms") else {"STL": 8, "LDL": 12}
        assert all(sass.get(op, 0) <= n for op, n in allowed.items()), (name, sass)
