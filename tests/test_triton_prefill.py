"""The ragged paged prefill kernel (triton_prefill.paged_prefill) against the reference op and a float64 oracle.

Without CUDA the kernel runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before any kernel
module is imported) on tiny batches built exactly as the engine builds them (core.inputs.build_inputs over
fake sequences on a shuffled block pool): prefill rows with and without a cached prefix, decode rows mixed in,
GQA/MQA, sliding windows, sinks, head dims that are not powers of two, Dv != D, MLA's strided value view. Cache
rows that no visible key uses are NaN in the kernel's caches, so a stray read shows. With CUDA the GPU-only
tests add realistic shapes (Llama-3.1-8B, DeepSeek MLA) in bf16, a 16K-token sequence against PyTorch's
SDPA, and CUDA-graph capture. A compile test (no GPU needed) builds the kernel for sm_90 at the shipped
configs and reads the SASS: tensor-core MMAs, and no local-memory spills inside the key loops.

Error bounds: float32 ||out - ref|| / ||ref|| < 1e-5 against the float64 oracle and elementwise close to the
reference op; bf16/fp16 < 1e-2.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import (DEV, capture_graph, examples, gen, gpu, rel_err, run_compile_script,
                                       skip_module_without_kernels)

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_prefill  # noqa: E402
from deepinfer.backends.nvidia.ops import INTERPRET, NvidiaOps  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402
from deepinfer.core.inputs import build_inputs  # noqa: E402

REF = ReferenceOps(DEV)
SMALL_N = 8 if INTERPRET else 16  # the smallest key tile the kernel compiles with


def prefill_case(g, rows, block_size, H, Hk, D, Dv, dtype, window=None, mla=False, pool_blocks=None):
    """rows: [(prefix, n)] -- n new queries after a cached prefix. Returns (q, kc, vc, meta, kc_clean, vc_clean):
    the metadata from build_inputs over a shuffled pool of blocks (pool_blocks, default 3 more than needed);
    in kc/vc the rows no visible key uses are NaN. mla: one KV head whose first Dv channels are the values
    (vc is a strided view of kc)."""
    need = [-(-(p + n) // block_size) for p, n in rows]
    perm = torch.randperm(pool_blocks or sum(need) + 3, generator=g).tolist()
    seqs, k = [], 0
    for (p, n), nb in zip(rows, need):
        seqs.append(SimpleNamespace(token_ids=[0] * (p + n), input_ids=lambda st, n: [0] * n,
                                    block_table=perm[k:k + nb], state_slot=0, replay_start=0,
                                    prefix_replay_start=0, num_cached_tokens=0))
        k += nb
    batch = SimpleNamespace(seqs=seqs, start=[p for p, _ in rows], num_tokens=[n for _, n in rows], future=None)
    _, meta, _ = build_inputs(batch, list(range(len(rows))), block_size, DEV)
    slots = len(perm) * block_size
    visible = torch.zeros(slots, dtype=torch.bool)
    kv_slots = meta.kv_slots.cpu()
    for b, (p, n) in enumerate(rows):
        first = max(0, p - window + 1) if window is not None else 0  # the earliest key any query sees
        visible[kv_slots[b, first:p + n]] = True
    T = sum(n for _, n in rows)
    q = torch.randn(T, H, D, generator=g).to(dtype).to(DEV)
    kc = torch.randn(slots, Hk, D, generator=g)
    vc = kc[..., :Dv] if mla else torch.randn(slots, Hk, Dv, generator=g)
    kc_clean = kc.to(dtype).to(DEV)
    vc_clean = kc_clean[..., :Dv] if mla else vc.to(dtype).to(DEV)
    kc_p, vc_p = kc.clone(), vc.clone()
    kc_p[~visible] = float("nan")
    vc_p[~visible] = float("nan")
    kc_p = kc_p.to(dtype).to(DEV)
    vc_p = kc_p[..., :Dv] if mla else vc_p.to(dtype).to(DEV)
    return q, kc_p, vc_p, meta, kc_clean, vc_clean


def oracle(q, kc, vc, meta, scale, window, sinks, only=None):
    """float64, row by row over each row's keys (clean caches). only: T indices to compute (others stay 0)."""
    T, H, D = q.shape
    G = H // kc.shape[1]
    dev = q.device
    out = torch.zeros(T, H, vc.shape[-1], dtype=torch.float64, device=dev)
    cu, lens = meta.cu_q.tolist(), meta.seq_lens.tolist()
    want = None if only is None else set(int(t) for t in only)
    for b in range(len(lens)):
        ts = [t for t in range(cu[b], cu[b + 1]) if want is None or t in want]
        if not ts:
            continue
        L, n = lens[b], cu[b + 1] - cu[b]
        slots = meta.kv_slots[b, :L]
        K = kc[slots].double().repeat_interleave(G, dim=1)  # [L, H, D]
        V = vc[slots].double().repeat_interleave(G, dim=1)
        idx = torch.tensor(ts, device=dev)
        pos = L - n + (idx - cu[b])  # [Q]
        s = torch.einsum("qhd,khd->hqk", q[idx].double(), K) * scale
        kp = torch.arange(L, device=dev)
        mask = kp[None, :] <= pos[:, None]
        if window is not None:
            mask &= kp[None, :] > pos[:, None] - window
        s = s.masked_fill(~mask[None], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().view(H, 1, 1).expand(H, len(ts), 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :L]
        out[idx] = torch.einsum("hqk,khd->qhd", p, V)
    return out


def run_kernel(q, kc, vc, meta, scale, window=None, sinks=None, **kw):
    return triton_prefill.paged_prefill(q, kc, vc, meta.block_table, meta.block_size, meta.cu_q, meta.seq_lens,
                                        meta.max_q, scale, window, sinks, **kw)


row_lists = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=4)


