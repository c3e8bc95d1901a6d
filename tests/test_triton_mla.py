"""The MLA decode kernel (triton_mla) against ReferenceOps.paged_attention called as deepseek.py calls it
(k_cache = the latent cache, v_cache = its first r channels) and against a float64 oracle.

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)
on tiny shapes with r and rope that are not powers of two; with CUDA the same property tests run the
compiled kernel and the GPU-only tests add DeepSeek-V3 shapes (H = 128, r = 512, rope = 64) in bf16, a
CUDA-graph capture, a timing against the generic paged decode kernel and a split-count sweep (run with -s).
The reference op is checked on a few rows at a time there: its memory grows as B x H x max_kv. Cache rows
that no visible key uses are NaN, and so is the padding of a strided cache.
Bounds: ||out - ref|| / ||ref|| < 1e-5 in float32, < 1e-2 in bf16/fp16. A compile test builds the kernels
for sm_90 (no GPU needed) and reads ptxas' resource report: no spills, tensor-core MMAs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import (DEV, capture_graph, examples, gen, gpu, rel_err, run_compile_script,
                                       skip_module_without_kernels)

skip_module_without_kernels()

from deepinfer.backends.base import AttnMetadata  # noqa: E402
from deepinfer.backends.nvidia import triton_attention, triton_mla  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402

REF = ReferenceOps(DEV)


def mla_case(g, lens, block_size, H, r, rope, dtype, extra_width=0, form="3d", bt_dtype=torch.int64):
    """A decode batch over a shuffled paged latent cache. Returns (q, cache for the kernel, clean cache
    [slots, 1, r + rope] for the reference, meta). In the kernel's cache every row no visible key uses is
    NaN; form "2d" drops the head dim, "strided" pads each slot with 8 NaN values (slot stride r + rope + 8)."""
    B, D = len(lens), r + rope
    need = [-(-n // block_size) for n in lens]
    width = max(1, max(need)) + extra_width
    total = sum(need) + 3
    perm = torch.randperm(total, generator=g)
    bt = torch.zeros(B, width, dtype=torch.long)
    k = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[k:k + n]
        k += n
    slots = total * block_size
    rows = torch.randn(slots, D, generator=g)
    max_kv = width * block_size
    kv_pos = torch.arange(max_kv)
    kv_slots = bt[:, kv_pos // block_size] * block_size + kv_pos % block_size
    visible = torch.zeros(slots, dtype=torch.bool)
    for b, n in enumerate(lens):
        visible[kv_slots[b, :n]] = True
    poisoned = rows.clone()
    poisoned[~visible] = float("nan")
    if form == "strided":
        buf = torch.full((slots, 1, D + 8), float("nan"))
        buf[:, 0, :D] = poisoned
        cache = buf.to(dtype).to(DEV)[:, :, :D]
    elif form == "2d":
        cache = poisoned.to(dtype).to(DEV)
    else:
        cache = poisoned[:, None].to(dtype).to(DEV)
    clean = rows[:, None].to(dtype).to(DEV)
    lens_t = torch.tensor(lens)
    q_pos = (lens_t - 1).clamp_min(0)[:, None]
    to = dict(device=DEV)
    meta = AttnMetadata(positions=q_pos[:, 0].to(**to), slot_mapping=kv_slots[torch.arange(B), q_pos[:, 0]].to(**to),
                        seq_lens=lens_t.to(**to), q_index=torch.arange(B)[:, None].to(**to),
                        q_valid=torch.ones(B, 1, dtype=torch.bool, device=DEV), kv_slots=kv_slots.to(**to),
                        q_pos=q_pos.to(**to), block_table=bt.to(bt_dtype).to(**to), block_size=block_size)
    q = torch.randn(B, H, D, generator=g).to(dtype).to(DEV)
    return q, cache, clean, meta


def oracle(q, clean, meta, r, scale):
    """float64, row by row, over only the visible rows: K = whole rows, V = their first r values."""
    B, H, _ = q.shape
    bs = meta.block_size
    out = torch.zeros(B, H, r, dtype=torch.float64, device=q.device)
    bt, lens = meta.block_table.cpu().long(), meta.seq_lens.cpu()
    for b in range(B):
        pos = torch.arange(int(lens[b]))
        if len(pos) == 0:
            continue
        slots = (bt[b, pos // bs] * bs + pos % bs).to(q.device)
        K = clean[slots, 0].double()  # [n, r + rope]
        p = torch.softmax(q[b].double() @ K.T * scale, dim=-1)
        out[b] = p @ K[:, :r]
    return out


def reference(q, clean, meta, r, scale):
    """The reference op exactly as DeepseekAttention.absorbed calls it."""
    return REF.paged_attention(q, clean, clean[..., :r], meta, scale)


def row_meta(meta, b):
    """Row b of a decode batch as a batch of its own (same block table width)."""
    s = slice(b, b + 1)
    return AttnMetadata(positions=meta.positions[s], slot_mapping=meta.slot_mapping[s], seq_lens=meta.seq_lens[s],
                        q_index=torch.zeros_like(meta.q_index[s]), q_valid=meta.q_valid[s], kv_slots=meta.kv_slots[s],
                        q_pos=meta.q_pos[s], block_table=meta.block_table[s], block_size=meta.block_size)


def reference_rows(q, clean, meta, r, scale, rows):
    """The reference op on a few rows, one row per call: it broadcasts the H query heads over the one latent
    head and so materialises [B, H, r + rope, max_kv] float32 (~2.5 GB per DeepSeek-V3 row at 8K context,
    73-292 GB for whole batches of 32-128 rows)."""
    return torch.stack([reference(q[b:b + 1], clean, row_meta(meta, b), r, scale)[0] for b in rows])


def run(q, cache, meta, r, scale, **kw):
    return triton_mla.mla_decode(q, cache, meta.block_table, meta.block_size, meta.seq_lens, scale, r, **kw)


# ------------------------------------------------------------------------------------------- interpreter
shapes = st.sampled_from([(32, 16), (24, 8), (16, 16), (40, 24)])  # (r, rope): powers of two and not


@examples(30)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=3), block_size=st.sampled_from([1, 3, 4, 16]),
       H=st.sampled_from([1, 4, 17]), shape=shapes, splits=st.sampled_from([None, 1, 2, 5]),
       extra_width=st.integers(0, 2), form=st.sampled_from(["3d", "2d", "strided"]),
       bt_dtype=st.sampled_from([torch.int32, torch.int64]), seed=st.integers(0, 2**16))
def test_mla_decode_float32(lens, block_size, H, shape, splits, extra_width, form, bt_dtype, seed):
    r, rope = shape
    g = gen(seed)
    q, cache, clean, meta = mla_case(g, lens, block_size, H, r, rope, torch.float32, extra_width, form, bt_dtype)
    scale = 0.3 * (r + rope) ** -0.5 * 4
    assert triton_mla.supports(q, cache, meta.block_table, block_size, r)
    out = run(q, cache, meta, r, scale, num_splits=splits)
    assert out.shape == (len(lens), H, r) and out.dtype == torch.float32
    assert rel_err(out, oracle(q, clean, meta, r, scale)) < 1e-5
    assert rel_err(out, reference(q, clean, meta, r, scale)) < 1e-5


@examples(15)
@given(lens=st.lists(st.integers(1, 50), min_size=1, max_size=3), block_size=st.sampled_from([4, 16]),
       H=st.sampled_from([2, 16]), shape=shapes, dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       splits=st.sampled_from([None, 1, 3]), seed=st.integers(0, 2**16))
def test_mla_decode_low_precision(lens, block_size, H, shape, dtype, splits, seed):
    r, rope = shape
    g = gen(seed)
    q, cache, clean, meta = mla_case(g, lens, block_size, H, r, rope, dtype)
    scale = (r + rope) ** -0.5
    out = run(q, cache, meta, r, scale, num_splits=splits)
    assert out.dtype == dtype
    assert rel_err(out, oracle(q, clean, meta, r, scale)) < 1e-2
    assert rel_err(out, reference(q, clean, meta, r, scale)) < 1e-2


def test_mla_decode_empty_rows_and_splits():
    """A row with seq_len 0 (a padded CUDA-graph row) gives zeros; splits beyond the context stay empty and
    merge to nothing; the other rows are unaffected."""
    g = gen(5)
    lens = [0, 3, 37]
    q, cache, clean, meta = mla_case(g, lens, 4, 3, 24, 8, torch.float32, extra_width=3)
    for splits in (1, 7):
        out = run(q, cache, meta, 24, 0.2, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert rel_err(out[1:], oracle(q, clean, meta, 24, 0.2)[1:]) < 1e-5


def test_mla_decode_non_contiguous_query_and_tile_overrides():
    """q built by concatenation is contiguous in the engine, but a strided head dim must work too; the
    benchmark overrides (head block, token tile) give the same function."""
    g = gen(6)
    q, cache, clean, meta = mla_case(g, [9, 20], 4, 5, 32, 16, torch.float32)
    q_wide = torch.zeros(2, 10, 48, device=DEV)
    q_wide[:, ::2] = q
    want = oracle(q, clean, meta, 32, 0.15)
    assert rel_err(run(q_wide[:, ::2], cache, meta, 32, 0.15), want) < 1e-5
    assert rel_err(run(q, cache, meta, 32, 0.15, block_h=32, block_n=32, num_splits=2), want) < 1e-5


def test_value_prefix_rank_detects_the_mla_call():
    cache = torch.zeros(3, 10, 1, 40)[1]  # one layer of [layers, slots, 1, r + rope]
    assert triton_mla.value_prefix_rank(cache, cache[..., :32]) == 32
    assert triton_mla.value_prefix_rank(cache, cache) == 0  # not a strict prefix
    assert triton_mla.value_prefix_rank(cache, cache[..., 8:]) == 0  # another start
    assert triton_mla.value_prefix_rank(cache, cache.clone()[..., :32]) == 0  # other storage
    kv = torch.zeros(10, 2, 40)
    assert triton_mla.value_prefix_rank(kv, kv[..., :32]) == 0  # two KV heads: GQA, not MLA
    assert triton_mla.value_prefix_rank(torch.zeros(10, 1, 40), torch.zeros(10, 1, 40)) == 0
    # The whole check NvidiaOps makes: also no window, no sinks, a supported call.
    q, bt = torch.zeros(2, 4, 40), torch.zeros(2, 3, dtype=torch.long)
    assert triton_mla.mla_call_rank(q, cache, cache[..., :32], bt, 4) == 32
    assert triton_mla.mla_call_rank(q, cache, cache[..., :32], bt, 4, window=8) == 0
    assert triton_mla.mla_call_rank(q, cache, cache[..., :32], bt, 4, sinks=torch.zeros(4)) == 0
    assert triton_mla.mla_call_rank(q.double(), cache, cache[..., :32], bt, 4) == 0
    assert triton_mla.mla_call_rank(q, cache, cache[..., :32], None, 0) == 0


def test_supports_and_errors():
    g = gen(7)
    q, cache, _, meta = mla_case(g, [5], 4, 2, 24, 8, torch.float32)
    bt = meta.block_table
    assert triton_mla.supports(q, cache, bt, 4, 24)
    assert not triton_mla.supports(q.double(), cache.double(), bt, 4, 24)  # dtype
    assert not triton_mla.supports(q, cache.to(torch.bfloat16), bt, 4, 24)  # mixed dtypes
    assert not triton_mla.supports(q, cache, None, 4, 24)
    assert not triton_mla.supports(q, cache, bt, 0, 24)
    assert not triton_mla.supports(q, cache, bt, 4, 32)  # r = whole row
    assert not triton_mla.supports(q, cache.expand(-1, 2, -1), bt, 4, 24)  # two heads
    assert not triton_mla.supports(q, cache, bt.float(), 4, 24)
    big = torch.zeros(1, 1, 1024 + 64)
    assert not triton_mla.supports(torch.zeros(1, 1, 1024 + 64), big, bt, 4, 1024)  # r above MAX_RANK
    cases = [
        (dict(cache=cache.expand(-1, 2, -1)), "cache"),
        (dict(q=q[0]), "q"),
        (dict(kv_lora_rank=32), "kv_lora_rank"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(cache=cache[..., :30]), "cache"),
        (dict(q=q.double(), cache=cache.double()), "dtype"),
        (dict(block_table=bt[0]), "block_table"),
        (dict(block_table=bt.float()), "block_table"),
        (dict(seq_lens=meta.seq_lens[:, None]), "seq_lens"),
        (dict(block_size=0), "block_size"),
        (dict(block_h=24), "block_h"),
        (dict(block_n=8), "block_n"),
        (dict(cache=torch.zeros(40, 64, device=DEV)[:, ::2]), "stride"),
    ]
    for kw, word in cases:
        args = dict(q=q, cache=cache, block_table=bt, block_size=4, seq_lens=meta.seq_lens, scale=0.1,
                    kv_lora_rank=24)
        args.update(kw)
        with pytest.raises(ValueError, match=word):
            triton_mla.mla_decode(**args)


def test_choose_splits_from_shapes():
    """Splits fill the GPU when rows are few and stop when a wave is full (132 SMs, DeepSeek-V3 shapes); no
    split is left empty by the kernel's rounding to whole tiles, and each gets at least MIN_SPLIT_TILES."""
    def pick(rows, ctx, sms=132):  # H = 128: two head blocks of 64; bf16 rows of 576 values; 32-token tiles
        return triton_mla.choose_splits(rows * 2, ctx, sms, 32, 32 * 576 * 2, 64 * 576 * 2, 64 * 512 * 4)

    assert 32 <= pick(1, 4096) <= 64  # B = 1: 64 .. 128 programs, not 2
    assert pick(1, 32768) == triton_mla.MAX_SPLITS
    assert pick(4, 8192) == 16
    assert pick(32, 8192) == 2  # 64 programs -> 128: one wave
    assert pick(128, 8192) == 1  # 256 programs: two full waves already
    assert pick(1, 32) == 1 and pick(1, 63) == 1  # under two tiles: nothing to split
    for b in (1, 3, 70):
        for c in (16, 100, 4096, 5000):
            s, tiles = pick(b, c), -(-c // 32)
            assert 1 <= s <= max(1, tiles // triton_mla.MIN_SPLIT_TILES)
            per = -(-tiles // s)
            assert -(-tiles // per) == s  # every split has work
    assert pick(1, 4096, sms=4) < pick(1, 4096)  # fewer SMs, fewer splits


# ------------------------------------------------------------------------------------------- compiled path
_COMPILE_SCRIPT = r'''
import json, re
import torch
from deepinfer.backends.nvidia import triton_mla as M
from deepinfer.testing.kernels import compile_sm90, cuobjdump

assert not M.INTERPRET
report = {}


def compile_(fn, name, sig, const, div16, **opts):
    k = compile_sm90(fn, sig, const, div16, **opts)
    row = {"smem": k.metadata.shared}
    res = cuobjdump(k, "-res-usage")
    if res is not None:
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res)
        sass = cuobjdump(k)
        row.update(regs=int(m.group(1)), stack=int(m.group(2)), local=int(m.group(3)),
                   hgmma=len(re.findall(r"\bHGMMA\.", sass)), hmma=len(re.findall(r"\bHMMA\.", sass)),
                   spill_ops=len(re.findall(r"\b(STL|LDL)\b", sass)))
    report[name] = row


ints = ("stride_qb", "stride_qh", "stride_s", "stride_bt", "stride_ob", "stride_oh", "H", "R", "P", "NUM_SPLITS")
for dt, tdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    p = "*" + dt
    for H in (128, 16):
        cfg = M.launch_config(H, 512, 64, tdt)
        for direct in (True, False):
            sig = dict(q_ptr=p, cache_ptr=p, bt_ptr="*i64", lens_ptr="*i64", out_ptr=p, mid_m_ptr="*fp32",
                       mid_l_ptr="*fp32", mid_o_ptr="*fp32", qk_scale="fp32", **{n: "i32" for n in ints})
            const = dict(DIRECT=direct, BLOCK_SIZE=64, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
                         BLOCK_R=cfg["BLOCK_R"], BLOCK_P=cfg["BLOCK_P"],
                         PRECISION="ieee" if dt == "fp32" else "tf32", INTERP_LOOP=False, MAX_TILES=0)
            compile_(M._mla_decode_kernel, f"decode_{dt}_H{H}_{'direct' if direct else 'split'}", sig, const,
                     ints[:-1], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    compile_(M._mla_merge_kernel, f"merge_{dt}",
             dict(mid_m_ptr="*fp32", mid_l_ptr="*fp32", mid_o_ptr="*fp32", out_ptr=p,
                  **{n: "i32" for n in ("stride_ob", "stride_oh", "H", "R", "NUM_SPLITS")}),
             dict(BLOCK_S=64, BLOCK_C=128), ("stride_ob", "stride_oh", "H", "R"), num_warps=4)
print(json.dumps(report))
'''


def test_mla_kernels_compile_for_hopper():
    """The compiled path, which CPU CI never runs: the launch configs of DeepSeek-V3 (H = 128) and -V2-Lite
    (H = 16) build for sm_90 with no register spills; bf16 uses the tensor cores (wgmma at 64 heads)."""
    report = run_compile_script(_COMPILE_SCRIPT)
    assert len(report) == 2 * (4 + 1)
    for name, row in report.items():
        assert row["smem"] <= 227 * 1024, (name, row)
        if "regs" not in row:
            continue  # no cuobjdump in this triton install
        assert row["local"] == 0 and row["stack"] == 0 and row["spill_ops"] == 0, f"{name} spills: {row}"
        if name.startswith("decode_bf16_H128"):
            assert row["hgmma"] > 0, (name, row)
        elif name.startswith("decode_bf16"):
            assert row["hmma"] + row["hgmma"] > 0, (name, row)


# ------------------------------------------------------------------------------------------- GPU only
V3 = dict(H=128, r=512, rope=64)


@gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("B", [1, 32, 128])
def test_gpu_mla_decode_deepseek_v3_shapes(B, block_size):
    g = gen(B + block_size)
    lens = torch.randint(1, 8193, (B,), generator=g).tolist()
    lens[0] = 8192
    if B > 1:
        lens[1] = 1
    q, cache, clean, meta = mla_case(g, lens, block_size, V3["H"], V3["r"], V3["rope"], torch.bfloat16, extra_width=2)
    scale = 192 ** -0.5 * 1.3  # qk_head_dim 192, with a yarn mscale
    want = oracle(q, clean, meta, V3["r"], scale)  # float64, row by row: small
    for splits in (None, 1, 5):
        out = run(q, cache, meta, V3["r"], scale, num_splits=splits)
        torch.cuda.synchronize()
        assert rel_err(out, want) < 1e-2, splits
    rows = sorted({0, 1 % B, B // 2, B - 1})  # the longest row, a 1-token row, two others
    assert rel_err(out[rows], reference_rows(q, clean, meta, V3["r"], scale, rows)) < 1e-2


@gpu
@pytest.mark.parametrize("H", [16, 64])
def test_gpu_mla_decode_other_head_counts_and_float32(H):
    """DeepSeek-V2-Lite (16 heads), Kimi-K2-like (64); float32 at full size."""
    g = gen(H)
    lens = [1, 300, 4096, 77]
    for dtype, bound in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        q, cache, clean, meta = mla_case(g, lens, 16, H, 512, 64, dtype)
        out = run(q, cache, meta, 512, 0.07)
        assert rel_err(out, oracle(q, clean, meta, 512, 0.07)) < bound


@gpu
def test_gpu_mla_decode_in_cuda_graph():
    """No host sync and a shape-only split count: capture once, replay with other lengths, queries and
    block tables."""
    g = gen(3)
    lens = [40, 900, 7, 2000]
    q, cache, clean, meta = mla_case(g, lens, 16, 128, 512, 64, torch.bfloat16, extra_width=4)
    static = dict(q=q.clone(), bt=meta.block_table.clone(), lens=meta.seq_lens.clone())

    def launch():
        return triton_mla.mla_decode(static["q"], clean, static["bt"], 16, static["lens"], 0.07, 512)

    graph, out = capture_graph(launch)
    for new_lens, shuffle in (([40, 900, 7, 2000], False), ([1, 1, 1, 1], False), ([33, 64, 1950, 0], True)):
        lt = torch.tensor(new_lens, device=DEV)
        static["lens"].copy_(lt)
        static["q"].copy_(torch.randn(q.shape, generator=g).to(q))
        if shuffle:
            static["bt"].copy_(meta.block_table.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        m = AttnMetadata(positions=lt, slot_mapping=meta.slot_mapping, seq_lens=lt, q_index=meta.q_index,
                         q_valid=meta.q_valid, kv_slots=meta.kv_slots, q_pos=(lt - 1)[:, None],
                         block_table=static["bt"], block_size=16)
        want = oracle(static["q"], clean, m, 512, 0.07)
        live = lt > 0
        assert rel_err(out[live], want[live]) < 1e-2
        assert torch.equal(out[~live], torch.zeros_like(out[~live]))


def dense_case(B, ctx, copies=1, block_size=64, seed=0):
    """B DeepSeek-V3 rows of ctx tokens each (bf16), built on the GPU. ``copies`` block tables over disjoint
    parts of one cache: timing loops cycle through them, so that a small batch's KV is not served from L2
    (in a model every layer has its own cache). Returns q, the cache [slots, 1, 576], one meta per copy."""
    from types import SimpleNamespace

    g = torch.Generator(device=DEV).manual_seed(seed)
    nb = ctx // block_size
    cache = torch.randn(copies * B * nb * block_size, 1, 576, generator=g, device=DEV).to(torch.bfloat16)
    bt = torch.randperm(copies * B * nb, generator=g, device=DEV).view(copies, B, nb)
    lens = torch.full((B,), ctx, device=DEV)
    q = torch.randn(B, 128, 576, generator=g, device=DEV).to(torch.bfloat16)
    return q, cache, [SimpleNamespace(block_table=bt[c], seq_lens=lens, block_size=block_size) for c in range(copies)]


def l2_copies(B, ctx):
    return max(1, min(32, -(-160 * 2**20 // (B * ctx * 576 * 2))))  # >= 160 MB of KV per cycle (L2: 50 MB)


def eager_us(fns, rounds=10):
    """Microseconds per call, launched from Python (includes host overhead where it bounds)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        for fn in fns:
            fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (rounds * len(fns))


def graph_us(fns, rounds=4):
    """Microseconds per call of GPU time: the calls captured in one CUDA graph and replayed (how the engine
    runs decode; no launch overhead)."""
    def once():
        for fn in fns:
            fn()

    graph, _ = capture_graph(lambda: [once() for _ in range(rounds)], warmup=once)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (3 * rounds * len(fns))


def mla_fns(q, cache, metas, **kw):
    return [lambda m=m: triton_mla.mla_decode(q, cache, m.block_table, m.block_size, m.seq_lens, 0.07, 512, **kw)
            for m in metas]


def generic_fns(q, cache, metas):
    return [lambda m=m, pos=metas[0].seq_lens - 1: triton_attention.paged_decode(
        q, cache, cache[..., :512], m.block_table, m.block_size, m.seq_lens, pos, 0.07) for m in metas]


@gpu
@pytest.mark.parametrize("B", [1, 32, 128])
def test_gpu_mla_decode_against_generic_kernel(B):
    """The dedicated kernel against the generic paged decode kernel on the same call (DeepSeek-V3, 4K
    contexts, KV not in L2): the same result; prints both times (run with -s): GPU time from CUDA-graph
    replay and eager time (where host overhead shows at small B). Speed is a benchmark's job, not a test's
    (measured on the H200: 23 / 249 / 884 us against 120 / 1668 / 5171 us for the generic kernel)."""
    q, cache, metas = dense_case(B, 4096, copies=l2_copies(B, 4096), seed=9)
    mla, generic = mla_fns(q, cache, metas), generic_fns(q, cache, metas)
    assert rel_err(mla[0](), generic[0]()) < 1e-2
    t_mla, t_gen = (graph_us(mla), eager_us(mla)), (graph_us(generic), eager_us(generic))
    gbps = B * 4096 * 576 * 2 / (t_mla[0] * 1e-6) / 1e9
    print(f"\nMLA decode B={B} ctx=4096: mla {t_mla[0]:.1f} us GPU ({gbps:.0f} GB/s of latent rows), "
          f"{t_mla[1]:.1f} us eager; generic {t_gen[0]:.1f} us GPU, {t_gen[1]:.1f} us eager")


@gpu
@pytest.mark.parametrize("B,ctx", [(1, 4096), (1, 32768), (32, 4096), (32, 32768)])
def test_gpu_mla_decode_split_sweep(B, ctx):
    """Which split counts (and head blocks) are fastest, for tuning choose_splits: prints the GPU time of
    every num_splits in 1 .. 64 at 64 and 32 heads per program next to the shape-derived choice and the
    generic kernel (run with -s). Asserts only that every variant is correct."""
    q, cache, metas = dense_case(B, ctx, copies=l2_copies(B, ctx), seed=B + ctx)
    want = oracle(q, cache, metas[0], 512, 0.07)
    plan = triton_mla._plan(B, 128, 512, 64, torch.bfloat16, ctx // 64, 64, triton_mla.sm_count(DEV), None, None,
                            None)
    gb = B * ctx * 576 * 2 / 1e9
    t_gen = graph_us(generic_fns(q, cache, metas))
    lines = [f"\nMLA split sweep B={B} ctx={ctx}: auto = {plan.splits} splits x {plan.head_blocks} head blocks "
             f"({graph_us(mla_fns(q, cache, metas)):.1f} us GPU, {eager_us(mla_fns(q, cache, metas)):.1f} us "
             f"eager); generic kernel {t_gen:.1f} us GPU"]
    for block_h in (64, 32):
        for splits in sorted({1, 2, 4, 8, 16, 32, 64, plan.splits}):
            fns = mla_fns(q, cache, metas, num_splits=splits, block_h=block_h)
            err = rel_err(fns[0](), want)
            assert err < 1e-2, (block_h, splits, err)
            t = graph_us(fns)
            lines.append(f"  block_h={block_h:2d} splits={splits:2d}: {t:8.1f} us  {gb / (t * 1e-6):6.0f} GB/s  "
                         f"err {err:.1e}{'  <- auto' if splits == plan.splits and block_h == 64 else ''}")
    print("\n".join(lines))
