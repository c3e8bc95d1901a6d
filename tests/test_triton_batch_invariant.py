"""The batch-invariant Triton kernels (backends/nvidia/triton_batch_invariant.py) against torch, and their
invariance: a row's result is the same bits alone, at any position, in a batch of any size.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py) on small
shapes: the invariance holds there by construction of the loops (the same program walks the same chunks), the
values meet torch's within float tolerance. The GPU tests (marked gpu) check the compiled kernels, and the
CUDA overrides installed by ``batch_invariant("cuda")`` on a Llama-sized linear, where cuBLAS alone is not
invariant (the negative control).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import DEV, HAS_CUDA, examples, gen, gpu, skip_module_without_kernels

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_batch_invariant as tbi  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)
FAST = examples(25)


def _tol(dtype, K, scale):
    return (4e-6 if dtype == torch.float32 else 2e-2) * max(K, 1) ** 0.5 * scale


@FAST
@given(B=st.integers(0, 2), M=st.integers(1, 20), K=st.integers(1, 40), N=st.integers(1, 20),
       dtype=st.sampled_from(DTYPES), bias=st.sampled_from([None, "row", "full"]), transposed=st.booleans(),
       seed=st.integers(0, 2**16), data=st.data())
def test_matmul_matches_torch_and_is_row_invariant(B, M, K, N, dtype, bias, transposed, seed, data):
    g = gen(seed)
    a = torch.randn(max(B, 1), M, K, generator=g).to(DEV, dtype)
    b = torch.randn(max(B, 1), N, K, generator=g).to(DEV, dtype).transpose(1, 2)  # F.linear's weight.t()
    if not transposed:
        b = b.contiguous()
    x = None if bias is None else torch.randn(N if bias == "row" else (M, N), generator=g).to(DEV, dtype)
    if B == 0:
        a, b = a[0], b[0]
    out = tbi.matmul(a, b, x, alpha=1.0, beta=1.0)
    ref = (a.double() @ b.double()) + (0 if x is None else x.double())
    scale = float(a.abs().max() * b.abs().max()) + (0 if x is None else float(x.abs().max()))
    assert out.dtype == dtype and out.shape == ref.shape
    assert float((out.double() - ref).abs().max()) <= _tol(dtype, K, scale) * 4
    i = data.draw(st.integers(0, M - 1), label="row")
    a1 = a[..., i:i + 1, :].clone()
    x1 = None if x is None or bias == "row" else x[i:i + 1]
    one = tbi.matmul(a1, b, x if bias == "row" else x1)
    assert torch.equal(one, out[..., i:i + 1, :])


@FAST
@given(K=st.integers(1, 1 << 16), N=st.integers(1, 1 << 17), nb=st.integers(1, 16), dtype=st.sampled_from(DTYPES))
def test_k_splits_cover_the_reduction_once(K, N, nb, dtype):
    S, per = tbi.k_splits(dtype, K, N, nb)
    kb = -(-K // (tbi.INTERP_MM if tbi.INTERPRET else tbi.MM_CONFIG[dtype])["BLOCK_K"])
    assert S >= 1 and (S - 1) * per < kb <= S * per  # every k-block in exactly one split, none empty
    assert S == 1 or per >= tbi.SPLIT_MIN_KB


@FAST
@given(kb=st.integers(2, 4), cut=st.integers(0, 15), N=st.integers(1, 16), m=st.integers(1, 8),
       dtype=st.sampled_from(DTYPES), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_split_partials_and_one_program_give_the_same_bits(kb, cut, N, m, dtype, bias, seed):
    """A split product's few rows (a program per split, partials summed by the combine kernel) and many rows
    (one program walking the splits) are the same bits row for row."""
    block_k = (tbi.INTERP_MM if tbi.INTERPRET else tbi.MM_CONFIG[dtype])["BLOCK_K"]
    K = kb * tbi.SPLIT_MIN_KB * block_k - cut % block_k  # 2-4 splits' worth of k-blocks, the last one ragged
    assert tbi.k_splits(dtype, K, N)[0] > 1
    g = gen(seed)
    a = torch.randn(3 * tbi.SPLIT_ROWS, K, generator=g).to(DEV, dtype)
    w = torch.randn(N, K, generator=g).to(DEV, dtype)
    x = torch.randn(N, generator=g).to(DEV, dtype) if bias else None
    many = tbi.matmul(a, w.t(), x, alpha=0.5)
    assert torch.equal(tbi.matmul(a[:m], w.t(), x, alpha=0.5), many[:m])
    ref = 0.5 * (a.double() @ w.double().t()) + (0 if x is None else x.double())
    scale = float(a.abs().max() * w.abs().max()) + (0 if x is None else float(x.abs().max()))
    assert float((many.double() - ref).abs().max()) <= _tol(dtype, K, scale) * 4


@FAST
@given(R=st.integers(1, 6), n=st.integers(1, 40), dtype=st.sampled_from(DTYPES), mean=st.booleans(),
       last=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_row_reductions_match_torch_and_are_row_invariant(R, n, dtype, mean, last, seed, data):
    x = (torch.randn(R, n, generator=gen(seed)) * 3).to(DEV, dtype)
    xin = x if last else x.t().contiguous()  # reduce the last dim, or dim 0 of the transpose
    dim = -1 if last else 0
    f = tbi.row_mean if mean else tbi.row_sum
    out = f(xin, [dim])
    ref = (xin.double().mean(dim) if mean else xin.double().sum(dim))
    assert out.dtype == dtype and out.shape == ref.shape
    assert float((out.double() - ref).abs().max()) <= _tol(dtype, n, 3.0 * (1 if mean else n ** 0.5)) * 4
    i = data.draw(st.integers(0, R - 1), label="row")
    one = f(x[i:i + 1], [-1], keepdim=True)
    assert torch.equal(one[0, 0], f(x, [-1])[i])


@FAST
@given(O=st.integers(1, 4), n=st.integers(1, 12), I=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
       mean=st.booleans(), keepdim=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**16),
       data=st.data())
def test_middle_dim_reductions_match_torch_and_are_invariant(O, n, I, dtype, mean, keepdim, strided, seed, data):
    """A reduction over one dim that is not the last (CED's compression over a group, the indexer's sum over
    heads): summed where it lies; an element's bits do not depend on how many rows or columns surround it."""
    x = (torch.randn(O, I, n, generator=gen(seed)) * 3).to(DEV, dtype).transpose(1, 2)  # [O, n, I], strided
    if not strided:
        x = x.contiguous()
    f = tbi.row_mean if mean else tbi.row_sum
    out = f(x, [1], keepdim=keepdim)
    ref = x.double().mean(1, keepdim=keepdim) if mean else x.double().sum(1, keepdim=keepdim)
    assert out.dtype == dtype and out.shape == ref.shape
    assert float((out.double() - ref).abs().max()) <= _tol(dtype, n, 3.0 * (1 if mean else n ** 0.5)) * 4
    o = data.draw(st.integers(0, O - 1), label="row")
    c = data.draw(st.integers(0, I - 1), label="column")
    flat = out if not keepdim else out[:, 0]
    assert torch.equal(f(x[o:o + 1, :, c:c + 1].clone(), [1])[0, 0], flat[o, c])