@examples(15)
@given(rows=row_lists, block_size=st.sampled_from([1, 4, 16]), Hk=st.sampled_from([1, 2]), G=st.sampled_from([1, 3, 4]),
       dims=st.sampled_from([(16, 16), (24, 24), (48, 48), (40, 8), (16, 32), (96, 64)]),
       window=st.one_of(st.none(), st.integers(1, 24)), with_sinks=st.booleans(),
       tiles=st.sampled_from([(None, None), (32, SMALL_N), (16, 32)]), seed=st.integers(0, 2**16))
def test_paged_prefill_float32(rows, block_size, Hk, G, dims, window, with_sinks, tiles, seed):
    g = gen(seed)
    H, (D, Dv) = Hk * G, dims
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, rows, block_size, H, Hk, D, Dv, torch.float32, window)
    sinks = (torch.randn(H, generator=g) * 2).to(DEV) if with_sinks else None
    scale = D ** -0.5
    out = run_kernel(q, kc, vc, meta, scale, window, sinks, block_m=tiles[0], block_n=tiles[1])
    assert out.shape == (q.shape[0], H, Dv) and out.dtype == torch.float32
    assert rel_err(out, oracle(q, kc_clean, vc_clean, meta, scale, window, sinks)) < 1e-5
    ref = REF.paged_attention(q, kc_clean, vc_clean, meta, scale, window, sinks)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@examples(8)
@given(rows=row_lists, block_size=st.sampled_from([4, 16]), G=st.sampled_from([1, 4]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), window=st.one_of(st.none(), st.integers(1, 9)),
       with_sinks=st.booleans(), seed=st.integers(0, 2**16))
def test_paged_prefill_low_precision_through_ops(rows, block_size, G, dtype, window, with_sinks, seed):
    g = gen(seed)
    Hk, D = 2, 32
    H = Hk * G
    rows = rows + [(5, 2)]  # at least one row with several queries: never the decode branch
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, rows, block_size, H, Hk, D, D, dtype, window)
    sinks = torch.randn(H, generator=g).to(DEV) if with_sinks else None
    ops = NvidiaOps(DEV)
    out = ops.paged_attention(q, kc, vc, meta, D ** -0.5, window, sinks)
    assert ops.kernel_calls["paged_prefill"] == 1 and out.dtype == dtype
    assert rel_err(out, oracle(q, kc_clean, vc_clean, meta, D ** -0.5, window, sinks)) < 1e-2


