"""The CED kernels (triton_fp4, triton_ced_indexer, triton_ced_attention) against the reference ops.

Without CUDA the kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before any kernel
module is imported) on tiny generated shapes; with CUDA the same property tests run compiled kernels and the
GPU-only tests add the CED bench config's shapes (deepinfer init-model --arch ced --size bench: 16 heads x 512
latent, window 128, top-K 512, 16 index heads x 128) in bf16, and CUDA-graph capture.

What must hold:
- the FP4 / MXFP4 quantisers and dequantisers are bit-exact with reference.lowbit (ties, saturation, zero and
  -0.0 groups, float32 subnormals included);
- the indexer's scores match the reference's float32 scores (rel 1e-5 in float32) and its selected set is the
  reference's top-K: exactly for float32 (exact ties, e.g. repeated keys, go to the lower id in both), and
  in bf16 up to swaps of entries whose scores tie within the scores' error;
- sparse attention (window from fresh rows and the FP8 ring, selected FP4 entries, sink) matches the
  reference op to a relative error < 1e-5 in float32 and < 1e-2 in bf16, with every cache row and ring slot
  that no query may read poisoned with NaN;
- the whole CED engine path on NvidiaOps gives the reference backend's greedy tokens.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import example, given, strategies as st

from deepinfer.testing.compare import assert_logits_close
from deepinfer.testing.strategies import ced_attention_rows
from deepinfer.testing.kernels import (DEV, assert_same_bits, capture_graph, examples, gen, gpu, rel_err as _rel_err,
                                       run_compile_script, skip_module_without_kernels)

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_ced_attention, triton_ced_indexer, triton_fp4  # noqa: E402
from deepinfer.backends.nvidia.ops import NvidiaOps  # noqa: E402
from deepinfer.backends.reference import lowbit  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402

REF = ReferenceOps(DEV)
OPS = NvidiaOps(DEV)
FAST = examples(15)
FP4 = ("fp4_e2m1_e4m3", "mxfp4")
NAN_SCALE = {"fp4_e2m1_e4m3": 0x7F, "mxfp4": 0xFF, "fp8_e4m3_pow2": 0xFF}  # a scale byte that decodes to NaN
rel_err = partial(_rel_err, device="cpu")  # float64 norms on the host
# Indexer scores (float32 sums of nh <= 4 weighted heads of dh <= 64 products) against the reference's: the worst
# seen is 1.4 eps of the row's largest |score| (interpreter and H200); 32 leaves 20x.
SCORE_FACTOR = 32


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------------- FP4 quantisers
def fp4_values(g: torch.Generator, rows: int, C: int, G: int) -> torch.Tensor:
    """Random groups over wide magnitudes (float32 subnormals to saturation), with exact E2M1 grid points and
    midpoints (ties) times a power of two, all-zero and -0.0 groups, and zeros mixed in."""
    NG = C // G
    mag = torch.pow(2.0, torch.randint(-140, 14, (rows, NG, 1), generator=g).double())
    x = torch.randn(rows, NG, G, generator=g, dtype=torch.float64) * mag
    grid = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0], dtype=torch.float64)
    ties = grid[torch.randint(0, len(grid), (rows, NG, G), generator=g)] * mag.round()
    ties = ties * torch.where(torch.rand(rows, NG, G, generator=g) < 0.5, -1.0, 1.0).double()
    x = torch.where(torch.rand(rows, NG, 1, generator=g) < 0.3, ties, x)
    x = torch.where(torch.rand(rows, NG, G, generator=g) < 0.1, torch.zeros_like(x), x)
    x[0, 0] = 0.0
    if NG > 1:
        x[0, 1] = -0.0
    return x.reshape(rows, C).float()


@FAST
@given(fmt=st.sampled_from(FP4), rows=st.integers(1, 5), groups=st.integers(1, 5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       layout=st.sampled_from(["rows", "broadcast", "sliced"]), seed=st.integers(0, 2**16))
def test_fp4_quantize_dequantize_bit_exact(fmt, rows, groups, dtype, layout, seed):
    G = triton_fp4.GROUPS[fmt]
    x = fp4_values(gen(seed), rows, groups * G, G).to(dtype)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # fp16 overflow: the formats take finite input
    if layout == "broadcast":
        x = x[:, None].expand(rows, 2, groups * G)  # a broadcast (non-contiguous) view
    elif layout == "sliced":  # rows further apart than their channels (the kernels' row stride)
        x = torch.cat([x, torch.full_like(x[:, :G], 7.0)], dim=1)[:, :groups * G]
    x = x.to(DEV)
    codes, scales = triton_fp4.quantize(x, fmt)
    ref_codes, ref_scales = lowbit.quantize(x.cpu(), fmt)
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)
    for out_dtype in (torch.float32, torch.bfloat16):
        back = triton_fp4.dequantize(codes, scales, fmt, out_dtype)
        assert torch.equal(bits(back.cpu()), bits(lowbit.dequantize(ref_codes, ref_scales, fmt, out_dtype)))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # E8M0 bytes near 255: inf, as the reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FP4)
def test_fp4_dequantize_every_byte(fmt, dtype):
    """Every code byte under every scale byte, in every output dtype, as the reference gives it (the semantics in
    reference.lowbit's docstring): bit-exact, except that a NaN scale byte makes its group NaN with any payload
    (the H200's arithmetic returns canonical NaNs, the CPU and the interpreter the scale's own), and a product
    beyond the output dtype is inf of the code's sign."""
    G = triton_fp4.GROUPS[fmt]
    codes = torch.arange(256, dtype=torch.uint8)[None, :].expand(256, 256).contiguous()  # row s: all 256 bytes
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 512 // G).contiguous()
    out = triton_fp4.dequantize(codes.to(DEV), scales.to(DEV), fmt, dtype).cpu()
    ref = lowbit.dequantize(codes, scales, fmt, dtype)
    assert_same_bits(out, ref)
    nan_rows = torch.isnan(ref).all(dim=1)
    assert nan_rows.tolist() == [s in (NAN_SCALE[fmt], NAN_SCALE[fmt] | 0x80) for s in range(256)]
    assert torch.isinf(ref).any() == (fmt == "mxfp4")  # |E4M3 scale x E2M1| <= 2688 fits every output dtype


@examples(8)
@given(fmt=st.sampled_from(FP4), n=st.integers(1, 6), picks=st.lists(st.integers(-2, 5), min_size=0, max_size=9),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_fp4_dequantize_gathered_rows(fmt, n, picks, dtype, seed):
    """dequantize(rows=...): cache rows gathered in the launch, bit for bit the reference's decode of codes[rows]
    (a negative row decodes row 0), as a slot table's key and entry tables ask for them."""
    G = triton_fp4.GROUPS[fmt]
    codes, scales = lowbit.quantize(fp4_values(gen(seed), n, 2 * G, G), fmt)
    rows = torch.tensor([min(p, n - 1) for p in picks], dtype=torch.long)
    out = triton_fp4.dequantize(codes.to(DEV), scales.to(DEV), fmt, dtype, rows=rows.to(DEV))
    r = rows.clamp(min=0)
    assert out.shape == (len(picks), 2 * G)
    assert_same_bits(out.cpu(), lowbit.dequantize(codes[r], scales[r], fmt, dtype))


def test_fp4_through_ops_and_errors():
    x = fp4_values(gen(5), 4, 64, 32).to(DEV)
    ops = NvidiaOps(DEV)
    for fmt in FP4:
        codes, scales = ops.quantize_kv(x, fmt)
        ref = lowbit.quantize(x.cpu(), fmt)
        assert torch.equal(codes.cpu(), ref[0]) and torch.equal(scales.cpu(), ref[1])
        assert torch.equal(ops.dequantize_kv(codes, scales, fmt).cpu(), lowbit.dequantize(*ref, fmt))
    assert ops.kernel_calls["quantize_kv"] == 2 and ops.kernel_calls["dequantize_kv"] == 2
    with pytest.raises(ValueError, match="C=24"):
        triton_fp4.quantize(torch.zeros(2, 24, device=DEV), "mxfp4")
    with pytest.raises(ValueError, match="fmt"):
        triton_fp4.quantize(torch.zeros(2, 32, device=DEV), "fp8_e4m3_pow2")
    with pytest.raises(ValueError, match="scales"):
        triton_fp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8, device=DEV),
                              torch.zeros(2, 3, dtype=torch.uint8, device=DEV), "mxfp4")
    c, sc = torch.zeros(2, 16, dtype=torch.uint8, device=DEV), torch.zeros(2, 1, dtype=torch.uint8, device=DEV)
    for rows in (torch.zeros(3, dtype=torch.int32, device=DEV), torch.zeros(1, 3, dtype=torch.long, device=DEV), [0]):
        with pytest.raises(ValueError, match="rows must be int64"):
            triton_fp4.dequantize(c, sc, "mxfp4", rows=rows)
    with pytest.raises(ValueError, match="N > 0"):
        triton_fp4.dequantize(c[:0], sc[:0], "mxfp4", rows=torch.zeros(1, dtype=torch.long, device=DEV))


