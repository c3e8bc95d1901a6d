"""The TileLang kernels (tilelang_ced_attention, tilelang_mla) against the reference ops, and the nvidia backend's
per-op choice between them and the Triton kernels (kernel_choice).

GPU tests (skipped without CUDA, or without tilelang): each kernel matches the reference op on hypothesis-drawn
runtime shapes (rows, positions, cuts, windows, selections, context lengths, splits) for a few compile-time
configs (each compiles a direct and a split kernel, so the set stays small), at the bench shapes (the CED bench
config; DeepSeek-V3's MLA), with every cache row, ring slot and scale no query may read poisoned with NaN, and
inside a CUDA graph. Bounds: ||out - ref|| / ||ref|| < 1e-2 in bf16/fp16 and every element within 4e-2 of the
reference's largest magnitude.

CPU tests: the choice logic (defaults, environment overrides, fallback to Triton without tilelang or off CUDA),
the supports predicates, importing the modules without tilelang, and, where tilelang and nvcc are installed, a
build of the bench kernels for sm_90a (no GPU needed) with ptxas' register and spill report.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.backends.nvidia import kernel_choice, tilelang_common
from deepinfer.testing.attention_cases import ced_attention_case, mla_decode_case
from deepinfer.testing.kernels import HAS_CUDA, capture_graph, examples, rel_err
from deepinfer.testing.strategies import ced_attention_rows

HAS_TILELANG = tilelang_common.importable()
gpu_tilelang = [pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"),
                pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang (the nvidia extra; on the device "
                                                            "scripts/device_tilelang.sh installs it)")]
FP4 = ("fp4_e2m1_e4m3", "mxfp4")
CED_ENV, MLA_ENV = kernel_choice.ENV["ced_sparse_attention"], kernel_choice.ENV["mla_decode"]


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-2) -> None:
    """rel_err below ``rel`` (NaN-checked) and every element within 4 rel of the reference's largest magnitude."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < rel
    worst = float((out.double() - ref.double()).abs().max()) if out.numel() else 0.0
    assert worst <= 4 * rel * float(ref.double().abs().max().clamp_min(1e-30))


def _mark(*marks):
    def deco(fn):
        for m in reversed(marks):
            fn = m(fn)
        return fn
    return deco


# ------------------------------------------------------------------------------------------- CED sparse attention
CED_CONFIGS = [  # compile-time: (entry format, dtype, heads, latent dim, sinks)
    ("fp4_e2m1_e4m3", torch.bfloat16, 16, 512, True),  # the bench config
    ("mxfp4", torch.bfloat16, 16, 512, True),
    ("fp4_e2m1_e4m3", torch.float16, 4, 64, False),  # padded heads, a narrow latent, no sink
]


def ced_reference(args, kw):
    from deepinfer.backends.reference.ops import ReferenceOps

    return ReferenceOps(args[0].device).ced_sparse_attention(*args, **kw)