@examples(8)
@given(rows=row_lists, rank_rope=st.sampled_from([(16, 8), (32, 16)]), H=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**16))
def test_paged_prefill_mla_strided_values(rows, rank_rope, H, seed):
    """MLA's absorbed form: one KV head, key = the whole latent row (r + rope channels, not a power of two),
    value = a strided view of its first r channels (at r = 32 the kernel reuses the K tile as V)."""
    g = gen(seed)
    r, rope = rank_rope
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, rows, 4, H, 1, r + rope, r, torch.float32, mla=True)
    assert vc.data_ptr() == kc.data_ptr() and not vc.is_contiguous()
    out = run_kernel(q, kc, vc, meta, 0.2)
    assert rel_err(out, oracle(q, kc_clean, vc_clean, meta, 0.2, None, None)) < 1e-5
    torch.testing.assert_close(out, REF.paged_attention(q, kc_clean, vc_clean, meta, 0.2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3, 11, 21, 40])
@pytest.mark.parametrize("G,block_m", [(1, 16), (3, 32)])
def test_key_tile_phases(window, G, block_m):
    """Windows narrower and wider than a key tile and than a query tile, so that every tile kind runs: the
    window's leading edge (masked), the interior (unmasked) and the causal diagonal (masked)."""
    g = gen(11 + (window or 0) + G)
    rows = [(30, 20), (0, 37), (50, 1), (9, 45)]
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, rows, 4, 2 * G, 2, 16, 16, torch.float32, window)
    sinks = torch.randn(2 * G, generator=g).to(DEV)
    out = run_kernel(q, kc, vc, meta, 0.3, window, sinks, block_m=block_m, block_n=SMALL_N)
    assert rel_err(out, oracle(q, kc_clean, vc_clean, meta, 0.3, window, sinks)) < 1e-5


def test_empty_rows_loose_max_q_and_index_dtypes():
    """A row with no queries, max_q larger than any row, int32 block table and seq_lens, int64 cu_q: the same
    output as the plain call."""
    g = gen(5)
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, [(3, 4), (7, 5)], 4, 4, 2, 16, 16, torch.float32)
    want = run_kernel(q, kc, vc, meta, 0.3)
    bt = meta.block_table
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int64, device=DEV)
    lens = torch.tensor([7, 5, 12], dtype=torch.int32, device=DEV)
    bt3 = torch.stack([bt[0], bt[0], bt[1]]).to(torch.int32)
    out = triton_prefill.paged_prefill(q, kc, vc, bt3, 4, cu, lens, 50, 0.3)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    empty = triton_prefill.paged_prefill(q[:0], kc, vc, bt3, 4, torch.zeros(4, dtype=torch.int32, device=DEV),
                                         lens, 1, 0.3)
    assert empty.shape == (0, 4, 16)


def test_bad_arguments_raise_value_errors():
    g = gen(6)
    q, kc, vc, meta, _, _ = prefill_case(g, [(2, 3)], 4, 4, 2, 16, 16, torch.float32)
    args = dict(q=q, k_cache=kc, v_cache=vc, block_table=meta.block_table, block_size=4, cu_q=meta.cu_q,
                seq_lens=meta.seq_lens, max_q=3, scale=0.25)
    bad = {
        "q": q[:, :3],  # 3 heads over 2 KV heads
        "k_cache": kc.double(),
        "v_cache": vc[:, :1],
        "cu_q": meta.cu_q[:1],
        "seq_lens": meta.seq_lens.float(),
        "block_size": 0,
        "max_q": 0,
        "scale": -1.0,
        "window": 0,
        "sinks": torch.zeros(3, device=DEV),
        "block_table": meta.block_table.float(),
        "block_n": 12,
    }
    for name, value in bad.items():
        with pytest.raises(ValueError):
            triton_prefill.paged_prefill(**{**args, name: value})


