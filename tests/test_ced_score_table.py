"""The CED indexer's scores over a decoded key table (triton_ced_scores) against the reference op.

The oracle is ReferenceOps.ced_indexer_topk (float32 einsum over the dequantised keys, select_topk), which
shares no code with the kernel. Through the interpreter on the CPU (tiny shapes, runs of key tiles split over
several programs, blocks within one sequence and across sequences, queries with nothing visible); with CUDA the
bench config's shape too, and the compiled build for sm_90.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import DEV, examples, gen, gpu, run_compile_script, skip_module_without_kernels

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_ced_indexer as tci, triton_ced_scores as tcs  # noqa: E402
from deepinfer.backends.nvidia.ops import NvidiaOps  # noqa: E402
from test_triton_ced import FP4, check_indexer_against_reference, indexer_case  # noqa: E402


@examples(12)
@given(row_js=st.lists(st.integers(0, 70), min_size=1, max_size=3), nh=st.integers(1, 4),
       fmt=st.sampled_from(FP4), block_q=st.sampled_from([2, 4, 8]), block_j=st.sampled_from([16, 32]),
       per_sm=st.sampled_from([1, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       with_allowed=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_table_scores_match_reference(row_js, nh, fmt, block_q, block_j, per_sm, dtype, with_allowed, seed, data):
    """Scores and selections as the reference's, whatever the blocking: BLOCK_Q queries a program (blocks inside
    one sequence, across sequences, the last partial one), BLOCK_J keys a tile, the key tiles of a block in one
    run or split over many programs (PROGRAMS_PER_SM), keys never visible to anyone past the last run's end."""
    queries = data.draw(st.lists(st.integers(1, 9), min_size=len(row_js), max_size=len(row_js)))
    args, allowed = indexer_case(gen(seed), row_js, queries, nh, 32, fmt, dtype, data.draw(st.booleans()),
                                 with_allowed)
    q, w, (codes, scales), *rest = args
    k = data.draw(st.integers(1, 12))
    was, tcs.PROGRAMS_PER_SM = tcs.PROGRAMS_PER_SM, per_sm
    try:
        ids, scores = tci.indexer_topk(q, w, codes, scales, *rest, k, allowed=allowed, return_scores=True,
                                       table=True, launch=dict(BLOCK_Q=block_q, BLOCK_J=block_j))
    finally:
        tcs.PROGRAMS_PER_SM = was
    check_indexer_against_reference(ids, scores, args, k, allowed)