# ------------------------------------------------------------------------------------------- sparse attention
def decoded_entries(args, fmt):
    """An attention_case's FP4 entries decoded to bf16 [N, D] (exact)."""
    ec, es = args[3]
    return lowbit.dequantize(ec.cpu(), es.cpu(), fmt, torch.bfloat16)


def with_raw_entries(args, kw, rows):
    """The case with bf16 entry rows [N, D] in place of its FP4 ones, as raw bytes (entry_fmt "bf16")."""
    return (*args[:3], (rows.contiguous().view(torch.uint8).to(DEV), None), args[4]), dict(kw, entry_fmt="bf16")


def attention_case(g, rows, W, allowance, H, D, K, fmt, dtype, with_sinks, n_entries=None):
    """An engine-like step: rows = [(fresh_lo, n_queries, cut)] per sequence. Positions fresh_lo .. + n - 1 are
    this pass's queries (fresh KV rows); the ring holds the RING positions before fresh_lo. Every ring slot, ring
    row and cache row no query may read is poisoned with NaN. Returns (args, kwargs) of ced_sparse_attention."""
    RING = W + allowance
    R = len(rows)
    T = sum(n for _, n, _ in rows)
    S = R + 1
    ring_slot_of = torch.randperm(S, generator=g)[:R]
    rc = torch.full((S, RING, D), 0x7F, dtype=torch.uint8)
    rs = torch.full((S, RING, D // 32), 0xFF, dtype=torch.uint8)
    pos, cut, flo, fst, rsl = [], [], [], [], []
    start = 0
    for r, (lo, n, c) in enumerate(rows):
        old = torch.arange(lo - RING, lo)
        keep = old >= max(c, 0)  # older positions are never visible: their slots stay poisoned
        if keep.any():
            codes, scales = lowbit.quantize(torch.randn(int(keep.sum()), D, generator=g), "fp8_e4m3_pow2")
            rc[ring_slot_of[r], old[keep] % RING] = codes
            rs[ring_slot_of[r], old[keep] % RING] = scales
        pos += range(lo, lo + n)
        cut += [c] * n
        flo += [lo] * n
        fst += [start] * n
        rsl += [int(ring_slot_of[r])] * n
        start += n
    N = n_entries or max(2 * K, 4)
    ents = torch.randn(N, D, generator=g) * torch.pow(2.0, torch.randint(-3, 4, (N, 1), generator=g).float())
    ec, es = lowbit.quantize(ents, fmt)
    sel = torch.full((T, K), -1, dtype=torch.long)
    for t in range(T):
        k = int(torch.randint(0, K + 1, (1,), generator=g))
        chosen = torch.randperm(N - 1, generator=g)[:k] + 1  # row 0 is never chosen (poisoned below)
        sel[t, torch.randperm(K, generator=g)[:k]] = chosen  # -1 anywhere, not only at the end
    unused = torch.ones(N, dtype=torch.bool)
    unused[sel[sel >= 0]] = False
    es[unused] = NAN_SCALE[fmt]
    kv = torch.randn(T, D, generator=g).to(dtype)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    sinks = torch.randn(H, generator=g) if with_sinks else None
    lt = lambda v: torch.tensor(v, dtype=torch.long, device=DEV)  # noqa: E731
    args = (q.to(DEV), kv.to(DEV), (rc.to(DEV), rs.to(DEV)), (ec.to(DEV), es.to(DEV)), sel.to(DEV))
    kw = dict(pos=lt(pos), cut=lt(cut), fresh_lo=lt(flo), fresh_start=lt(fst), ring_slot=lt(rsl), window=W,
              ring_fmt="fp8_e4m3_pow2", entry_fmt=fmt, sinks=None if sinks is None else sinks.to(DEV),
              scale=D ** -0.5)
    return args, kw


@examples(15)
@given(rows=ced_attention_rows(), W=st.integers(1, 20), allowance=st.integers(0, 3), H=st.integers(1, 5),
       D=st.sampled_from([32, 64]), K=st.integers(0, 20), fmt=st.sampled_from(FP4), with_sinks=st.booleans(),
       splits=st.sampled_from([None, 1, 3]), seed=st.integers(0, 2**16))
def test_sparse_attention_float32(rows, W, allowance, H, D, K, fmt, with_sinks, splits, seed):
    args, kw = attention_case(gen(seed), rows, W, allowance, H, D, K, fmt, torch.float32, with_sinks)
    out = triton_ced_attention.sparse_attention(*args, num_splits=splits, **kw)
    ref = REF.ced_sparse_attention(*args, **kw)
    assert rel_err(out, ref) < 1e-5


@examples(6)
@given(rows=ced_attention_rows(2), W=st.integers(1, 20), H=st.integers(1, 4), K=st.integers(0, 20),
       fmt=st.sampled_from(FP4), dtype=st.sampled_from([torch.bfloat16, torch.float16]), with_sinks=st.booleans(),
       seed=st.integers(0, 2**16))
def test_sparse_attention_low_precision(rows, W, H, K, fmt, dtype, with_sinks, seed):
    args, kw = attention_case(gen(seed), rows, W, 1, H, 64, K, fmt, dtype, with_sinks)
    out = triton_ced_attention.sparse_attention(*args, **kw)
    assert out.dtype == dtype
    assert rel_err(out, REF.ced_sparse_attention(*args, **kw)) < 1e-2


@examples(10)
@given(rows=ced_attention_rows(2), W=st.integers(1, 12), H=st.integers(1, 4), D=st.sampled_from([32, 64]),
       K=st.integers(0, 12), R=st.sampled_from([2, 8, 16, 32]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       splits=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_sparse_attention_unrope_in_the_store(rows, W, H, D, K, R, dtype, splits, seed):
    """``unrope`` (the output's inverse RoPE in the DIRECT store and in the split merge) gives bit for bit the
    torch formula's inverse RoPE (functional.rope_rotate, the same angles) of the plain output; the ops'
    ``unrope`` matches the reference op's."""
    from deepinfer.models.ced import functional as fn

    args, kw = attention_case(gen(seed), rows, W, 1, H, D, K, "fp4_e2m1_e4m3", dtype, True)
    angles = fn.rope_cos_sin(kw["pos"], R, 10000.0)
    plain = triton_ced_attention.sparse_attention(*args, num_splits=splits, **kw)
    fused = triton_ced_attention.sparse_attention(*args, num_splits=splits, unrope=angles, **kw)
    assert_same_bits(fused, fn.rope_rotate(plain, *angles, inverse=True))
    assert torch.equal(fused[..., :D - R], plain[..., :D - R])  # the other channels as stored
    ops = NvidiaOps(DEV)
    got = ops.ced_sparse_attention(*args, unrope=angles, **kw)
    want = REF.ced_sparse_attention(*args, unrope=angles, **kw)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    bad = [(angles[0].double(), angles[1].double()), (angles[0], torch.cat([angles[1]] * 2, 1)), angles[0],
           tuple(fn.rope_cos_sin(kw["pos"], D + 2, 10000.0))]
    for unrope in bad:
        with pytest.raises(ValueError, match="unrope must be"):
            triton_ced_attention.sparse_attention(*args, unrope=unrope, **kw)


@examples(8)
@given(rows=ced_attention_rows(2), W=st.integers(1, 12), H=st.integers(1, 3), K=st.integers(0, 40),
       fmt=st.sampled_from(FP4), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       splits=st.sampled_from([None, 1, 2, 5]), seed=st.integers(0, 2**16))
def test_sparse_attention_prefetch_same_bits(rows, W, H, K, fmt, dtype, splits, seed):
    """The software-pipelined entry loop (launch key "prefetch") folds the same tiles in the same order as the
    plain one: the same bits, whatever the split count (its prefetches stop at its split's last tile), and the
    reference op's values."""
    args, kw = attention_case(gen(seed), rows, W, 1, H, 32, K, fmt, dtype, True)
    launch = dict(triton_ced_attention.launch_config(H, 32, dtype))
    launch.pop("BLOCK_D")
    plain = triton_ced_attention.sparse_attention(*args, num_splits=splits, launch=dict(launch, prefetch=0), **kw)
    piped = triton_ced_attention.sparse_attention(*args, num_splits=splits, launch=dict(launch, prefetch=1), **kw)
    assert_same_bits(piped, plain)
    assert rel_err(piped, REF.ced_sparse_attention(*args, **kw)) < (1e-5 if dtype == torch.float32 else 1e-2)


def valid_first(sel: torch.Tensor) -> torch.Tensor:
    """Each row's valid slots first, in their order, then its -1s (the indexer's top-K layout)."""
    K = sel.shape[1]
    key = torch.where(sel >= 0, 0, 1) * (K + 1) + torch.arange(K, device=sel.device)
    return sel.gather(1, key.argsort(1))


@examples(10)
@given(rows=ced_attention_rows(2), W=st.integers(1, 12), H=st.integers(1, 3), K=st.integers(0, 70),
       fmt=st.sampled_from(FP4), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       splits=st.sampled_from([None, 1, 2, 5]), prefetch=st.sampled_from([0, 1]), at_end=st.booleans(),
       seed=st.integers(0, 2**16))
def test_sparse_attention_dynamic_entries_same_bits(rows, W, H, K, fmt, dtype, splits, prefetch, at_end, seed):
    """The entry loop bounded by each split's last valid slot (launch key "dynamic") gives the static loop's bits:
    with the -1s anywhere (attention_case) or, as the indexer pads its top-K, after the last valid entry; with
    either entry loop and any split count."""
    args, kw = attention_case(gen(seed), rows, W, 1, H, 32, K, fmt, dtype, True)
    if at_end:
        args = (*args[:4], valid_first(args[4]))
    launch = dict(triton_ced_attention.launch_config(H, 32, dtype), prefetch=prefetch)
    launch.pop("BLOCK_D")
    static = triton_ced_attention.sparse_attention(*args, num_splits=splits, launch=dict(launch, dynamic=0), **kw)
    dynamic = triton_ced_attention.sparse_attention(*args, num_splits=splits, launch=dict(launch, dynamic=1), **kw)
    assert_same_bits(dynamic, static)
    assert rel_err(dynamic, REF.ced_sparse_attention(*args, **kw)) < (1e-5 if dtype == torch.float32 else 1e-2)


@examples(8)
@given(rows=ced_attention_rows(2), W=st.integers(1, 12), H=st.integers(1, 3), K=st.integers(0, 40),
       fmt=st.sampled_from(FP4), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       splits=st.sampled_from([None, 1, 3]), seed=st.integers(0, 2**16))
def test_sparse_attention_raw_bf16_entries(rows, W, H, K, fmt, dtype, splits, seed):
    """Entries as raw bf16 bytes (entry_fmt "bf16"): FP4 entries decoded to bf16 (exact) give the FP4 launch's
    bits; values no FP4 code holds match the reference op; fp16 queries (which would round bf16 entries) and
    scaled raw entries are refused."""
    args, kw = attention_case(gen(seed), rows, W, 1, H, 32, K, fmt, dtype, True)
    launch = dict(triton_ced_attention.launch_config(H, 32, dtype), prefetch=0)
    launch.pop("BLOCK_D")
    table = decoded_entries(args, fmt)
    raw, kwr = with_raw_entries(args, kw, table)
    fp4 = triton_ced_attention.sparse_attention(*args, num_splits=splits, launch=launch, **kw)
    got = triton_ced_attention.sparse_attention(*raw, num_splits=splits, launch=launch, **kwr)
    assert_same_bits(got, fp4)
    g = gen(seed + 1)
    raw, kwr = with_raw_entries(args, kw, (torch.randn(table.shape[0], 32, generator=g) * 3).to(torch.bfloat16))
    got = triton_ced_attention.sparse_attention(*raw, num_splits=splits, **kwr)
    assert rel_err(got, REF.ced_sparse_attention(*raw, **kwr)) < (1e-5 if dtype == torch.float32 else 1e-2)
    half = (args[0].half(), args[1].half(), *raw[2:])
    assert not triton_ced_attention.supports(*half[:5], "fp8_e4m3_pow2", "bf16")
    assert not triton_ced_attention.supports(*args[:3], (raw[3][0], args[3][1]), args[4], "fp8_e4m3_pow2", "bf16")
    with pytest.raises(ValueError, match="unsupported inputs"):
        triton_ced_attention.sparse_attention(*half, **kwr)


@examples(10)
@given(rows=ced_attention_rows(2), chunk=st.tuples(st.integers(0, 30), st.integers(1, 80)), W=st.integers(1, 40),
       H=st.integers(1, 3), D=st.sampled_from([32, 64, 96]), K=st.integers(0, 40), fmt=st.sampled_from((*FP4, "bf16")),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), block_n=st.sampled_from([16, 32, 64]),
       splits=st.sampled_from([None, 1, 3]), seed=st.integers(0, 2**16))
def test_sparse_attention_transposed(rows, chunk, W, H, D, K, fmt, dtype, block_n, splits, seed):
    """The transposed products (launch key "trans": keys x heads scores, latent x heads output; the window's ring
    tiles decoded in the kernel 16 keys a step, then its fresh-only tiles as row loads) compute the same function:
    against the reference op, on FP4 or raw bf16 entries, windows reaching into the FP8 ring by any number of keys
    (up to 40, tiles of 16-64), any split count, latents narrower than their power-of-two tile (96), with a prefill
    chunk of up to 80 queries beside decode-like rows (its later queries' windows fresh rows only). A bad value is
    refused by name."""
    rows = [*rows, (*chunk, chunk[0])]
    args, kw = attention_case(gen(seed), rows, W, 1, H, D, K, "fp4_e2m1_e4m3" if fmt == "bf16" else fmt, dtype, True)
    if fmt == "bf16":  # entries no FP4 code holds, as raw bf16 bytes
        args, kw = with_raw_entries(args, kw, (torch.randn(args[3][0].shape[0], D, generator=gen(seed + 1)) * 3)
                                    .to(torch.bfloat16))
    launch = dict(triton_ced_attention.launch_config(H, D, dtype), BLOCK_N=block_n, trans=1)
    launch.pop("BLOCK_D")
    got = triton_ced_attention.sparse_attention(*args, num_splits=splits, launch=launch, **kw)
    assert rel_err(got, REF.ced_sparse_attention(*args, **kw)) < (1e-5 if dtype == torch.float32 else 1e-2)
    for key, bad in (("trans", 2), ("maxnreg", 300)):
        with pytest.raises(ValueError, match=key):
            triton_ced_attention.sparse_attention(*args, launch={**launch, key: bad}, **kw)


@pytest.mark.parametrize("fmt", FP4)
def test_sparse_attention_bench_latent_width(fmt):
    """The bench latent's launch config (16 heads x D = 512: BLOCK_H 16, BLOCK_D 512, BLOCK_N 16, as compiled on
    the GPU) on a few rows: decode rows, a chunk reading the ring, a swa-like row without entries; auto and
    forced splits."""
    args, kw = attention_case(gen(11), [(40, 1, 0), (300, 1, 0), (9, 3, 2)], 24, 4, 16, 512, 40, fmt, torch.bfloat16,
                              True)
    want = REF.ced_sparse_attention(*args, **kw)
    cfg = triton_ced_attention.launch_config(16, 512, torch.bfloat16)
    assert (cfg["BLOCK_H"], cfg["BLOCK_D"], cfg["BLOCK_N"]) == (16, 512, 16)
    for splits in (None, 1, 7):
        assert rel_err(triton_ced_attention.sparse_attention(*args, num_splits=splits, **kw), want) < 1e-2
    none = (*args[:3], None, args[4][:, :0])
    assert rel_err(triton_ced_attention.sparse_attention(*none, **kw), REF.ced_sparse_attention(*none, **kw)) < 1e-2


def test_sparse_attention_ops_dispatch_fallback_and_errors():
    args, kw = attention_case(gen(3), [(9, 3, 2), (0, 2, 0)], 6, 2, 3, 32, 5, "mxfp4", torch.float32, True)
    ops = NvidiaOps(DEV)
    out = ops.ced_sparse_attention(*args, **kw)
    assert ops.kernel_calls["ced_sparse_attention"] == 1
    assert rel_err(out, REF.ced_sparse_attention(*args, **kw)) < 1e-5
    # No global branch (a swa layer): entries None, K = 0.
    none = (*args[:3], None, args[4][:, :0])
    assert rel_err(ops.ced_sparse_attention(*none, **kw), REF.ced_sparse_attention(*none, **kw)) < 1e-5
    # A lossless (raw float32) ring is not a kernel format: the reference op runs.
    q, kv = args[0], args[1]
    ring32 = (torch.zeros(3, 8, 4 * 32, dtype=torch.uint8, device=DEV),
              torch.zeros(3, 8, 0, dtype=torch.uint8, device=DEV))
    kw32 = dict(kw, ring_fmt="fp32", ring_slot=torch.zeros_like(kw["ring_slot"]))
    assert torch.equal(ops.ced_sparse_attention(q, kv, ring32, *args[3:], **kw32),
                       REF.ced_sparse_attention(q, kv, ring32, *args[3:], **kw32))
    assert ops.kernel_calls["ced_sparse_attention"] == 2
    with pytest.raises(ValueError, match="cut"):
        triton_ced_attention.sparse_attention(*args, **dict(kw, cut=kw["cut"].int()))
    with pytest.raises(ValueError, match="window"):
        triton_ced_attention.sparse_attention(*args, **dict(kw, window=0))
    with pytest.raises(ValueError, match="entry_fmt"):
        triton_ced_attention.sparse_attention(*args, **dict(kw, entry_fmt="fp8_e4m3_pow2"))


# ------------------------------------------------------------------------------------------- indexer
def indexer_case(g, row_js, queries, nh, dh, fmt, dtype, dup, with_allowed):
    """row_js: entries per sequence; queries: queries per sequence. Cache rows no sequence owns are poisoned."""
    R = len(row_js)
    N = sum(row_js) + 3
    keys = torch.randn(N, dh, generator=g)
    if dup:  # repeated keys: exact score ties
        keys[torch.randint(0, N, (N // 3,), generator=g)] = keys[0].clone()
    codes, scales = lowbit.quantize(keys, fmt)
    perm = torch.randperm(N, generator=g)
    Jmax = max(row_js)
    slots = torch.zeros(R, Jmax, dtype=torch.long)
    owned = torch.zeros(N, dtype=torch.bool)
    at = 0
    for r, J in enumerate(row_js):
        mine = perm[at:at + J]
        at += J
        owned[mine] = True
        if J:
            slots[r, :J] = mine
            slots[r, J:] = mine[-1]  # as the engine pads: the last entry's row
    scales[~owned] = NAN_SCALE[fmt]
    q_rows, nvis = [], []
    for r, (J, n) in enumerate(zip(row_js, queries)):
        q_rows += [r] * n
        nvis += torch.randint(0, J + 1, (n,), generator=g).tolist()
    Tq = len(q_rows)
    q = torch.randn(Tq, nh, dh, generator=g).to(dtype)
    w = torch.randn(Tq, nh, generator=g).to(dtype)
    allowed = (torch.rand(Tq, Jmax, generator=g) < 0.7).to(DEV) if with_allowed else None
    lt = lambda v: torch.tensor(v, dtype=torch.long, device=DEV)  # noqa: E731
    return (q.to(DEV), w.to(DEV), (codes.to(DEV), scales.to(DEV)), fmt, slots.to(DEV), lt(q_rows), lt(nvis)), allowed


def check_same_topk(ids, ref, ref_scores, tol):
    """The kernel's ids: ascending, -1 after the last, as many as the reference's, and the same set except for
    entries whose reference scores tie (within tol) at the K-th place."""
    for t in range(ids.shape[0]):
        mine, theirs = ids[t][ids[t] >= 0], ref[t][ref[t] >= 0]
        n = mine.numel()
        assert n == theirs.numel() and bool((ids[t][n:] == -1).all())
        assert bool((mine[1:] > mine[:-1]).all()), "ids must come in ascending order"
        a, b = set(mine.tolist()), set(theirs.tolist())
        if a != b:
            s = ref_scores[t]
            kth = float(s[theirs].min())
            for j in a ^ b:
                assert abs(float(s[j]) - kth) <= tol, (t, sorted(a), sorted(b))


def check_indexer_against_reference(ids, scores, args, k, allowed=None):
    """An indexer call's (ids, scores) against the reference op on the same inputs: visible scores
    close, the rest -inf, the same selected sets but for ties at the K-th place."""
    ref, ref_scores = REF.ced_indexer_topk(*args, k, allowed=allowed, return_scores=True)
    vis = torch.arange(scores.shape[1], device=DEV)[None, :] < args[6][:, None]
    zero = torch.zeros_like(scores)
    assert_logits_close(torch.where(vis, scores, zero), torch.where(vis, ref_scores, zero), factor=SCORE_FACTOR,
                        dtype=torch.float32)
    assert bool((scores[~vis] == float("-inf")).all())
    tol = 1e-5 * float(ref_scores[vis].abs().max()) if bool(vis.any()) else 0.0
    check_same_topk(ids.cpu(), ref.cpu(), ref_scores.cpu(), tol)


@examples(15)
@given(row_js=st.lists(st.integers(0, 40), min_size=1, max_size=3), nh=st.integers(1, 4),
       dh=st.sampled_from([32, 64]), fmt=st.sampled_from(FP4), k=st.integers(1, 12), dup=st.booleans(),
       with_allowed=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16), data=st.data())
def test_indexer_topk_matches_reference(row_js, nh, dh, fmt, k, dup, with_allowed, dtype, seed, data):
    """bf16 too: the products of bf16 queries and FP4 keys are exact in float32, as in the reference."""
    queries = data.draw(st.lists(st.integers(1, 3), min_size=len(row_js), max_size=len(row_js)))
    args, allowed = indexer_case(gen(seed), row_js, queries, nh, dh, fmt, dtype, dup, with_allowed)
    ops = NvidiaOps(DEV)
    ids, scores = ops.ced_indexer_topk(*args, k, allowed=allowed, return_scores=True)
    assert ops.kernel_calls["ced_indexer_topk"] == 1
    check_indexer_against_reference(ids, scores, args, k, allowed)


@examples(8)
@given(row_js=st.lists(st.integers(0, 24), min_size=1, max_size=3), nh=st.integers(1, 3),
       fmt=st.sampled_from(FP4), block_q=st.sampled_from([2, 4]), dtype=st.sampled_from([torch.float32,
                                                                                        torch.bfloat16]),
       seed=st.integers(0, 2**16), data=st.data())
def test_indexer_scores_in_query_blocks(row_js, nh, fmt, block_q, dtype, seed, data):
    """The score kernel's prefill blocking (BLOCK_Q queries a program, launch_config's choice from 64 queries):
    blocks within one sequence decode their keys once; blocks that span sequences, and the last partial block,
    take each query's own keys. Scores and selections as the reference's."""
    queries = data.draw(st.lists(st.integers(1, 6), min_size=len(row_js), max_size=len(row_js)))
    args, _ = indexer_case(gen(seed), row_js, queries, nh, 32, fmt, dtype, False, False)
    k = 5
    q, w, (codes, scales), *rest = args
    ids, scores = triton_ced_indexer.indexer_topk(q, w, codes, scales, *rest, k, return_scores=True,
                                                  launch={"BLOCK_Q": block_q})
    check_indexer_against_reference(ids, scores, args, k)


def test_indexer_refuses_bad_launch_overrides():
    """Unknown keys, a head or latent tile other than the shape's own, tiles off the powers of two: refused, named."""
    args, _ = indexer_case(gen(3), [12], [2], 2, 32, "mxfp4", torch.float32, False, False)
    q, w, (codes, scales), *rest = args
    for launch, msg in ((dict(BLOCK_Q=3), "BLOCK_Q must be a power of two"), (dict(TILE=4), r"unknown keys \['TILE'\]"),
                        (dict(BLOCK_D=16), r"BLOCK_D must be a power of two in \[32, 32\]"),
                        (dict(BLOCK_H=32), r"BLOCK_H must be a power of two in \[16, 16\]"),
                        (dict(BLOCK_J=8), r"BLOCK_J must be a power of two in \[16, 256\], got 8")):
        with pytest.raises(ValueError, match=msg):
            triton_ced_indexer.indexer_topk(q, w, codes, scales, *rest, 3, launch=launch)


@examples(10)
@given(Tq=st.integers(1, 4), J=st.integers(1, 100), k=st.integers(1, 40), levels=st.integers(1, 6),
       with_allowed=st.booleans(), block=st.sampled_from([None, 16, 128]), seed=st.integers(0, 2**16))
# A visible, allowed entry scored -inf (id 2) with a masked one below it: select_topk used to drop it there
# (its -inf tail took the masked id 0 and turned it into -1) while the kernel chose it.
@example(Tq=1, J=19, k=7, levels=6, with_allowed=True, block=None, seed=0)
@example(Tq=1, J=19, k=7, levels=6, with_allowed=True, block=16, seed=0)
def test_topk_select_exact_ties(Tq, J, k, levels, with_allowed, block, seed):
    """Scores from a handful of values (many exact ties, -0.0 next to +0.0, -inf): the same set as
    select_topk, ties going to the lower id, whether the row fits one tile or spans several; an entry
    scored -inf is never chosen. The search settling one or two bits a pass or interpolating (search 1), stopping
    early or not, the ties' prefix sum taken always or only where some are left out (lazy_ties)."""
    for digit, early, search, lazy in ((1, False, 0, False), (2, True, 0, True), (1, True, 0, False),
                                       (1, True, 1, True), (1, False, 1, False)):
        topk_ties_case(Tq, J, k, levels, with_allowed, block, seed, digit, early, search=search, lazy_ties=lazy)


@examples(10)
@given(Tq=st.integers(1, 3), J=st.integers(1, 300), k=st.integers(1, 64), spread=st.floats(1e-3, 1e3),
       with_allowed=st.booleans(), block=st.sampled_from([None, 64]), digit=st.sampled_from([1, 2]),
       early=st.booleans(), search=st.sampled_from([0, 1]), lazy=st.booleans(), seed=st.integers(0, 2**16))
def test_topk_select_continuous_scores(Tq, J, k, spread, with_allowed, block, digit, early, search, lazy, seed):
    """Scores spread over many binades (few ties: the early stop, where exactly K keys reach the search's
    prefix, happens well before the last bit): the same set as select_topk in every search variant."""
    topk_ties_case(Tq, J, k, 0, with_allowed, block, seed, digit, early, spread, search=search, lazy_ties=lazy)


def test_topk_select_rows_at_and_just_past_k():
    """Rows of K - 1 .. K + 2 visible entries (a row of at most K takes every eligible one without a search; one more
    and the search runs): the reference's set in each, the -inf and disallowed entries never chosen."""
    from deepinfer.models.ced import functional as fn

    g = gen(21)
    for k in (1, 3, 8):
        nvis = torch.tensor([k - 1, k, k + 1, k + 2, k + 1], device=DEV)
        scores = torch.randn(5, k + 6, generator=g).to(DEV)
        scores[4, 0] = float("-inf")  # the last row: k + 1 visible, one of them -inf
        for allowed in (None, (torch.rand(5, k + 6, generator=g) < 0.8).to(DEV)):
            ok = torch.arange(k + 6, device=DEV)[None, :] < nvis[:, None]
            if allowed is not None:
                ok &= allowed
            ref = fn.select_topk(scores, ok, k)
            for digit, early, search in ((1, False, 0), (1, True, 0), (2, True, 0), (1, True, 1), (1, False, 1)):
                ids = triton_ced_indexer.topk_select(scores, nvis, k, allowed, digit=digit, early=early,
                                                     search=search, lazy_ties=search == 1)
                for t in range(5):
                    mine, theirs = ids[t][ids[t] >= 0], ref[t][ref[t] >= 0]
                    assert sorted(mine.tolist()) == sorted(theirs.tolist()) == mine.tolist(), (k, t, digit, early)


def topk_ties_case(Tq, J, k, levels, with_allowed, block, seed, digit, early, spread=None, search=0,
                   lazy_ties=False):
    from deepinfer.models.ced import functional as fn

    g = gen(seed)
    if spread is None:
        vals = torch.tensor([0.0, -0.0, 1.5, -2.0, 3.0, float("-inf"), 1e30, -1e-30])[:max(2, levels)]
        scores = vals[torch.randint(0, len(vals), (Tq, J), generator=g)].to(DEV)
    else:
        scores = (torch.randn(Tq, J, generator=g) * torch.exp(torch.randn(Tq, J, generator=g) * 3) * spread).to(DEV)
    nvis = torch.randint(0, J + 1, (Tq,), generator=g).to(DEV)
    allowed = (torch.rand(Tq, J, generator=g) < 0.6).to(DEV) if with_allowed else None
    ids = triton_ced_indexer.topk_select(scores, nvis, k, allowed, block=block, digit=digit, early=early,
                                         search=search, lazy_ties=lazy_ties)
    ok = torch.arange(J, device=DEV)[None, :] < nvis[:, None]
    if allowed is not None:
        ok &= allowed
    ref = fn.select_topk(scores, ok, k)
    for t in range(Tq):
        mine, theirs = ids[t][ids[t] >= 0], ref[t][ref[t] >= 0]
        assert sorted(mine.tolist()) == sorted(theirs.tolist()) == mine.tolist()
        assert bool((ids[t][mine.numel():] == -1).all())
        assert mine.numel() == min(k, int((ok[t] & (scores[t] != float("-inf"))).sum()))


@examples(10)
@given(Tq=st.integers(1, 3), J=st.integers(2, 200), k=st.integers(1, 48), share=st.floats(0.0, 1.0),
       with_allowed=st.booleans(), seed=st.integers(0, 2**16))
def test_topk_select_extreme_scores(Tq, J, k, share, with_allowed, seed):
    """Scores mixing the float range's ends with ordinary ones: +inf, the largest finite magnitudes, subnormals, signed
    zeros, -inf (``share`` of them extreme). The interpolation's probes between such ends are not finite or not
    representable, so it must fall back to bisecting keys; every search variant picks select_topk's set."""
    g = gen(seed)
    ends = torch.tensor([float("inf"), 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1.2e-38, 0.0, -0.0,
                         float("-inf")])
    scores = torch.randn(Tq, J, generator=g) * torch.exp(torch.randn(Tq, J, generator=g) * 4)
    pick = torch.rand(Tq, J, generator=g) < share
    scores[pick] = ends[torch.randint(0, len(ends), (int(pick.sum()),), generator=g)]
    scores = scores.to(DEV)
    nvis = torch.randint(0, J + 1, (Tq,), generator=g).to(DEV)
    allowed = (torch.rand(Tq, J, generator=g) < 0.7).to(DEV) if with_allowed else None
    from deepinfer.models.ced import functional as fn

    ok = torch.arange(J, device=DEV)[None, :] < nvis[:, None]
    if allowed is not None:
        ok &= allowed
    ref = fn.select_topk(scores, ok, k)
    for digit, early, search, lazy in ((1, True, 0, False), (2, True, 0, False), (1, True, 1, True),
                                       (1, False, 1, False)):
        ids = triton_ced_indexer.topk_select(scores, nvis, k, allowed, digit=digit, early=early, search=search,
                                             lazy_ties=lazy)
        for t in range(Tq):
            mine, theirs = ids[t][ids[t] >= 0], ref[t][ref[t] >= 0]
            assert sorted(mine.tolist()) == sorted(theirs.tolist()) == mine.tolist(), (t, digit, early, search)


def test_topk_select_never_minus_inf():
    """A visible -inf entry is not chosen even where no masked entry precedes it, by either side."""
    from deepinfer.models.ced import functional as fn

    scores = torch.tensor([[1.0, float("-inf"), 2.0, float("-inf")], [float("-inf")] * 4], device=DEV)
    nvis = torch.tensor([4, 4], device=DEV)
    want = [[0, 2, -1, -1], [-1] * 4]
    for block in (None, 2):
        for digit, early, search in ((1, False, 0), (2, True, 0), (1, True, 0), (1, True, 1), (1, False, 1)):
            assert triton_ced_indexer.topk_select(scores, nvis, 4, block=block, digit=digit, early=early,
                                                  search=search, lazy_ties=search == 1).tolist() == want
    ref = fn.select_topk(scores, torch.ones_like(scores, dtype=torch.bool), 4)
    assert ref.tolist() == [[2, 0, -1, -1], [-1] * 4]  # by descending score there


def test_indexer_errors_and_empty():
    args, _ = indexer_case(gen(1), [5, 0], [2, 1], 2, 32, "mxfp4", torch.float32, False, False)
    q, w, (codes, scales), fmt, slots, q_rows, nvis = args
    with pytest.raises(ValueError, match="q_rows"):
        triton_ced_indexer.indexer_topk(q, w, codes, scales, fmt, slots, q_rows[:1], nvis, 3)
    with pytest.raises(ValueError, match="num_visible"):
        triton_ced_indexer.indexer_topk(q, w, codes, scales, fmt, slots, q_rows, nvis.float(), 3)
    with pytest.raises(ValueError, match="allowed"):
        triton_ced_indexer.indexer_topk(q, w, codes, scales, fmt, slots, q_rows, nvis, 3,
                                        allowed=torch.ones(3, 2, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="k must"):
        triton_ced_indexer.topk_select(torch.zeros(3, 5, device=DEV), nvis, 0)
    with pytest.raises(ValueError, match="digit must be 1 or 2, got 3"):
        triton_ced_indexer.topk_select(torch.zeros(3, 5, device=DEV), nvis, 2, digit=3)
    with pytest.raises(ValueError, match=r"search must be 0 \(bits\) or 1 \(interpolation\), got 2"):
        triton_ced_indexer.topk_select(torch.zeros(3, 5, device=DEV), nvis, 2, search=2)
    with pytest.raises(ValueError, match="unsupported"):
        triton_ced_indexer.indexer_topk(q, w, codes, scales, "fp8_e4m3_pow2", slots, q_rows, nvis, 3)
    # No complete entry yet (J = 0): every id is -1, as the reference.
    ids, sc = triton_ced_indexer.indexer_topk(q, w, codes, scales, fmt, slots[:, :0], q_rows, nvis * 0, 4,
                                              return_scores=True)
    assert ids.shape == (3, 4) and bool((ids == -1).all()) and sc.shape == (3, 0)


# ------------------------------------------------------------------------------------------- end to end
def test_ced_engine_greedy_tokens_match_reference(tmp_path):
    """The whole CED engine path (prefill chunks, decode, rings, paged FP4 entries, every layer mode) on NvidiaOps
    gives the reference backend's greedy tokens."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.testing.ced import build_ced_checkpoint

    cfg = build_ced_checkpoint(tmp_path, seed=3, hidden_size=32, num_layers=5, num_encoder_layers=2, num_heads=2,
                               head_dim=32, rope_dim=8, q_lora_rank=32, out_groups=2, out_group_dim=32, n_win=4,
                               swa_allowance=1, layer_modes=("swa", "full", "full", "reindex", "reuse"),
                               encoder_ratio=2, index_heads=2, index_head_dim=32, index_topk=3, pool_block=2,
                               pool_blocks=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               max_position_embeddings=256)
    g = gen(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 13)]
    # 4 tokens: both rows decode past their SWA window (n_win 4: the short row's decode steps at positions 3-5,
    # the last one wrapping its 5-slot ring) and complete entries (ratio 2: at positions 3 and 5); each interpreted
    # step costs ~6 s (5 tokens added a step, 8 tokens four, of the same paths)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "nvidia"):
        # float32 on either device: in bf16 a tiny random model's greedy argmax has near-ties that two correct
        # implementations may break differently (tests/test_gpu_parity.py bounds the bf16 error instead).
        llm = LLM(str(tmp_path), backend=backend, device=str(DEV), dtype="float32", block_size=4, num_kv_blocks=32,
                  max_num_batched_tokens=8, max_num_seqs=2)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if backend == "nvidia":
            calls = llm.engine.ops.kernel_calls
            assert calls["ced_sparse_attention"] > 0 and calls["ced_indexer_topk"] > 0
            # the low-bit caches written by a kernel: the fused SWA-key and compress-write ones on CUDA (prefill
            # and decode), the quantizer where the fused ops are not taken (the interpreter on the CPU)
            assert calls["quantize_kv"] + calls["ced_swa_kv"] + calls["ced_compress_write"] > 0, calls
    assert tokens["nvidia"] == tokens["reference"]


def test_ced_engine_entry_table_same_logprobs(tmp_path, monkeypatch):
    """A prefill's entries decoded once into a bf16 table (NvidiaOps.ced_entry_table, its read threshold lowered
    so the tiny prompts take it) give the in-place FP4 path's tokens and log-probabilities bit for bit: two
    prompts of different lengths in one batch, the second split across two passes (the token budget), so the
    table holds rows of both sequences with different entry counts."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.backends.nvidia import ops as nv_ops
    from deepinfer.testing.ced import build_ced_checkpoint

    cfg = build_ced_checkpoint(tmp_path, seed=5, hidden_size=32, num_layers=3, num_encoder_layers=1, num_heads=2,
                               head_dim=32, rope_dim=8, q_lora_rank=32, out_groups=2, out_group_dim=32, n_win=4,
                               swa_allowance=1, layer_modes=("full", "full", "reuse"), encoder_ratio=2,
                               index_heads=2, index_head_dim=32, index_topk=3, pool_block=2, pool_blocks=2,
                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               max_position_embeddings=256)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen(2 + n)).tolist() for n in (12, 9)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2)  # (the prefill reads the table)
    got, tables = {}, []
    build = nv_ops.NvidiaOps.ced_entry_table

    def recorded(self, entries, fmt, slots, reads, dtype):
        table = build(self, entries, fmt, slots, reads, dtype)
        tables.append(tuple(slots.shape) if table is not None else None)
        return table

    monkeypatch.setattr(nv_ops.NvidiaOps, "ced_entry_table", recorded)
    for on in (False, True):
        monkeypatch.setattr(nv_ops, "ENTRY_TABLE", on)
        monkeypatch.setattr(nv_ops, "ENTRY_TABLE_READS", 1)
        llm = LLM(str(tmp_path), backend="nvidia", device=str(DEV), dtype="bfloat16", block_size=4,
                  num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs=2)
        outs = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        got[on] = [(o.token_ids, [sorted(d.items()) for d in o.logprobs]) for o in outs]
        assert (llm.engine.ops.kernel_calls["ced_entry_table"] > 0) == on
    assert got[True] == got[False]
    assert any(shape is not None and shape[0] == 2 for shape in tables), tables  # (both sequences in one table)


# ------------------------------------------------------------------------------------------- GPU only
def bench_config():
    from deepinfer.models.ced.config import SIZES, CEDConfig

    return CEDConfig(**SIZES["bench"])  # what `deepinfer init-model --arch ced --size bench` builds


@gpu
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_sparse_attention_bench_shapes(fmt):
    c = bench_config()
    g = gen(1)
    decode = [(int(p), 1, 0) for p in torch.randint(c.n_win, 6000, (48,), generator=g)]  # 48 decode rows
    prefill = [(700, 300, 572)]  # a 300-token chunk after a cached prefix, replay cut 128 before it
    for rows in (decode, prefill, decode[:2]):
        args, kw = attention_case(g, rows, c.n_win, c.swa_allowance, c.num_heads, c.head_dim, c.index_topk, fmt,
                                  torch.bfloat16, c.use_sink)
        want = REF.ced_sparse_attention(*args, **kw)
        for splits in (None, 1, 7):
            out = triton_ced_attention.sparse_attention(*args, num_splits=splits, **kw)
            torch.cuda.synchronize()
            assert rel_err(out, want) < 1e-2


@gpu
def test_gpu_sparse_attention_transposed_bench_shapes():
    """The transposed products (launch key trans; registers capped or not: maxnreg) compiled at the bench latent on
    the launches ced_attn_sweep.py times for the raw-entry prefill chunk (64 keys on 4 / 8 warps, 1-3 stages:
    warp-group MMAs; 32 keys, capped at 168 or 128; 128 keys),
    and on FP4 entries and decode rows: the reference op's values. The chunk's queries read the ring (the first
    W - 1), fresh rows only (the rest), or both."""
    c = bench_config()
    g = gen(3)
    decode = [(int(p), 1, 0) for p in torch.randint(c.n_win, 6000, (16,), generator=g)]
    for rows, raw in ((decode, False), ([(700, 300, 572)], True), ([(700, 300, 572)], False)):
        args, kw = attention_case(g, rows, c.n_win, c.swa_allowance, c.num_heads, c.head_dim, c.index_topk,
                                  "fp4_e2m1_e4m3", torch.bfloat16, c.use_sink)
        if raw:  # the prefill's entry table: the FP4 entries decoded to bf16 rows
            args, kw = with_raw_entries(args, kw, decoded_entries(args, "fp4_e2m1_e4m3"))
        want = REF.ced_sparse_attention(*args, **kw)
        T, K = args[0].shape[0], args[4].shape[1]
        base, splits = triton_ced_attention.wide_launch(T, c.num_heads, c.head_dim, torch.bfloat16, c.n_win, K, raw)
        base = {k: v for k, v in base.items() if k != "maxnreg"}
        for bn, warps, stages, nreg in ((64, 4, 1, 0), (64, 8, 2, 0), (64, 8, 3, 0), (32, 4, 2, 0), (32, 4, 2, 168),
                                        (32, 4, 3, 168), (32, 4, 2, 128), (128, 8, 1, 0)):
            launch = dict(base, BLOCK_N=bn, num_warps=warps, num_stages=stages, trans=1,
                          **({"maxnreg": nreg} if nreg else {}))
            out = triton_ced_attention.sparse_attention(*args, num_splits=splits, launch=launch, **kw)
            torch.cuda.synchronize()
            assert rel_err(out, want) < 1e-2, (rows[0], raw, launch)


@gpu
def test_gpu_sparse_attention_unrope_bench_shapes():
    """The compiled epilogues (split merge at decode, DIRECT at a prefill chunk's wide launch) give the torch
    formula's inverse RoPE bit for bit: their products are never contracted into FMAs."""
    from deepinfer.models.ced import functional as fn

    c = bench_config()
    g = gen(2)
    decode = [(int(p), 1, 0) for p in torch.randint(c.n_win, 60000, (16,), generator=g)]
    for rows in (decode, [(700, 300, 572)]):
        args, kw = attention_case(g, rows, c.n_win, c.swa_allowance, c.num_heads, c.head_dim, c.index_topk,
                                  "fp4_e2m1_e4m3", torch.bfloat16, c.use_sink)
        angles = fn.rope_cos_sin(kw["pos"], c.rope_dim, c.rope_theta)
        for splits in (None, 1, 5):
            plain = triton_ced_attention.sparse_attention(*args, num_splits=splits, **kw)
            fused = triton_ced_attention.sparse_attention(*args, num_splits=splits, unrope=angles, **kw)
            assert_same_bits(fused, fn.rope_rotate(plain, *angles, inverse=True))


@gpu
@pytest.mark.parametrize("dynamic", [False, True])
def test_gpu_sparse_attention_in_cuda_graph(dynamic, monkeypatch):
    """No host sync, splits from shapes only: capture once, replay with new queries, positions and entries (with
    DYNAMIC_ENTRIES, each replay's entry loops bounded by its own slots' last valid one)."""
    monkeypatch.setattr(triton_ced_attention, "DYNAMIC_ENTRIES", dynamic)
    c = bench_config()
    g = gen(2)
    rows = [(int(p), 1, 0) for p in torch.randint(c.n_win, 3000, (8,), generator=g)]
    args, kw = attention_case(g, rows, c.n_win, c.swa_allowance, c.num_heads, c.head_dim, c.index_topk,
                              "fp4_e2m1_e4m3", torch.bfloat16, True)
    where = ("pos", "cut", "fresh_lo", "fresh_start", "ring_slot")
    static = dict(q=args[0].clone(), kv=args[1].clone(), sel=args[4].clone(), **{k: kw[k].clone() for k in where})
    fixed = {k: v for k, v in kw.items() if k not in static}

    def run(ops=None):
        fn = ops.ced_sparse_attention if ops is not None else triton_ced_attention.sparse_attention
        return fn(static["q"], static["kv"], args[2], args[3], static["sel"], **{k: static[k] for k in where},
                  **fixed)

    graph, out = capture_graph(run)
    # Move every query back by up to 12 positions: its window then reads more of the ring (which holds the
    # ring_size = n_win + 12 positions before the query), and other slots of it. Each replay also gets new
    # queries and another row's selection, and is checked against the reference on its own inputs.
    seen = []
    for i, shift in enumerate((0, -5, -12)):
        static["q"].copy_(torch.randn(args[0].shape, generator=g).to(args[0]))
        static["pos"].copy_(kw["pos"] + shift)
        static["fresh_lo"].copy_(kw["fresh_lo"] + shift)
        sel = args[4].roll(i + 1, dims=0)
        static["sel"].copy_(valid_first(sel) if i == 2 else sel)  # (the last: short entry loops when dynamic)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, run(REF)) < 1e-2
        seen.append(out.clone())
    assert all(not torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1:]), "replays gave the same"


@gpu
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_indexer_bench_shapes(fmt):
    c = bench_config()
    for row_js, queries in (([4096, 20000, 700], [8, 2, 300]), ([9000] * 16, [1] * 16)):  # prefill; decode
        args, allowed = indexer_case(gen(3), row_js, queries, c.index_heads, c.index_head_dim, fmt, torch.bfloat16,
                                     True, False)
        for allowed in (None, (torch.rand(*args[0].shape[:1], args[4].shape[1], generator=gen(4)) < 0.5).to(DEV)):
            ids, scores = OPS.ced_indexer_topk(*args, c.index_topk, allowed=allowed, return_scores=True)
            ref, ref_scores = REF.ced_indexer_topk(*args, c.index_topk, allowed=allowed, return_scores=True)
            torch.cuda.synchronize()
            vis = torch.arange(scores.shape[1], device=DEV)[None, :] < args[6][:, None]
            assert rel_err(scores[vis], ref_scores[vis]) < 1e-4
            check_same_topk(ids.cpu(), ref.cpu(), ref_scores.cpu(), 1e-4 * float(ref_scores[vis].abs().max()))


@gpu
def test_gpu_indexer_in_cuda_graph():
    c = bench_config()
    args, _ = indexer_case(gen(5), [5000, 300], [4, 4], c.index_heads, c.index_head_dim, "mxfp4", torch.bfloat16,
                           False, False)
    q, w, keys, fmt, slots, q_rows, nvis = args
    static = dict(q=q.clone(), nvis=nvis.clone())

    def run():
        return triton_ced_indexer.indexer_topk(static["q"], w, *keys, fmt, slots, q_rows, static["nvis"], c.index_topk)

    graph, (ids, _) = capture_graph(run)
    # Each replay gets new queries and new visible counts (queries 0-3 read row 0's 5000 entries, 4-7 row 1's
    # 300): the edges (all, none, one short of all) first, then random counts; each replay is checked against the
    # reference on its own inputs, and the replays must select different sets (else they tested one input).
    g = gen(6)
    counts = [[5000, 4999, 1000, 3, 300, 0, 17, 200]]
    counts += [torch.randint(0, 5001, (4,), generator=g).tolist() + torch.randint(0, 301, (4,), generator=g).tolist()
               for _ in range(2)]
    seen = []
    for nv in counts:
        static["q"].copy_(torch.randn(q.shape, generator=g).to(q))
        static["nvis"].copy_(torch.tensor(nv, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_scores = REF.ced_indexer_topk(static["q"], w, keys, fmt, slots, q_rows, static["nvis"], c.index_topk,
                                               return_scores=True)
        vis = torch.arange(slots.shape[1], device=DEV)[None, :] < static["nvis"][:, None]
        check_same_topk(ids.cpu(), ref.cpu(), ref_scores.cpu(), 1e-4 * float(ref_scores[vis].abs().max()))
        seen.append(ids.cpu().clone())
    assert all(not torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1:]), "replays selected the same"


@gpu
def test_gpu_fp4_quantisers_realistic_shapes():
    c = bench_config()
    for fmt, C in (("fp4_e2m1_e4m3", c.head_dim), ("mxfp4", c.index_head_dim)):
        x = fp4_values(gen(7), 8192, C, triton_fp4.GROUPS[fmt])
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            codes, scales = OPS.quantize_kv(xd.to(DEV), fmt)
            ref_codes, ref_scales = lowbit.quantize(xd, fmt)
            assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)
            back = OPS.dequantize_kv(codes, scales, fmt, torch.bfloat16)
            assert torch.equal(bits(back.cpu()), bits(lowbit.dequantize(ref_codes, ref_scales, fmt, torch.bfloat16)))


# ------------------------------------------------------------------------------------------- compiled path
_COMPILE_SCRIPT = r'''
import json, re
from deepinfer.backends.nvidia import triton_ced_attention as tca, triton_ced_indexer as tci, triton_fp4
from deepinfer.testing.kernels import compile_sm90, cuobjdump, sass_row
import torch

assert not tca.INTERPRET
report = {}
SASS = ("attn_bf16", "attnT_bf16", "score_bf16", "topk_")


def kwidth_hazards(ttgir):
    """MMAv2 dots with K below their operand layout's k tile (8 * kWidth). Triton 3.6 gives an operand traced
    back to 8-bit loads a wide kWidth (8 past a tl.join of nibbles) and then computes such dots wrongly
    (triton-lang/triton#11691): half of K counted twice, the rest dropped."""
    bad = []
    for line in ttgir.splitlines():
        m = re.search(r"tt\.dot .*?tensor<(\d+)x(\d+)x(\w+), #ttg\.dot_op<\{opIdx = 0, parent = #\w+, "
                      r"kWidth = (\d+)", line)
        if m and int(m.group(2)) < 8 * int(m.group(4)):
            bad.append(f"K={m.group(2)} {m.group(3)} kWidth={m.group(4)}")
    return bad


def compile_(fn, name, sig, const, div16=(), **opts):
    k = compile_sm90(fn, sig, const, div16, **opts)
    ptx = k.asm.get("ptx", "")
    row = dict(smem=k.metadata.shared, div_full="div.full.f32" in ptx, ftz_mul="mul.ftz" in ptx,
               kwidth_hazards=kwidth_hazards(k.asm.get("ttgir", "")))
    # SASS (cuobjdump, ~0.5 s a kernel) only for the rows whose SASS the test reads
    if "maxnreg" in opts:  # the registers ptxas gave a capped launch (cuobjdump -res-usage: "REG:N")
        m = re.search(r"REG:(\d+)", cuobjdump(k, "-res-usage") or "")
        row.update(maxnreg=opts["maxnreg"], regs=int(m.group(1)) if m else None)
    report[name] = sass_row(k, r"\b(HMMA|HGMMA|STL|LDL|LDG\.E\.128)\b", **row) if name.startswith(SASS) else row


ints = lambda *names: {n: "i32" for n in names}
for dt in ("bf16", "fp32"):
    p = "*" + dt
    for H, D in ((2, 32), (16, 128), (16, 512)):  # the engine test's tiny latent; a wide one; the bench latent
        cfg = tca.launch_config(H, D, torch.bfloat16 if dt == "bf16" else torch.float32)
        for direct in (True, False):
            sig = dict(q_ptr=p, kv_ptr=p, rc_ptr="*u8", rs_ptr="*u8", ec_ptr="*u8", es_ptr="*u8", sel_ptr="*i64",
                       sinks_ptr="*fp32", pos_ptr="*i64", cut_ptr="*i64", flo_ptr="*i64", fst_ptr="*i64",
                       rslot_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", out_ptr=p, mid_m_ptr="*fp32",
                       mid_l_ptr="*fp32", mid_o_ptr="*fp32", qk_scale="fp32",
                       **ints("stride_qt", "stride_qh", "stride_kv", "stride_rs", "stride_rr", "stride_rss",
                              "stride_rsr", "stride_ec", "stride_es", "stride_sel", "stride_ot", "stride_oh",
                              "stride_cs", "H", "D", "K", "RING", "NUM_SPLITS", "WINDOW", "HALF"))
            wide = tca.wide_launch(2048, H, D, torch.bfloat16, 128, 512) if dt == "bf16" and direct else None
            wide_raw = tca.wide_launch(2048, H, D, torch.bfloat16, 128, 512, raw=True) if wide else None
            dyn = dt == "bf16" and D == 512  # the bench decode launches with the entry loop bounded on the device
            for kind, lc in (("", cfg), ("_prefill", dict(cfg, **wide[0]) if wide else None),
                             ("_dyn", dict(cfg, dynamic=1) if dyn else None),
                             ("_raw", dict(cfg, **wide[0], raw=1) if wide and D == 512 else None),
                             ("_raw", dict(cfg, **wide_raw[0], raw=1) if wide and D == 512 else None)):
                if lc is None:
                    continue
                raw = "raw" in lc  # a prefill on entries decoded to bf16 (entry_fmt "bf16")
                fast = dt == "bf16" and not raw and tca.fast_entries(torch.bfloat16, lc)
                # (the transposed raw launch, "attnT_": its ring tiles' loop spills, so the spill rule skips it)
                name = f"attn{'T' if 'trans' in lc else ''}_{dt}_D{D}_{'direct' if direct else 'split'}{kind}"
                compile_(tca._ced_attn_kernel, name,
                         dict(sig, ec_ptr=p if raw else "*u8", es_ptr=p if raw else "*u8"),
                         dict(BLOCK_H=lc["BLOCK_H"], BLOCK_N=lc["BLOCK_N"], BLOCK_D=lc["BLOCK_D"],
                              WIN_TILES=2, SEL_TILES=8, GROUP=16, E8M0=False, HAS_ENTRIES=True, HAS_SINKS=True,
                              DIRECT=direct, DOT_PRECISION="ieee" if dt == "fp32" else "tf32", FAST_FP4=fast,
                              UNROPE=True, BLOCK_R=min(32, D // 4),  # (the engine's: out_proj's RoPE in)
                              PREFETCH=not raw and tca.prefetch_entries(lc), DYN="dynamic" in lc,
                              SEL_POW2=8 * lc["BLOCK_N"], RAW=raw, TRANS="trans" in lc),
                         div16=("stride_qt", "stride_qh", "stride_kv", "stride_rs", "stride_rr", "stride_rss",
                                "stride_ec", "stride_sel", "stride_ot", "stride_oh", "H", "D", "K"),
                         num_warps=lc["num_warps"], **({"num_stages": lc["num_stages"]} if "num_stages" in lc else {}),
                         **({"maxnreg": lc["maxnreg"]} if "maxnreg" in lc else {}))
                report[name]["fast"] = fast
    for nh, dh in ((16, 128), (2, 32)):  # the bench indexer; the engine test's
        for Tq in (1, 2048):  # a query a program (decode), several (prefill)
            icfg = tci.launch_config(nh, dh, Tq, torch.bfloat16 if dt == "bf16" else torch.float32)
            fast = dt == "bf16" and triton_fp4.fast_decode(torch.bfloat16, icfg["BLOCK_J"] * icfg["BLOCK_D"] // 2,
                                                           icfg["num_warps"])
            name = f"score_{dt}_dh{dh}_q{icfg['BLOCK_Q']}"
            compile_(tci._score_kernel, name,
                     dict(q_ptr=p, w_ptr=p, codes_ptr="*u8", scales_ptr="*u8", slots_ptr="*i64", rows_ptr="*i64",
                          nvis_ptr="*i64", out_ptr="*fp32", **ints("stride_qt", "stride_qh", "stride_wt",
                                                                  "stride_wh", "stride_c", "stride_s", "stride_sr",
                                                                  "stride_ot", "Tq", "NH", "DH", "J")),
                     dict(BLOCK_Q=icfg["BLOCK_Q"], BLOCK_H=icfg["BLOCK_H"], BLOCK_D=icfg["BLOCK_D"],
                          BLOCK_J=icfg["BLOCK_J"], GROUP=32, E8M0=True, FAST=fast,
                          DOT_PRECISION="ieee" if dt == "fp32" else "tf32"),
                     div16=("stride_qt", "stride_qh", "stride_c", "stride_sr", "stride_ot", "NH", "DH"),
                     num_warps=icfg["num_warps"])
            report[name]["fast"] = fast
    for fmt, G in triton_fp4.GROUPS.items():
        compile_(triton_fp4._quant_kernel, f"quant_{fmt}_{dt}",
                 dict(x_ptr=p, codes_ptr="*u8", scales_ptr="*u8",
                      **ints("stride_x", "stride_c", "stride_s", "M", "NG")),
                 dict(BLOCK_G=16, GROUP=G, E8M0=fmt == "mxfp4", ROWS=1), num_warps=4)
        fast = dt == "bf16" and triton_fp4.fast_decode(torch.bfloat16, 16 * G // 2, 1)
        compile_(triton_fp4._dequant_kernel, f"dequant_{fmt}_{dt}",
                 dict(codes_ptr="*u8", scales_ptr="*u8", out_ptr=p,
                      **ints("stride_c", "stride_s", "stride_o", "M", "NG")),
                 dict(BLOCK_G=16, GROUP=G, E8M0=fmt == "mxfp4", FAST=fast, ROWS=1), num_warps=1 if fast else 4)
        report[f"dequant_{fmt}_{dt}"]["fast"] = fast
for block, tiles, warps, digit, search in ((4096, 1, 4, 1, 1), (4096, 4, 8, 1, 0), (16384, 1, 8, 1, 1),
                                           (8192, 1, 8, 2, 0), (8192, 1, 4, 1, 1)):
    compile_(tci._topk_kernel, f"topk_{block}_{tiles}_{digit}_{search}",  # (the widest row tile third)
             dict(scores_ptr="*fp32", nvis_ptr="*i64", allowed_ptr="*u8", out_ptr="*i64",
                  **ints("stride_st", "stride_at", "stride_ot", "J", "K")),
             dict(HAS_ALLOWED=True, BLOCK=block, NUM_TILES=tiles, BLOCK_K=512, NUM_KT=1, DIGIT=digit,
                  EARLY=digit == 2 or search == 1, SEARCH=search, LAZY_TIES=search == 1), num_warps=warps)
print(json.dumps(report))
'''


def test_ced_kernels_compile_for_hopper():
    """The compiled code path, which CPU CI never runs: every CED kernel compiles for sm_90; bf16 attention (D = 32,
    128, 512; at 512 also with the dynamic entry loop and a prefill's on raw bf16 entries) and indexer scores (dh =
    32, 128) use the tensor cores without local-memory spills (the transposed raw launch: warp-group MMAs within
    its register cap, RAW_MAXNREG; its ring tiles' loop spills) and no MMA operand has a kWidth Triton 3.6
    miscompiles for its K (see kwidth_hazards); the quantisers use correctly rounded division and keep
    subnormals (no flush-to-zero multiplies)."""
    from pathlib import Path

    report = run_compile_script(_COMPILE_SCRIPT, timeout=600, cwd=Path(__file__).resolve().parents[1])
    # bf16: 11 attention launches (one a prefill's, two a prefill's on raw bf16 entries: as the FP4 rule and
    # transposed, two dynamic), 4 score kernels, 4 (de)quantisers; fp32: 6 + 2 + 4; 5 top-K (the shipped search, the
    # interpolation with lazy ties, on 4K / 16K / 8K rows in one tile at 4 / 8 / 4 warps; the bit search over four
    # tiles and two bits a pass, stopping early)
    assert len(report) == 19 + 12 + 5
    hazards = {name: row["kwidth_hazards"] for name, row in report.items() if row["kwidth_hazards"]}
    assert not hazards, f"MMA operands whose kWidth exceeds K / 8 (miscompiled by Triton 3.6): {hazards}"
    for name in [n for n in report if n.startswith(("attn_bf16", "score_bf16"))]:
        sass = report[name].get("sass")
        if sass is None:
            continue  # no cuobjdump in this triton install
        assert sass.get("HMMA", 0) + sass.get("HGMMA", 0) > 0, (name, sass)
        assert sass.get("STL", 0) == 0 and sass.get("LDL", 0) == 0, f"{name}: local-memory spills: {sass}"
    for name, row in report.items():
        if name.startswith(("quant_", "dequant_")):
            assert not row["ftz_mul"] and not row["div_full"], (name, row)
        if name.startswith("topk_") and name.split("_")[2] == "1" and row.get("sass") is not None:  # one tile
            assert row["sass"].get("STL", 0) == 0, f"{name}: local-memory spills: {row['sass']}"
        if name.startswith("attnT_") and row.get("sass") is not None:  # the second product on warp-group MMAs
            assert row["sass"].get("HGMMA", 0) > 0, (name, row["sass"])
        if row.get("regs") is not None:  # a register cap the launch asks for holds (three 4-warp blocks an SM)
            assert row["regs"] <= row["maxnreg"], (name, row["regs"], row["maxnreg"])