def test_ops_dispatch():
    g = gen(7)
    ops = NvidiaOps(DEV)
    # A mixed step (prefill rows and decode rows) runs the prefill kernel.
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, [(0, 6), (9, 1), (4, 3)], 4, 4, 2, 16, 16, torch.float32)
    out = ops.paged_attention(q, kc, vc, meta, 0.25)
    assert ops.kernel_calls["paged_prefill"] == 1 and ops.kernel_calls["paged_attention"] == 0
    torch.testing.assert_close(out, REF.paged_attention(q, kc_clean, vc_clean, meta, 0.25), rtol=1e-4, atol=1e-5)
    # All rows decode: the decode kernel.
    q1, kc1, vc1, meta1, _, _ = prefill_case(g, [(5, 1), (11, 1)], 4, 4, 2, 16, 16, torch.float32)
    ops.paged_attention(q1, kc1, vc1, meta1, 0.25)
    assert ops.kernel_calls["paged_attention"] == 1 and ops.kernel_calls["paged_prefill"] == 1
    # Metadata without cu_q, or an unsupported dtype: the reference op, no kernel.
    meta.cu_q = None
    torch.testing.assert_close(ops.paged_attention(q, kc_clean, vc_clean, meta, 0.25),
                               REF.paged_attention(q, kc_clean, vc_clean, meta, 0.25))
    _, _, _, meta, _, _ = prefill_case(g, [(0, 6), (9, 1), (4, 3)], 4, 4, 2, 16, 16, torch.float32)
    q64, k64, v64 = q.double(), kc_clean.double(), vc_clean.double()
    torch.testing.assert_close(ops.paged_attention(q64, k64, v64, meta, 0.25),
                               REF.paged_attention(q64, k64, v64, meta, 0.25))
    assert ops.kernel_calls["paged_prefill"] == 1


def test_head_dim_split():
    """Head dims that are not powers of two take two power-of-two K blocks where that wastes less."""
    split = triton_prefill.split_head_dim
    assert split(128) == (128, 0) and split(192) == (128, 64) and split(96) == (64, 32)
    assert split(576) == (512, 64) and split(112) == (128, 0) and split(8) == (16, 0) and split(24) == (32, 0)


# ------------------------------------------------------------------------------------------- GPU only
def subsample(T: int, g, k: int = 96) -> torch.Tensor:
    return torch.randperm(T, generator=g)[:k].sort().values.to(DEV)


@gpu
@pytest.mark.parametrize("window,with_sinks", [(None, False), (1000, True)])
def test_gpu_prefill_llama8b_shapes(window, with_sinks):
    """Llama-3.1-8B attention (H 32, Hk 8, D 128) in bf16 over a 12K-token mixed step: a fresh 4K prompt, chunks
    after long cached prefixes, decode rows; against the float64 oracle on a subsample of queries."""
    g = gen(1)
    rows = [(0, 4096), (3000, 1000), (100, 2048), (12000, 512), (0, 17)] + [(5000 + 97 * i, 1) for i in range(8)]
    rows += [(700, 4000)]
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, rows, 16, 32, 8, 128, 128, torch.bfloat16, window)
    sinks = torch.randn(32, generator=g).to(DEV) if with_sinks else None
    out = run_kernel(q, kc, vc, meta, 128 ** -0.5, window, sinks)
    torch.cuda.synchronize()
    idx = subsample(q.shape[0], g)
    idx = torch.cat([idx, meta.cu_q[1:].long() - 1])  # every row's last query too (the decode rows among them)
    want = oracle(q, kc_clean, vc_clean, meta, 128 ** -0.5, window, sinks, only=idx.tolist())
    assert rel_err(out[idx], want[idx]) < 1e-2


@gpu
def test_gpu_prefill_16k_sequence_matches_sdpa():
    """One 16K-token prompt (the reference op would materialise [16K, 16K] scores per head): the kernel in bf16
    against torch's SDPA (is_causal) in float32 on the same values."""
    g = gen(2)
    L = 16384
    q, kc, vc, meta, _, _ = prefill_case(g, [(0, L)], 16, 32, 8, 128, 128, torch.bfloat16)
    out = run_kernel(q, kc, vc, meta, 128 ** -0.5)
    slots = meta.kv_slots[0, :L]
    qf = q.float().transpose(0, 1)[None]  # [1, H, L, D]
    kf = kc[slots].float().repeat_interleave(4, dim=1).transpose(0, 1)[None]
    vf = vc[slots].float().repeat_interleave(4, dim=1).transpose(0, 1)[None]
    ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=128 ** -0.5)
    assert rel_err(out, ref[0].transpose(0, 1)) < 1e-2