@_mark(*gpu_tilelang)
@pytest.mark.parametrize("config", CED_CONFIGS, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-H{c[2]}-D{c[3]}")
@examples(6)
@given(rows=ced_attention_rows(max_lo=300), W=st.integers(1, 70), allowance=st.integers(0, 12),
       K=st.integers(1, 80), splits=st.sampled_from([None, 1, 3]), seed=st.integers(0, 2**16))
def test_ced_attention_matches_reference(config, rows, W, allowance, K, splits, seed):
    from deepinfer.backends.nvidia import tilelang_ced_attention as lca

    fmt, dtype, H, D, sinks = config
    args, kw = ced_attention_case(rows, window=W, ring_size=W + allowance, heads=H, dim=D, topk=K, fmt=fmt,
                                  dtype=dtype, sinks=sinks, seed=seed, device="cuda")
    assert lca.supports(*args, kw["ring_fmt"], fmt, kw["sinks"])
    assert_close(lca.sparse_attention(*args, num_splits=splits, **kw), ced_reference(args, kw))


def bench_ced():
    from deepinfer.models.ced.config import SIZES, CEDConfig

    return CEDConfig(**SIZES["bench"])  # what `deepinfer init-model --arch ced --size bench` builds


@_mark(*gpu_tilelang)
@pytest.mark.parametrize("fmt", FP4)
def test_ced_attention_bench_shapes(fmt):
    """The bench config (16 heads x 512, window 128, ring 140, top-K 512): 48 decode rows, a 300-token chunk
    after a cached prefix with the replay cut 128 before it, two decode rows; auto, one and seven splits; and a
    SWA-only layer (no global branch)."""
    from deepinfer.backends.nvidia import tilelang_ced_attention as lca

    c = bench_ced()
    g = torch.Generator().manual_seed(1)
    decode = [(int(p), 1, 0) for p in torch.randint(c.n_win, 6000, (48,), generator=g)]
    for i, rows in enumerate((decode, [(700, 300, 572)], decode[:2])):
        args, kw = ced_attention_case(rows, window=c.n_win, ring_size=c.n_win + c.swa_allowance, heads=c.num_heads,
                                      dim=c.head_dim, topk=c.index_topk, fmt=fmt, dtype=torch.bfloat16,
                                      sinks=c.use_sink, seed=i, device="cuda", n_entries=4096)
        want = ced_reference(args, kw)
        for splits in (None, 1, 7):
            assert_close(lca.sparse_attention(*args, num_splits=splits, **kw), want)
        swa = (*args[:3], None, args[4][:, :0])
        assert_close(lca.sparse_attention(*swa, **kw), ced_reference(swa, kw))


@_mark(*gpu_tilelang)
def test_ced_attention_in_cuda_graph():
    """Splits from shapes only and no host sync: capture once, replay with new queries, positions and selections,
    each replay checked against the reference on its own inputs."""
    from deepinfer.backends.nvidia import tilelang_ced_attention as lca

    c = bench_ced()
    rows = [(int(p), 1, 0) for p in torch.randint(c.n_win + 12, 3000, (8,), generator=torch.Generator().manual_seed(2))]
    args, kw = ced_attention_case(rows, window=c.n_win, ring_size=c.n_win + c.swa_allowance, heads=c.num_heads,
                                  dim=c.head_dim, topk=c.index_topk, fmt="fp4_e2m1_e4m3", dtype=torch.bfloat16,
                                  sinks=True, seed=3, device="cuda", poison=False)
    q, kv, ring, entries, sel = (a.clone() if torch.is_tensor(a) else a for a in args)
    moving = {k: kw[k].clone() for k in ("pos", "fresh_lo")}
    fixed = {k: v for k, v in kw.items() if k not in moving}

    def run():
        return lca.sparse_attention(q, kv, ring, entries, sel, **moving, **fixed)

    graph, out = capture_graph(run)
    seen = []
    for i, shift in enumerate((0, -5, -12)):  # older positions: the window reads more of the ring
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(10 + i)).to(q))
        moving["pos"].copy_(kw["pos"] + shift)
        moving["fresh_lo"].copy_(kw["fresh_lo"] + shift)
        sel.copy_(args[4].roll(i + 1, dims=0))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, ced_reference((q, kv, ring, entries, sel), {**moving, **fixed}))
        seen.append(out.clone())
    assert all(not torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1:]), "replays gave the same"


@_mark(*gpu_tilelang)
def test_ced_attention_dispatch(monkeypatch):
    """NvidiaOps runs the TileLang kernel when the choice says so and it supports the inputs, Triton otherwise."""
    from deepinfer.backends.nvidia.ops import NvidiaOps

    args, kw = ced_attention_case([(9, 3, 2), (200, 1, 0)], window=16, ring_size=20, heads=16, dim=512, topk=8,
                                  fmt="mxfp4", dtype=torch.bfloat16, sinks=True, seed=4, device="cuda")
    want = ced_reference(args, kw)
    for impl, tilelang_calls in (("tilelang", 1), ("triton", 0)):
        monkeypatch.setenv(CED_ENV, impl)
        ops = NvidiaOps("cuda")
        assert_close(ops.ced_sparse_attention(*args, **kw), want)
        assert ops.kernel_calls["ced_sparse_attention"] == 1
        assert ops.kernel_calls["ced_sparse_attention:tilelang"] == tilelang_calls
    monkeypatch.setenv(CED_ENV, "tilelang")  # float32: not a TileLang dtype, so Triton serves it
    args32 = (args[0].float(), args[1].float(), *args[2:])
    ops = NvidiaOps("cuda")
    ops.ced_sparse_attention(*args32, **kw)
    assert ops.kernel_calls["ced_sparse_attention"] == 1 and ops.kernel_calls["ced_sparse_attention:tilelang"] == 0