def test_table_taken_where_wanted(monkeypatch):
    """With TABLE on, a prefill-sized call (64 queries or more, each table row read READS times) scores through
    the table and a decode-sized one does not; with it off neither does. Either way the reference's result."""
    calls = []
    real = tcs.scores
    monkeypatch.setattr(tcs, "scores", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    ops = NvidiaOps(DEV)
    for on in (True, False):
        monkeypatch.setattr(tcs, "TABLE", on)
        calls.clear()
        for queries in ([70], [3]):
            args, _ = indexer_case(gen(5), [6], queries, 2, 32, "mxfp4", torch.bfloat16, False, False)
            ids, scores = ops.ced_indexer_topk(*args, 4, return_scores=True)
            check_indexer_against_reference(ids, scores, args, 4)
        assert calls == ([70] if on else []), (on, calls)
    monkeypatch.setattr(tcs, "TABLE", True)
    monkeypatch.setattr(tcs, "MAX_BYTES", 6 * 32 * 2 - 1)  # the 6-row table of 32 bf16 channels no longer fits
    calls.clear()
    args, _ = indexer_case(gen(5), [6], [70], 2, 32, "mxfp4", torch.bfloat16, False, False)
    ops.ced_indexer_topk(*args, 4)
    assert calls == []
    monkeypatch.setattr(tcs, "MAX_BYTES", 1 << 30)
    monkeypatch.setattr(tcs, "MAX_HEAD_DIM", 16)  # index heads wider than the table takes
    ops.ced_indexer_topk(*args, 4)
    assert calls == []


def test_table_refuses_bad_launch_overrides():
    args, _ = indexer_case(gen(3), [12], [70], 2, 32, "mxfp4", torch.float32, False, False)
    q, w, (codes, scales), *rest = args
    for launch, msg in ((dict(BLOCK_Q=3), "BLOCK_Q must be a power of two"), (dict(TILE=4), r"unknown keys \['TILE'\]"),
                        (dict(num_stages=0), r"num_stages must be .*\[1, 4\]")):
        with pytest.raises(ValueError, match=msg):
            tci.indexer_topk(q, w, codes, scales, *rest, 3, launch=launch, table=True)


@gpu
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_table_at_the_bench_shape(fmt):
    """A 2048-query prefill chunk of the bench config's indexer (16 heads x 128) ending at 8K, over a sequence of
    4096 entries in a slot table wider than that (the runs past every visible key store -inf): the table's scores
    and sets, and the FP4 kernel's, each as the reference's."""
    from deepinfer.backends.reference import lowbit

    g = gen(11)
    J, chunk, ctx = 4096, 2048, 8192
    codes, scales = lowbit.quantize(torch.randn(J, 128, generator=g), fmt)
    slots = torch.cat([torch.randperm(J, generator=g), torch.zeros(1000, dtype=torch.long)])[None, :]
    q = torch.randn(chunk, 16, 128, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(chunk, 16, generator=g).to(DEV, torch.bfloat16)
    nvis = ((torch.arange(ctx - chunk, ctx) + 1) // 2).to(DEV)
    args = (q, w, (codes.to(DEV), scales.to(DEV)), fmt, slots.to(DEV), torch.zeros(chunk, dtype=torch.long,
                                                                                   device=DEV), nvis)
    for table in (True, False):
        ids, scores = tci.indexer_topk(q, w, *args[2], *args[3:], 512, return_scores=True, table=table)
        check_indexer_against_reference(ids, scores, args, 512)


_COMPILE_SCRIPT = r'''
import json
from deepinfer.backends.nvidia import triton_ced_scores as tcs
from deepinfer.testing.kernels import compile_sm90, sass_row

report = {}
sig = dict(q_ptr="*bf16", w_ptr="*bf16", table_ptr="*bf16", rows_ptr="*i64", nvis_ptr="*i64", out_ptr="*fp32",
           stride_qt="i32", stride_qh="i32", stride_wt="i32", stride_wh="i32", stride_k="i32", stride_ot="i32",
           Tq="i32", NH="i32", DH="i32", J="i32", TILES_PER="i32")
cfg = tcs.launch_config(16, 128)
k = compile_sm90(tcs._table_scores_kernel, sig,
                 dict(BLOCK_Q=cfg["BLOCK_Q"], BLOCK_H=cfg["BLOCK_H"], BLOCK_D=cfg["BLOCK_D"], BLOCK_J=64,
                      STAGES=cfg["num_stages"], DOT_PRECISION="tf32", INTERP=False, INTERP_TILES=0, PDL=2),
                 ("stride_qt", "stride_k", "stride_ot", "DH", "J", "stride_wt", "stride_qh"),
                 num_warps=cfg["num_warps"], launch_pdl=True)
report["table"] = sass_row(k, r"\b(HGMMA|LDGSTS|STL|LDL)\b", smem=k.metadata.shared)
# The table's decode: the dequantiser gathering its rows through the slot table (GATHER), as key_table launches it.
import torch
from deepinfer.backends.nvidia import triton_fp4
fast = triton_fp4.fast_decode(torch.bfloat16, 4 * 32 // 2, 1)
k = compile_sm90(triton_fp4._dequant_kernel,
                 dict(codes_ptr="*u8", scales_ptr="*u8", out_ptr="*bf16", src_ptr="*i64", stride_c="i32",
                      stride_s="i32", stride_o="i32", M="i32", NG="i32"),
                 dict(BLOCK_G=4, GROUP=32, E8M0=True, FAST=fast, ROWS=1, GATHER=True), num_warps=1)
report["gather"] = sass_row(k, r"\b(STL|LDL)\b", smem=k.metadata.shared)
print(json.dumps(report))
'''


def test_table_kernel_compiles_for_hopper():
    """The compiled path CPU CI never runs: the bench shape's launch builds for sm_90; where cuobjdump exists,
    its products on warp-group MMAs, its key tiles copied asynchronously (the pipeline), and no spills; the
    table's gathered decode builds too."""
    report = run_compile_script(_COMPILE_SCRIPT)
    assert report["gather"].get("sass", {}).get("STL", 0) == 0, report["gather"]
    row = report["table"]
    assert row["smem"] <= 227 * 1024, row
    sass = row.get("sass")
    if sass is not None:
        assert sass.get("HGMMA", 0) > 0 and sass.get("LDGSTS", 0) > 0, sass
        assert sass.get("STL", 0) == 0 and sass.get("LDL", 0) == 0, sass