@gpu
def test_gpu_prefill_mla_shapes():
    """DeepSeek-V3 MLA: the unabsorbed prefill shape (H 128, D 192 = nope 128 + rope 64, Dv 128) and the
    absorbed one over the latent cache (one KV head, D 576, V = its first 512 channels, strided)."""
    g = gen(3)
    rows = [(0, 1500), (1000, 300), (40, 1), (2500, 1)]
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, rows, 16, 128, 128, 192, 128, torch.bfloat16)
    out = run_kernel(q, kc, vc, meta, 192 ** -0.5)
    idx = subsample(q.shape[0], g, 32)
    want = oracle(q, kc_clean, vc_clean, meta, 192 ** -0.5, None, None, only=idx.tolist())
    assert rel_err(out[idx], want[idx]) < 1e-2
    rows = [(0, 1024), (2000, 256), (77, 1)]
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, rows, 64, 128, 1, 576, 512, torch.bfloat16, mla=True)
    ops = NvidiaOps(DEV)
    out = ops.paged_attention(q, kc, vc, meta, 192 ** -0.5)
    assert ops.kernel_calls["paged_prefill"] == 1
    idx = subsample(q.shape[0], g, 48)
    want = oracle(q, kc_clean, vc_clean, meta, 192 ** -0.5, None, None, only=idx.tolist())
    assert rel_err(out[idx], want[idx]) < 1e-2


@gpu
def test_gpu_prefill_float32():
    g = gen(4)
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, [(0, 300), (500, 77), (40, 1)], 16, 16, 2, 128, 128,
                                                       torch.float32, window=200)
    out = run_kernel(q, kc, vc, meta, 0.1, 200)
    assert rel_err(out, oracle(q, kc_clean, vc_clean, meta, 0.1, 200, None)) < 1e-5


@gpu
def test_gpu_prefill_in_cuda_graph():
    """No host sync and a grid from shapes only: capture once, replay with other row splits, prefixes and block
    tables of the same B, T and max_q bound."""
    g = gen(5)
    rows = [(0, 200), (300, 50), (10, 1), (1000, 49)]
    case = dict(block_size=16, H=32, Hk=8, D=128, Dv=128, dtype=torch.bfloat16, pool_blocks=200)
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, rows, **case)
    T = q.shape[0]
    bt = torch.zeros(len(rows), 100, dtype=meta.block_table.dtype, device=DEV)  # wide enough for every replay
    bt[:, :meta.block_table.shape[1]] = meta.block_table
    static = dict(q=q.clone(), bt=bt, cu=meta.cu_q.clone(), lens=meta.seq_lens.clone())

    def run():
        return triton_prefill.paged_prefill(static["q"], kc_clean, vc_clean, static["bt"], 16, static["cu"],
                                            static["lens"], T, 128 ** -0.5)

    graph, out = capture_graph(run)
    for new_rows in (rows, [(0, 1), (0, 1), (0, 1), (900, 297)], [(64, 100), (0, 100), (33, 50), (0, 50)]):
        assert sum(n for _, n in new_rows) == T
        _, _, _, m, _, _ = prefill_case(g, new_rows, **case)  # new block tables into the same 200-block pool
        static["bt"].zero_()
        static["bt"][:, :m.block_table.shape[1]].copy_(m.block_table)
        static["cu"].copy_(m.cu_q)
        static["lens"].copy_(m.seq_lens)
        static["q"].copy_(torch.randn(q.shape, generator=g).to(q))
        graph.replay()
        torch.cuda.synchronize()
        want = oracle(static["q"], kc_clean, vc_clean, m, 128 ** -0.5, None, None)
        assert rel_err(out, want) < 1e-2