# ------------------------------------------------------------------------------------------- MLA decode
MLA_CONFIGS = [  # compile-time: (heads, rank, rope, dtype, block size, block table dtype, cache form)
    (16, 64, 32, torch.float16, 4, torch.int32, "2d"),
    (128, 512, 64, torch.bfloat16, 16, torch.int64, "3d"),  # DeepSeek-V3, the engine's block size
    (16, 128, 64, torch.bfloat16, 16, torch.int64, "strided"),
]


def mla_reference(q, clean, meta, r, scale):
    """The reference op as DeepseekAttention.absorbed calls it (V = the first r channels of the latent cache)."""
    from deepinfer.backends.reference.ops import ReferenceOps

    return ReferenceOps(q.device).paged_attention(q, clean, clean[..., :r], meta, scale)


def mla_reference_rows(q, clean, meta, r, scale, rows):
    """The reference op one row at a time (it materialises [B, H, r + rope, max_kv] float32)."""
    from deepinfer.backends.base import AttnMetadata

    out = []
    for b in rows:
        s = slice(b, b + 1)
        m = AttnMetadata(positions=meta.positions[s], slot_mapping=meta.slot_mapping[s], seq_lens=meta.seq_lens[s],
                         q_index=torch.zeros_like(meta.q_index[s]), q_valid=meta.q_valid[s],
                         kv_slots=meta.kv_slots[s], q_pos=meta.q_pos[s], block_table=meta.block_table[s],
                         block_size=meta.block_size)
        out.append(mla_reference(q[s], clean, m, r, scale)[0])
    return torch.stack(out)


def mla_run(q, cache, meta, r, scale, **kw):
    from deepinfer.backends.nvidia import tilelang_mla

    return tilelang_mla.mla_decode(q, cache, meta.block_table, meta.block_size, meta.seq_lens, scale, r, **kw)


@_mark(*gpu_tilelang)
@pytest.mark.parametrize("config", MLA_CONFIGS, ids=lambda c: f"H{c[0]}-r{c[1]}-rope{c[2]}-{str(c[3])[6:]}-{c[6]}")
@examples(6)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=4), extra_blocks=st.integers(0, 2),
       splits=st.sampled_from([None, 1, 3]), seed=st.integers(0, 2**16))
def test_mla_decode_matches_reference(config, lens, extra_blocks, splits, seed):
    from deepinfer.backends.nvidia import tilelang_mla

    H, r, rope, dtype, bs, bt_dtype, form = config
    q, cache, clean, meta = mla_decode_case(lens, block_size=bs, heads=H, rank=r, rope=rope, dtype=dtype, seed=seed,
                                            device="cuda", bt_dtype=bt_dtype, extra_blocks=extra_blocks, form=form)
    scale = (r + rope) ** -0.5
    assert tilelang_mla.supports(q, cache, meta.block_table, bs, r, meta.seq_lens)
    assert_close(mla_run(q, cache, meta, r, scale, num_splits=splits), mla_reference(q, clean, meta, r, scale))


@_mark(*gpu_tilelang)
def test_mla_decode_bench_shapes_and_empty_rows():
    """DeepSeek-V3 (128 heads, r = 512, rope = 64, block size 16) at 4K context and short rows, against the
    reference row by row; auto, one and eight splits. A row with seq_len 0 gives zeros."""
    q, cache, clean, meta = mla_decode_case([4096, 1000, 37, 1], block_size=16, heads=128, rank=512, rope=64,
                                            dtype=torch.bfloat16, seed=5, device="cuda")
    scale = 192 ** -0.5
    want = mla_reference_rows(q, clean, meta, 512, scale, range(4))
    for splits in (None, 1, 8):
        assert_close(mla_run(q, cache, meta, 512, scale, num_splits=splits), want)
    q, cache, clean, meta = mla_decode_case([0, 50], block_size=4, heads=16, rank=64, rope=32, dtype=torch.float16,
                                            seed=6, device="cuda", bt_dtype=torch.int32, form="2d")
    for splits in (1, 3):
        out = mla_run(q, cache, meta, 64, 0.1, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert_close(out[1:], mla_reference_rows(q, clean, meta, 64, 0.1, [1]))


@_mark(*gpu_tilelang)
def test_mla_decode_in_cuda_graph():
    q, cache, clean, meta = mla_decode_case([900, 2000, 64], block_size=16, heads=128, rank=512, rope=64,
                                            dtype=torch.bfloat16, seed=7, device="cuda", poison=False)
    lens = meta.seq_lens.clone()
    meta.seq_lens = lens

    def run():
        return mla_run(q, cache, meta, 512, 0.07)

    graph, out = capture_graph(run)
    for i, shrink in enumerate((0, 100, 500)):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(20 + i)).to(q))
        lens.copy_((torch.tensor([900, 2000, 64]) - torch.tensor([0, shrink, 0])).to(lens))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, mla_reference_rows(q, clean, meta, 512, 0.07, range(3)))


