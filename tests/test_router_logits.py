"""CED's router logits at prefill sizes (nvidia/triton_router_logits.py): bf16 rows against the float32 gate into
float32, against a float64 product; the backend's dispatch to it (ops.CED_ROUTE_LOGITS_TILED) and the routing it
feeds, compared with the reference by the scores of what each side chose. Without CUDA through Triton's
interpreter on small shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.compare import assert_same_routing, ced_router_case
from deepinfer.testing.kernels import DEV, bf16x3, examples, gen, gpu, skip_module_without_kernels

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_router_logits as trl  # noqa: E402


def check(out, x, w):
    """out [M, N] against x.double() @ w.double().T: the kernel sums 3K exact products of x with the gate's three
    bf16 terms (bf16x3: torch's casts, their sum asserted to be w exactly) in float32, so the bound is K
    float32 roundings of sum |x| (|hi| + |mid| + |lo|) (three terms a step: 3K + 2), plus the smallest subnormal."""
    xd = x.double().cpu()
    ref = xd @ w.double().cpu().T
    mag = xd.abs() @ sum(t.double().abs() for t in bf16x3(w)).cpu().T
    bound = (3 * x.shape[1] + 2) * 2.0 ** -24 * mag + 2.0 ** -149
    assert out.shape == ref.shape and out.dtype == torch.float32
    err = (out.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@examples(12)
@given(M=st.integers(1, 150), N=st.integers(1, 70), K=st.integers(1, 300), scale=st.sampled_from([1e-3, 1.0, 50.0]),
       knobs=st.sampled_from([{}, dict(block_m=16, block_k=16), dict(block_m=128, block_k=32)]),
       seed=st.integers(0, 2**16))
def test_logits_match_float64(M, N, K, scale, knobs, seed):
    """Any rows (several row tiles, a partial last one), experts (one or more column tiles) and K (a partial last
    step), gate values down to ~1e-7 of their scale (so the low bf16 terms matter), each launch knob."""
    g = gen(seed)
    x = (torch.randn(M, K, generator=g) * scale).to(DEV, torch.bfloat16)
    w = torch.randn(N, K, generator=g).to(DEV) * torch.rand(N, K, generator=g).to(DEV) ** 3
    check(trl.logits(x, w, **knobs), x, w)


def test_logits_of_strided_rows_and_rows_alone():
    """x a column slice of a wider tensor (row stride != K); a row's logits do not depend on the other rows or on
    how many there are (each program's rows are its own), so a row alone gives the same bits."""
    g = gen(5)
    wide = torch.randn(70, 300, generator=g).to(DEV, torch.bfloat16)
    x = wide[:, 7:7 + 256]
    w = torch.randn(33, 256, generator=g).to(DEV) * 0.05
    out = trl.logits(x, w)
    check(out, x, w)
    for r in (0, 63, 64, 69):
        assert torch.equal(trl.logits(x[r:r + 1], w), out[r:r + 1]), r


def test_empty_shapes_and_bad_inputs():
    g = gen(2)
    x = torch.randn(4, 32, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(6, 32, generator=g).to(DEV)
    assert trl.logits(x[:0], w).shape == (0, 6)
    assert trl.logits(x, w[:0]).shape == (4, 0)
    assert torch.equal(trl.logits(x[:, :0], w[:, :0]), torch.zeros(4, 6, device=DEV))
    for bad_x, bad_w in ((x.float(), w), (x, w.bfloat16()), (x, w[:, :16]), (x.t().contiguous().t(), w)):
        with pytest.raises(ValueError, match="router logits: x must be bf16"):  # (the message names both)
            trl.logits(bad_x, bad_w)
    for knob, bad in (("block_m", 48), ("block_k", 512), ("num_warps", 3), ("num_stages", 0)):
        with pytest.raises(ValueError, match=knob):
            trl.logits(x, w, **{knob: bad})


@pytest.mark.parametrize("invariant", [False, True])
def test_ced_router_takes_the_tiled_logits_past_the_split_k_rows(invariant, monkeypatch):
    """With CED_ROUTE_LOGITS_TILED on, NvidiaOps.ced_moe_route computes the logits of more rows than
    CED_ROUTE_LOGITS_SPLITK_MAX_ROWS with triton_router_logits (never in batch-invariant mode; off: the
    reference's path). The routing matches the reference's: compared by the float64 biased scores of what each side
    chose (a near tie may pick either expert) and by the chosen weights."""
    from deepinfer.backends.nvidia import ops as nv
    from deepinfer.backends.reference.ops import ReferenceOps

    limit = 5
    monkeypatch.setattr(nv, "CED_ROUTE_GEMV_MAX_ROWS", 0)
    monkeypatch.setattr(nv, "CED_ROUTE_LOGITS_GEMV_MAX_ROWS", 0)
    monkeypatch.setattr(nv, "CED_ROUTE_LOGITS_SPLITK_MAX_ROWS", limit)
    backend = nv.NvidiaOps(DEV)
    backend.batch_invariant = invariant
    g = gen(9)
    gate, bias = ced_router_case(g, DEV)
    d, k = gate.shape[1], 3
    for on in (True, False):
        monkeypatch.setattr(nv, "CED_ROUTE_LOGITS_TILED", on)
        for rows in (limit, limit + 1, 77):
            x = torch.randn(rows, d, generator=g).to(DEV, torch.bfloat16)
            before = backend.kernel_calls["router_logits"]
            w, ids = backend.ced_moe_route(x, gate, k, bias=bias, scaling=1.5)
            took = backend.kernel_calls["router_logits"] - before
            assert took == int(on and not invariant and rows > limit), (on, rows, invariant, took)
            assert_same_routing(x, gate, bias, (w, ids), ReferenceOps(DEV).ced_moe_route(x, gate, k, bias=bias,
                                                                                          scaling=1.5))


@gpu
def test_gpu_logits_at_the_bench_prefill_shape():
    """A 16K prefill's router at the CED bench config (2048 hidden, 32 experts) with the shipped launch, and the
    knobs' other tiles: the float64 bound, and the same bits for a row whatever tile holds it."""
    g = gen(3)
    x = torch.randn(16384, 2048, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(32, 2048, generator=g) * 2048 ** -0.5).to(DEV)
    out = trl.logits(x, w)
    torch.cuda.synchronize()
    check(out, x, w)
    for knobs in (dict(block_m=128), dict(block_m=32, block_k=128, num_warps=8)):
        check(trl.logits(x, w, **knobs), x, w)


_COMPILE_SCRIPT = r'''
import json
from deepinfer.backends.nvidia import triton_router_logits as trl
from deepinfer.testing.kernels import compile_sm90, sass_row

report = {}
sig = dict(x_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32", M="i32", N="i32", K="i32", stride_xm="i32",
           stride_wn="i32", stride_om="i32")
for bm in (64, 128):
    k = compile_sm90(trl._logits_kernel, sig, dict(BLOCK_M=bm, BLOCK_N=32, BLOCK_K=trl.BLOCK_K,
                                                   K_STEPS=2048 // trl.BLOCK_K, PDL=2),
                     ("stride_xm", "stride_wn", "stride_om", "K"), num_warps=trl.NUM_WARPS,
                     num_stages=trl.NUM_STAGES, launch_pdl=True)
    report[f"logits_m{bm}"] = sass_row(k, r"\b(HMMA|HGMMA|STL|LDL)\b", smem=k.metadata.shared)
print(json.dumps(report))
'''


def test_logits_kernel_compiles_for_hopper():
    """The compiled path CPU CI never runs: the kernel builds for sm_90 at the shipped tiles; where cuobjdump
    exists, its products on the tensor cores and no local-memory spills."""
    from deepinfer.testing.kernels import run_compile_script

    report = run_compile_script(_COMPILE_SCRIPT)
    assert set(report) == {"logits_m64", "logits_m128"}
    for name, row in report.items():
        assert row["smem"] <= 227 * 1024, (name, row)
        sass = row.get("sass")
        if sass is None:
            continue  # no cuobjdump in this triton install
        assert sass.get("HMMA", 0) + sass.get("HGMMA", 0) > 0, (name, sass)
        assert sass.get("STL", 0) == 0 and sass.get("LDL", 0) == 0, f"{name}: local-memory spills: {sass}"