# ------------------------------------------------------------------------------------------- compiled path
_COMPILE_SCRIPT = r'''
import json, re
import torch
from deepinfer.backends.nvidia import triton_prefill as tp
from deepinfer.testing.kernels import compile_sm90, cuobjdump

assert not tp.INTERPRET
report = {}
for dt, D, Dv, vk in (("bf16", 64, 64, False), ("bf16", 128, 128, False), ("bf16", 192, 128, False),
                      ("bf16", 256, 256, False), ("bf16", 576, 512, True), ("fp32", 128, 128, False)):
    cfg = tp.launch_config(D, Dv, torch.bfloat16 if dt == "bf16" else torch.float32)
    p = "*" + dt
    ints = ("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_bt", "stride_ot",
            "stride_oh", "window", "B", "G")
    sig = dict(q_ptr=p, k_ptr=p, v_ptr=p, bt_ptr="*i64", cu_q_ptr="*i32", lens_ptr="*i64", sinks_ptr="*fp32",
               out_ptr=p, qk_scale="fp32", **{n: "i32" for n in ints})
    const = dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_SIZE=16, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                 BLOCK_D1=cfg["BLOCK_D1"], BLOCK_D2=cfg["BLOCK_D2"], BLOCK_DV=cfg["BLOCK_DV"], SCAN=128,
                 HAS_WINDOW=True, HAS_SINKS=True, V_FROM_K=vk, DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
                 INTERP_LOOP=False, SCAN_ITERS=0, MAX_TILES=0)
    k = compile_sm90(tp._prefill_kernel, sig, const, [n for n in ints if n.startswith("stride")],
                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    row = {"smem": k.metadata.shared}
    sass = cuobjdump(k)
    if sass is not None:
        ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
        addr = [int(a, 16) for a, _ in ins]
        loops = []  # [target, branch] of every backward branch
        for a, (_, text) in zip(addr, ins):
            m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
            if m and m.group(1) and int(m.group(1), 16) < a:
                loops.append((int(m.group(1), 16), a))
        spill_in_loop = sum(1 for a, (_, text) in zip(addr, ins) if re.search(r"\b(STL|LDL)", text)
                            and any(lo <= a <= hi for lo, hi in loops))
        row.update(mma=len(re.findall(r"\b(HGMMA|HMMA)\.", sass)), loops=len(loops), spill_in_loop=spill_in_loop)
    report[f"{dt}_{D}_{Dv}"] = row
print(json.dumps(report))
'''


def test_prefill_kernel_compiles_for_hopper():
    """The compiled code path, which CPU CI never runs: the kernel builds for sm_90 at every shipped config
    through the bundled ptxas; in bf16 the SASS has tensor-core MMAs; no key loop spills to local memory;
    shared memory fits an H200 SM (227 KB)."""
    report = run_compile_script(_COMPILE_SCRIPT)
    assert len(report) == 6
    for name, row in report.items():
        assert row["smem"] <= 227 * 1024, (name, row)
        if "mma" not in row:
            continue  # no cuobjdump in this triton install
        assert row["loops"] >= 2, (name, row)
        assert row["spill_in_loop"] == 0, (name, row)
        if name.startswith("bf16"):
            assert row["mma"] > 0, (name, row)


@examples(8)
@given(decodes=st.lists(st.integers(0, 40), min_size=1, max_size=3), chunks=row_lists,
       block_size=st.sampled_from([4, 16]), G=st.sampled_from([1, 4]), window=st.one_of(st.none(), st.integers(1, 9)),
       with_sinks=st.booleans(), seed=st.integers(0, 2**16))
def test_mixed_step_dispatches_each_kind_of_row(decodes, chunks, block_size, G, window, with_sinks, seed):
    """A mixed step in one call (decode rows first, as the engine lays them out): the decode rows go to the
    decode kernel and the chunks to the prefill kernel, and together they give the oracle's output."""
    g = gen(seed)
    Hk, D = 2, 32
    H = Hk * G
    chunks = chunks + [(5, 2)]  # at least one row with several queries
    rows = [(p, 1) for p in decodes] + chunks
    q, kc, vc, meta, kc_clean, vc_clean = prefill_case(g, rows, block_size, H, Hk, D, D, torch.float32, window)
    meta.num_decodes = len(decodes)
    sinks = torch.randn(H, generator=g).to(DEV) if with_sinks else None
    ops = NvidiaOps(DEV)
    out = ops.paged_attention(q, kc, vc, meta, D ** -0.5, window, sinks)
    assert ops.kernel_calls["paged_attention"] == 1 and ops.kernel_calls["paged_prefill"] == 1
    assert rel_err(out, oracle(q, kc_clean, vc_clean, meta, D ** -0.5, window, sinks)) < 1e-5
    ref = REF.paged_attention(q, kc_clean, vc_clean, meta, D ** -0.5, window, sinks)
    assert rel_err(out, ref) < 1e-5