@_mark(*gpu_tilelang)
def test_mla_decode_dispatch(monkeypatch):
    from deepinfer.backends.nvidia.ops import NvidiaOps

    q, cache, clean, meta = mla_decode_case([70, 300], block_size=16, heads=16, rank=128, rope=64,
                                            dtype=torch.bfloat16, seed=8, device="cuda", form="strided")
    want = mla_reference(q, clean, meta, 128, 0.1)
    for impl, tilelang_calls in (("tilelang", 1), ("triton", 0)):
        monkeypatch.setenv(MLA_ENV, impl)
        ops = NvidiaOps("cuda")
        assert_close(ops.paged_attention(q, cache, cache[..., :128], meta, 0.1), want)
        assert ops.kernel_calls["mla_decode"] == 1 and ops.kernel_calls["mla_decode:tilelang"] == tilelang_calls


# ------------------------------------------------------------------------------------------- CPU: the choice
def test_choice_defaults_and_environment(monkeypatch):
    for op, var in kernel_choice.ENV.items():
        monkeypatch.delenv(var, raising=False)
        assert kernel_choice.requested(op) == kernel_choice.DEFAULT[op] in kernel_choice.IMPLS
        for impl in kernel_choice.IMPLS:
            monkeypatch.setenv(var, f" {impl.upper()} ")
            assert kernel_choice.requested(op) == impl
        monkeypatch.setenv(var, "cutlass")
        with pytest.raises(ValueError, match=f"{var}.*cutlass"):
            kernel_choice.requested(op)
        monkeypatch.setenv(var, "")
        assert kernel_choice.requested(op) == kernel_choice.DEFAULT[op]
    with pytest.raises(ValueError, match="op must be one of"):
        kernel_choice.requested("paged_attention")


def test_choice_falls_back_to_triton(monkeypatch):
    """'tilelang' is honoured only on CUDA tensors where tilelang imports; 'triton' never tries TileLang."""
    cuda = torch.device("cuda", 0)
    for op, var in kernel_choice.ENV.items():
        monkeypatch.setenv(var, "tilelang")
        monkeypatch.setattr(tilelang_common, "importable", lambda: True)
        assert kernel_choice.use_tilelang(op, cuda)
        assert not kernel_choice.use_tilelang(op, torch.device("cpu"))  # Triton's interpreter, not TileLang
        monkeypatch.setattr(tilelang_common, "importable", lambda: False)
        assert not kernel_choice.use_tilelang(op, cuda)
        monkeypatch.setenv(var, "triton")
        monkeypatch.setattr(tilelang_common, "importable", lambda: True)
        assert not kernel_choice.use_tilelang(op, cuda)


def test_modules_import_and_answer_supports_without_tilelang():
    """With tilelang unimportable the nvidia backend's TileLang modules still import, say whether they support
    inputs, and the choice falls back to Triton."""
    script = """
import sys, torch
sys.modules["tilelang"] = None  # import tilelang now raises ImportError
from deepinfer.backends.nvidia import kernel_choice, tilelang_ced_attention as lca, tilelang_mla as lma
from deepinfer.backends.nvidia import tilelang_common
from deepinfer.testing.attention_cases import ced_attention_case, mla_decode_case
args, kw = ced_attention_case([(9, 3, 2)], window=6, ring_size=8, heads=4, dim=64, topk=5, fmt="mxfp4",
                              dtype=torch.bfloat16, sinks=True)
q, cache, clean, meta = mla_decode_case([5, 9], block_size=4, heads=2, rank=64, rope=32, dtype=torch.bfloat16)
print(tilelang_common.importable(), lca.supports(*args, "fp8_e4m3_pow2", "mxfp4", kw["sinks"]),
      lma.supports(q, cache, meta.block_table, 4, 64, meta.seq_lens),
      kernel_choice.use_tilelang("mla_decode", torch.device("cuda", 0)), "tilelang" in sys.modules and
      sys.modules["tilelang"] is not None)
"""
    env = dict(os.environ, DEEPINFER_MLA_DECODE_IMPL="tilelang")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True", "True", "False", "False"]