@FAST
@given(R=st.integers(1, 5), n=st.integers(1, 40), dtype=st.sampled_from(DTYPES), log=st.booleans(),
       half_to_float=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_softmax_matches_torch_and_is_row_invariant(R, n, dtype, log, half_to_float, seed, data):
    half_to_float = half_to_float and dtype != torch.float32
    x = (torch.randn(R, n, generator=gen(seed)) * 4).to(DEV, dtype)
    f = tbi.log_softmax if log else tbi.softmax
    out = f(x, -1, half_to_float)
    ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    assert out.dtype == (torch.float32 if half_to_float else dtype)
    tol = 1e-5 if out.dtype == torch.float32 else 2e-2
    assert float((out.double() - ref).abs().max()) <= tol * (1 + float(ref.abs().max()))
    i = data.draw(st.integers(0, R - 1), label="row")
    assert torch.equal(f(x[i:i + 1].clone(), -1, half_to_float)[0], out[i])
    # a non-last dim: the same rows, transposed
    assert torch.equal(f(x.t().contiguous(), 0, half_to_float).t(), out)


def test_fallbacks_for_what_the_kernels_do_not_cover():
    ints = torch.arange(12, device=DEV).view(3, 4)
    assert torch.equal(tbi.row_sum(ints, [1]), ints.sum(1))
    d = torch.randn(3, 4, dtype=torch.float64, device=DEV)
    assert torch.equal(tbi.row_mean(d, [1]), d.mean(1))
    assert torch.equal(tbi.softmax(d, 1), torch.softmax(d, 1))
    assert tbi.row_sum(torch.zeros(0, 3, device=DEV), [1]).shape == (0,)
    assert set(tbi.cuda_impls()) >= {"mm", "addmm", "bmm", "mean.dim", "_log_softmax"}


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_overrides_make_a_llama_linear_batch_invariant():
    """Llama-3.1-8B's MLP projections (up 4096 -> 14336 and down 14336 -> 4096, bf16): under
    batch_invariant("cuda") row 0 of a batch of 1..256 rows is the same bits; with cuBLAS alone it is not for at
    least one of them (the negative control: on the H200 the up projection happened to be invariant, the long
    reduction of the down projection is where cuBLAS splits K for few rows)."""
    from deepinfer.backends.batch_invariant import batch_invariant

    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for k, n in ((4096, 14336), (14336, 4096)):
        x = torch.randn(256, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        cases.append((x, w))

    def rows0(x, w):
        return [torch.nn.functional.linear(x[:m], w)[0] for m in (1, 3, 16, 64, 129, 256)]

    plain = [rows0(x, w) for x, w in cases]
    x = cases[0][0]
    with batch_invariant("cuda"):
        inv = [rows0(x, w) for x, w in cases]
        sm = [torch.softmax(x[:m].float(), -1)[0] for m in (1, 7, 256)]
        mn = [x[:m].float().pow(2).mean(-1)[0] for m in (1, 7, 256)]
    assert all(torch.equal(r, rows[0]) for rows in inv for r in rows)
    assert all(torch.equal(r, sm[0]) for r in sm) and all(torch.equal(r, mn[0]) for r in mn)
    assert any(not torch.equal(r, rows[0]) for rows in plain for r in rows), \
        "cuBLAS was invariant for both projections: the control proves nothing"


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tile_bands_give_the_same_bits(dtype):
    """The 16-bit matmul's tile width and pipeline depth follow M (a decode band up to DECODE_ROWS rows, wide
    tiles above), and split products run as partials (few rows) or one walk (many); the reduction does not
    follow M, so rows computed in either band are the same bits. Shapes: each
    DECODE_TILES width class at Llama-3.1-8B sizes, an LM head, and odd sizes that mask every tile edge."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for k, n in ((4096, 4096), (14336, 4096), (4096, 6144), (4096, 28672), (4096, 128256), (1000, 999), (72, 40),
                 (2048, 32), (2048, 16), (8192, 2048), (1024, 8192), (2048, 512), (5000, 24)):  # CED's, split K
        x = torch.randn(3 * tbi.DECODE_ROWS, k, device="cuda", generator=g).to(dtype)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
        wide = tbi.matmul(x, w.t())
        for m in (1, 5, tbi.DECODE_ROWS):
            assert torch.equal(tbi.matmul(x[:m], w.t()), wide[:m]), (k, n, m)
    # a grouped bmm (CED's output groups): the splits count the groups' programs too
    x = torch.randn(8, 3 * tbi.DECODE_ROWS, 1024, device="cuda", generator=g).to(dtype)
    w = (torch.randn(8, 1024, 1024, device="cuda", generator=g) / 32).to(dtype)
    wide = tbi.matmul(x, w)
    for m in (1, 7, tbi.DECODE_ROWS):
        assert torch.equal(tbi.matmul(x[:, :m].contiguous(), w), wide[:, :m]), ("bmm", m)


_COMPILE_SCRIPT = r'''
import json
from deepinfer.backends.nvidia import triton_batch_invariant as tbi
from deepinfer.testing.kernels import compile_sm90

assert not tbi.INTERPRET
report = {}
mm_ints = "M N K KB S s_ab s_am s_ak s_bb s_bk s_bn s_cb s_cm s_cn s_xb s_xm s_xn"
for dt, name in (("bf16", "bfloat16"), ("fp32", "float32")):
    import torch
    p = "*" + dt
    for (N, M, bias, mode) in ((4096, 1, False, 0), (16384, 1, False, 1), (4096, 4096, True, 2)):
        cfg = tbi.mm_config(getattr(torch, name), N, M)
        flags = dict(HAS_BIAS=bias, SCALED=False, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"])
        k = compile_sm90(tbi._mm_kernel, dict(a_ptr=p, b_ptr=p, c_ptr=p, bias_ptr=p, p_ptr="*fp32", alpha="fp32",
                                              beta="fp32", **{n: "i32" for n in mm_ints.split()}),
                         dict(**flags, BLOCK_K=cfg["BLOCK_K"], PRECISION="ieee" if dt == "fp32" else "tf32",
                              KB_PER=4, MODE=mode, KB_I=0),
                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        report[f"mm_{dt}_{N}_{M}_{bias}"] = cfg["BLOCK_N"]
    k = compile_sm90(tbi._mm_combine_kernel, dict(p_ptr="*fp32", c_ptr=p, bias_ptr=p, alpha="fp32", beta="fp32",
                                                  **{n: "i32" for n in "M N S s_cb s_cm s_cn s_xb s_xm s_xn".split()}),
                     dict(**flags, S_I=0), num_warps=4)
    report[f"combine_{dt}"] = 0
    for n in (16, 4096):
        rows, lanes = tbi.row_block(n)
        k = compile_sm90(tbi._row_sum_kernel, dict(x_ptr=p, out_ptr=p, R="i32", N="i32", s_x="i32", scale="fp32"),
                         dict(ROWS=rows, BLOCK=lanes, N_I=0), num_warps=4)
        report[f"sum_{dt}_{n}"] = lanes
    k = compile_sm90(tbi._col_sum_kernel, dict(x_ptr=p, out_ptr=p, scale="fp32",
                                               **{n: "i32" for n in "N I s_o s_n s_i".split()}),
                     dict(BLOCK=tbi.COL_BLOCK, N_I=0), num_warps=4)
    report[f"colsum_{dt}"] = 0
    for log in (False, True):
        k = compile_sm90(tbi._softmax_kernel, dict(x_ptr=p, out_ptr="*fp32", N="i32", s_x="i32", s_o="i32"),
                         dict(LOG=log, BLOCK=tbi.ROW_BLOCK, N_I=0), num_warps=4)
        report[f"softmax_{dt}_{log}"] = 0
print(json.dumps(report))
'''


def test_kernels_compile_for_hopper():
    """The compiled path (CPU CI never runs it): every kernel builds for sm_90 in bf16 and float32."""
    from deepinfer.testing.kernels import run_compile_script

    report = run_compile_script(_COMPILE_SCRIPT)
    assert len(report) == 2 * (3 + 1 + 2 + 1 + 2)
    assert report["mm_bf16_4096_1_False"] == 32 and report["mm_bf16_16384_1_False"] == 128
    assert report["mm_bf16_4096_4096_True"] == 128


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deterministic_recipe_on_the_nvidia_backend(dtype):
    """The guarantee on CUDA (the nvidia backend's invariant paths, CUDA graphs and overlap as the recipe sets
    them): the CED demo's target alone, among 1 and 127 random requests, chunked, with a prefix hit, seeded."""
    from deepinfer.testing.determinism import differing, scenario_outputs

    results = scenario_outputs("deterministic", dtype, device="cuda", others=((1, 127), (15,)))
    assert differing(results) == [], "the target's output changed with its batch on the nvidia backend"


@pytest.mark.skipif(HAS_CUDA, reason="the GPU test above runs the compiled kernels")
def test_nvidia_backend_invariant_paths_under_the_interpreter(tmp_path):
    """The nvidia backend's batch-invariant routing, on the CPU under Triton's interpreter (CPU matmuls from
    batch_invariant("cpu")): every attention call, decode rows included, goes to the paged prefill kernel, and a
    target gives the same bits alone and beside other requests."""
    pytest.importorskip("transformers")
    import random

    from deepinfer import SamplingParams
    from deepinfer.testing.determinism import output_of, run_among, scenario_llm, target_prompt
    from deepinfer.testing.models import build_tiny_hf_model

    build_tiny_hf_model(tmp_path, "llama", vocab_size=300)
    llm = scenario_llm("deterministic", "float32", "cpu", model=str(tmp_path), backend="nvidia")
    target = target_prompt(n=20, vocab=250)
    sp = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, ignore_eos=True)
    alone = output_of(llm.generate([target], sp, use_tqdm=False)[0])
    among = run_among(llm, target, sp, 2, 1, random.Random(0), 250, max_prompt=8, max_tokens=2)
    calls = llm.engine.ops.kernel_calls
    assert alone.same(among)
    assert calls["paged_attention:invariant"] == calls["paged_prefill"] > 0 and calls["paged_attention"] == 0