def test_supports_refuses_what_the_kernels_do_not_take():
    from deepinfer.backends.nvidia import tilelang_ced_attention as lca, tilelang_mla as lma

    args, kw = ced_attention_case([(9, 3, 2)], window=6, ring_size=8, heads=4, dim=64, topk=5, fmt="fp4_e2m1_e4m3",
                                  dtype=torch.bfloat16, sinks=True)
    ok = lambda *a, fmt="fp4_e2m1_e4m3", ring_fmt="fp8_e4m3_pow2", sinks=kw["sinks"]: lca.supports(  # noqa: E731
        *a, ring_fmt, fmt, sinks)
    assert ok(*args) and ok(*args[:3], None, args[4][:, :0])
    assert not ok(args[0].float(), args[1].float(), *args[2:])  # float32: Triton's
    assert not ok(*args, ring_fmt="fp32") and not ok(*args, fmt="fp8_e4m3_pow2")
    assert not ok(args[0][..., :32].contiguous(), args[1][:, :32].contiguous(), *args[2:])  # D % 64
    assert not ok(*args, sinks=torch.zeros(3))
    raw = torch.zeros(args[3][0].shape[0], 2 * 64, dtype=torch.uint8)  # raw bf16 entries: Triton's only
    assert not ok(*args[:3], (raw, None), args[4], fmt="bf16")
    q, cache, clean, meta = mla_decode_case([5, 9], block_size=4, heads=2, rank=64, rope=32, dtype=torch.bfloat16)
    bt = meta.block_table
    assert lma.supports(q, cache, bt, 4, 64, meta.seq_lens)
    assert not lma.supports(q.float(), cache.float(), bt, 4, 64)
    assert not lma.supports(q, cache, bt, 4, 48)  # r % 64
    assert not lma.supports(q, cache, bt.float(), 4, 64) and not lma.supports(q, cache, None, 4, 64)
    assert not lma.supports(q, cache[:, :, 1:], bt, 4, 64)  # rows not 16-byte aligned, shape off


@pytest.mark.skipif(not HAS_TILELANG or shutil.which("nvcc") is None, reason="needs tilelang and nvcc")
def test_bench_kernels_compile_for_sm90():
    """TileLang lowers the bench configs and nvcc builds them for sm_90a without a GPU: the CED kernel (split,
    FP4 entries, sinks) with no spills and tensor-core MMAs, the MLA kernel (split, DeepSeek-V3) with wgmma,
    cp.async and at most a few hundred bytes spilled, and the merge kernel; TileLang finds no buffer read before
    it is written (a statement that never reached the kernel)."""
    script = r"""
import json, os, re, subprocess, tempfile, torch
os.environ["DEEPINFER_TILELANG_ARCH"] = "sm_90a"
from tilelang.contrib.nvcc import default_compile_options
from deepinfer.backends.nvidia import tilelang_ced_attention as lca, tilelang_mla as lma, tilelang_common as tlc
def ptxas(src):
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "k.cu"), "w") as f:
        f.write(src)
    p = subprocess.run(["nvcc", "-cubin", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-w",
                        *default_compile_options(), "-o", os.path.join(d, "k.cubin"), os.path.join(d, "k.cu")],
                       capture_output=True, text=True)
    log = p.stdout + p.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {"rc": p.returncode, "regs": int(regs.group(1)) if regs else None,
            "spill": int(spill.group(1)) if spill else None, "mma": "mma_sync" in src or "wgmma" in src,
            "wgmma": "wgmma" in src, "cp_async": "cp_async" in src}
ced = lca.kernel_for(16, 512, torch.bfloat16, "fp4_e2m1_e4m3", True, torch.float32, False)
mla = lma.kernel_for(128, 512, 64, torch.bfloat16, 16, 576, torch.int64, torch.int64, False)
merge = tlc.compile_kernel(tlc.merge_builder(128, 512, "bfloat16", False), ("merge", 128, 512, "bfloat16", False,
                                                                                    "float32"))
print(json.dumps({name: ptxas(k.get_kernel_source()) for name, k in (("ced", ced), ("mla", mla), ("merge", merge))}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "read before initialization" not in proc.stderr, proc.stderr[-3000:]  # TileLang's buffer-init check
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["rc"] == 0 for r in rep.values()), rep
    assert rep["ced"]["mma"] and rep["ced"]["spill"] == 0, rep
    assert rep["mla"]["wgmma"] and rep["mla"]["cp_async"] and rep["mla"]["spill"] <= 256, rep
    assert rep["merge"]["spill"] == 0, rep
