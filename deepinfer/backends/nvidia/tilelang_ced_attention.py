"""CED sparse attention in TileLang: sliding window + top-K FP4 entries + sink, one softmax, one pass.

The same contract as triton_ced_attention.sparse_attention (and Ops.ced_sparse_attention): each query attends
one shared latent (MQA, K = V, head dim D) over its window keys (positions max(pos - W + 1, cut, 0) .. pos;
fresh rows of ``kv`` from fresh_lo on, older ones from the sequence's FP8 ring, ``fp8_e4m3_pow2``), its selected
global entries (rows ``entry_slots[t]`` of the paged FP4 cache, ``fp4_e2m1_e4m3`` or ``mxfp4``; -1 = none) and
a per-head sink logit that joins only the denominator.

A program owns one (query, head tile, split). Its keys are a list of tiles of BLOCK_N: first the window's
ceil(W / BLOCK_N) tiles, then the selection's ceil(K / BLOCK_N); a split walks a contiguous share of that list.
For each tile the 128 threads dequantise the keys into shared memory in q's dtype (E4M3 codes by the hardware
conversion, exact; E2M1 nibbles and E8M0 scales built from their bits; the products are exact and rounded
once). Every index is clamped into its tensor, so a masked key reads some in-bounds row, and becomes a zero row
(a NaN-poisoned cache row cannot leak into P @ V). The heads are the M side of both products
(padded to 16 rows: mma.sync tiles), the score tile starts at 0 or -inf by key validity and the online softmax
runs in float32 (a tile with no visible key leaves the state untouched). One split finishes with the sink in
the kernel; more write float32 partials that tilelang_common's merge kernel combines with the sink. Split counts
follow from shapes only, never values, so a launch can be captured in a CUDA graph.

Compiled once per (H, D, dtype, entry format, sinks, entries, split/direct, tile config) and cached; T, K,
N, the ring shape, W, the scale and the split count are runtime values. tilelang is imported on first use.

Precision: bf16/fp16 operands with float32 accumulation, probabilities rounded to q's dtype for P @ V (as the
Triton kernel); expect a relative error of a few 1e-3 against the float32 reference op.
"""

import math  # no "from __future__ import annotations": TileLang evaluates the prim_func's annotations
from typing import Optional

import torch

from . import tilelang_common as tlc

RING_FMT = "fp8_e4m3_pow2"
RING_GROUP = 32
GROUPS = {"fp4_e2m1_e4m3": 16, "mxfp4": 32}
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634
MAX_SPLITS = 16
_TL_DTYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def supports(q: torch.Tensor, kv: torch.Tensor, ring: tuple, entries: Optional[tuple], entry_slots: torch.Tensor,
             ring_fmt: str, entry_fmt: str, sinks: Optional[torch.Tensor] = None) -> bool:
    """Whether sparse_attention can run these inputs (otherwise the Triton kernel or the reference op): the Triton
    kernel's contract (triton_ced_attention.supports: formats, shapes, dtypes), narrowed to 16-bit q and kv, a
    latent width that is a multiple of 64 and contiguous tensors; FP4 entries only (not raw bf16 ones)."""
    from . import triton_ced_attention

    if entry_fmt == triton_ced_attention.RAW_FMT \
            or not triton_ced_attention.supports(q, kv, ring, entries, entry_slots, ring_fmt, entry_fmt, sinks):
        return False
    if q.dtype not in SUPPORTED_DTYPES or q.shape[2] % 64 or (sinks is not None and not sinks.is_floating_point()):
        return False
    return all(t.is_contiguous() for t in (q, kv, *ring, *(entries or ())))


def launch_config(H: int, D: int) -> dict:
    """Heads on the M side (16 rows at least, 64 at most per program), BLOCK_N keys per tile, 128 threads. At the
    bench latent (16 heads x 512): Q 16 KB + one key tile 32 KB of shared memory, so several programs share an
    SM and hide each other's load latency (the dequantisation is not an async copy)."""
    return {"BLOCK_H": max(16, min(64, tlc.pow2(H))), "BLOCK_N": 32 if D >= 256 else 64, "threads": 128}


def choose_splits(rows: int, head_tiles: int, tiles: int, device: torch.device) -> int:
    """Key splits so the grid fills the GPU (about 4 programs per SM), each split at least one tile; shapes only."""
    want = tlc.cdiv(4 * tlc.sm_count(device), max(1, rows * head_tiles))
    return int(max(1, min(want, tiles, MAX_SPLITS)))


def _build(H: int, D: int, dtype: str, group: int, e8m0: bool, has_entries: bool, has_sinks: bool,
           sink_dtype: str, direct: bool, BH: int, BN: int, threads: int):
    """The prim_func builder for one config (called with tilelang.language as T)."""

    def build(T):
        acc = "float32"
        NEG = -T.infinity(acc)
        NT, NTS, NTM, SR, RING, NE, K, NS = (T.dynamic(n) for n in ("NT", "NTS", "NTM", "SR", "RING", "NE", "K", "NS"))
        NG = D // group
        HT = tlc.cdiv(H, BH)
        e4m3 = "float8_e4m3fn"
        es_dtype = "uint8" if e8m0 else e4m3
        reset, softmax_step = tlc.softmax_reset(T), tlc.online_softmax(T, BH, BN, D)
        write_partials = tlc.partials_writer(T, H, BH, D)

        def e8m0_value(sb):
            """uint8 E8M0 byte -> float32 2^(sb - 127) (byte 0 the subnormal 2^-127, 255 NaN), from its bits."""
            u = T.Cast("uint32", sb)
            bits = T.Select(u == 0, T.uint32(0x00400000), T.shift_left(u, T.uint32(23)))
            return T.Select(u == 255, T.float32(math.nan), T.reinterpret(bits, acc))

        @T.macro
        def attend(Q, KV, RC, RS, EC, ES, SEL, POS, CUT, FLO, FST, RSLOT, WINDOW, qk, t, ht, sp, NSPL):
            """-> (o [BH, D], m, l [BH]), float32 fragments: this split's unnormalised output, running max (raw
            score units) and denominator."""
            o, m, l, scratch = tlc.softmax_fragments(T, BH, D)
            reset(o, m, l)
            qs = T.alloc_shared((BH, D), dtype)
            ks = T.alloc_shared((BN, D), dtype)
            ps = T.alloc_shared((BH, BN), dtype)
            vbias = T.alloc_shared((BN,), acc)  # per key of the tile: 0 if visible, else -inf
            src = T.alloc_shared((BN,), "int64")  # per key: its row of KV (window) or of the entry cache
            slot = T.alloc_shared((BN,), "int64")  # window: its slot of the ring
            fresh = T.alloc_shared((BN,), "int32")  # window: 1 if it is a row of KV, 0 if in the ring
            scl = T.alloc_shared((BN, D // min(group, RING_GROUP)), acc)  # the tile's dequantisation scales
            s = T.alloc_fragment((BH, BN), acc)
            pos = T.alloc_var("int32")
            lo = T.alloc_var("int32")
            flo = T.alloc_var("int32")
            fst = T.alloc_var("int32")
            rrow = T.alloc_var("int64")
            first = T.alloc_var("int32")
            last = T.alloc_var("int32")
            pos = T.Cast("int32", POS[t])
            lo = T.max(T.max(pos - WINDOW + 1, T.Cast("int32", CUT[t])), 0)  # first window position
            flo = T.Cast("int32", FLO[t])
            fst = T.Cast("int32", FST[t])
            rrow = RSLOT[t]
            W_TILES = T.ceildiv(WINDOW, BN)
            e_tiles = T.ceildiv(K, BN) if has_entries else 0
            per = T.ceildiv(W_TILES + e_tiles, NSPL)
            first = sp * per
            last = T.min(first + per, W_TILES + e_tiles)
            for i, d in T.Parallel(BH, D):
                qs[i, d] = Q[t, T.min(ht * BH + i, H - 1), d]
            for tile in T.serial(T.max(last - first, 0)):
                tid = first + tile
                if tid < W_TILES:  # window keys: positions lo + tid * BN + i, those <= pos
                    # Indices are clamped here, never inside a Select's branch: TileLang drops a clamp that the
                    # branch's condition implies, and the vectorised load then runs for every key.
                    for i in T.Parallel(BN):
                        p = lo + tid * BN + i
                        vbias[i] = T.Select(p <= pos, T.float32(0), NEG)
                        fresh[i] = T.Cast("int32", p >= flo)
                        src[i] = T.Cast("int64", T.max(T.min(fst + p - flo, NT - 1), 0))  # row of KV
                        slot[i] = T.Cast("int64", T.max(p, 0) % RING)  # slot of the ring
                    for i, g in T.Parallel(BN, D // RING_GROUP):  # the ring's power-of-two scales
                        scl[i, g] = e8m0_value(RS[rrow, slot[i], g])
                    for i, d in T.Parallel(BN, D):
                        ring = T.Cast(dtype, T.Cast(acc, RC[rrow, slot[i], d]) * scl[i, d // RING_GROUP])
                        val = T.Select(fresh[i] != 0, KV[src[i], d], ring)
                        ks[i, d] = T.Select(vbias[i] == 0, val, T.Cast(dtype, 0))
                else:  # selected entries e = (tid - W_TILES) * BN + i: cache rows SEL[t, e] >= 0
                    if has_entries:
                        for i in T.Parallel(BN):
                            e = (tid - W_TILES) * BN + i
                            row = SEL[t, T.min(e, K - 1)]
                            ok = (e < K) & (row >= 0)
                            vbias[i] = T.Select(ok, T.float32(0), NEG)
                            src[i] = T.Select(ok, row, T.int64(0))
                        for i, g in T.Parallel(BN, NG):  # the entries' scales: E8M0 bits or E4M3 codes
                            scl[i, g] = e8m0_value(ES[src[i], g]) if e8m0 else T.Cast(acc, ES[src[i], g])
                        for i, d in T.Parallel(BN, D):  # E2M1 (packed: channel 2j the low nibble of byte j)
                            val = T.Cast(dtype, T.Cast(acc, EC[src[i], d]) * scl[i, d // group])
                            ks[i, d] = T.Select(vbias[i] == 0, val, T.Cast(dtype, 0))
                for i, j in T.Parallel(BH, BN):
                    s[i, j] = vbias[j]
                T.gemm(qs, ks, s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                softmax_step(s, m, l, o, scratch, ps, qk)
                T.gemm(ps, ks, o, policy=T.GemmWarpPolicy.FullCol)
            return o, m, l

        @T.prim_func
        def main(Q: T.Tensor((NT, H, D), dtype), KV: T.Tensor((NT, D), dtype),
                 RC: T.Tensor((SR, RING, D), e4m3), RS: T.Tensor((SR, RING, D // RING_GROUP), "uint8"),
                 EC: T.Tensor((NE, D), "float4_e2m1fn"), ES: T.Tensor((NE, NG), es_dtype),
                 SEL: T.Tensor((NTS, K), "int64"), SINKS: T.Tensor((H,), sink_dtype),
                 POS: T.Tensor((NT,), "int64"), CUT: T.Tensor((NT,), "int64"), FLO: T.Tensor((NT,), "int64"),
                 FST: T.Tensor((NT,), "int64"), RSLOT: T.Tensor((NT,), "int64"), WINDOW: T.int32, QK: T.float32,
                 MID_M: T.Tensor((NTM, H, NS), acc), MID_L: T.Tensor((NTM, H, NS), acc),
                 MID_O: T.Tensor((NTM, H, NS, D), acc), O: T.Tensor((NT, H, D), dtype)):
            with T.Kernel(NT, HT, 1 if direct else NS, threads=threads) as (t, ht, sp):
                o, m, l = attend(Q, KV, RC, RS, EC, ES, SEL, POS, CUT, FLO, FST, RSLOT, WINDOW, QK, t, ht, sp,
                                 1 if direct else NS)
                if direct:  # the sink joins the denominator: out = o 2^(m - mf) / (l 2^(m - mf) + 2^(z - mf))
                    for i, d in T.Parallel(BH, D):
                        if ht * BH + i < H:
                            if has_sinks:
                                z = T.Cast(acc, SINKS[ht * BH + i]) * T.float32(LOG2E)
                                mf = T.max(m[i] * QK, z)
                                c = T.exp2(m[i] * QK - mf)
                                O[t, ht * BH + i, d] = T.Cast(dtype, o[i, d] * c / (l[i] * c + T.exp2(z - mf)))
                            else:
                                O[t, ht * BH + i, d] = T.Cast(dtype, o[i, d] / T.Select(l[i] > 0, l[i],
                                                                                       T.float32(1)))
                else:  # float32 partials for tilelang_common.merge
                    write_partials(MID_M, MID_L, MID_O, t, ht * BH, sp, o, m, l, QK)

        return main

    return build


def kernel_for(H: int, D: int, dtype: torch.dtype, entry_fmt: str, has_entries: bool,
               sink_dtype: Optional[torch.dtype], direct: bool, block_n: Optional[int] = None,
               device: Optional[torch.device] = None):
    """The compiled kernel of one config (built on first use; ``device`` None builds for DEEPINFER_TILELANG_ARCH,
    as the compile tests do without a GPU). sink_dtype None: no sinks."""
    cfg = launch_config(H, D)
    BN = int(block_n) if block_n is not None else cfg["BLOCK_N"]
    key = (H, D, tlc.DTYPES[dtype], GROUPS.get(entry_fmt, 16), entry_fmt == "mxfp4", has_entries,
           sink_dtype is not None, tlc.DTYPES[sink_dtype or torch.float32], direct, cfg["BLOCK_H"], BN,
           cfg["threads"])
    return tlc.compile_kernel(_build(*key), key, device)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, ring: tuple, entries: Optional[tuple],
                     entry_slots: torch.Tensor, *, pos: torch.Tensor, cut: torch.Tensor, fresh_lo: torch.Tensor,
                     fresh_start: torch.Tensor, ring_slot: torch.Tensor, window: int, entry_fmt: str,
                     sinks: Optional[torch.Tensor], scale: float, ring_fmt: str = RING_FMT,
                     num_splits: Optional[int] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """One softmax per query over its window keys, its selected FP4 entries and the sink (see the module doc).

    Arguments and result as triton_ced_attention.sparse_attention: q [T, H, D]; kv [T, D] this pass's fresh
    latents; ring = (codes [S, RING, D], scales [S, RING, D // 32]) uint8; entries = (codes [N, D // 2], scales
    [N, D // G]) uint8 or None; entry_slots [T, K] int64 (-1 = none); pos, cut, fresh_lo, fresh_start, ring_slot
    [T] int64; window W; sinks [H] or None. Returns [T, H, D] in q's dtype. ``num_splits`` and ``block_n``
    override the shape-derived launch (tests, benchmarks).
    """
    if not supports(q, kv, ring, entries, entry_slots, ring_fmt, entry_fmt, sinks):
        raise ValueError(f"sparse_attention: unsupported inputs: q {q.dtype} {tuple(q.shape)}, kv {kv.dtype} "
                         f"{tuple(kv.shape)}, ring_fmt {ring_fmt!r}, entry_fmt {entry_fmt!r}, entry_slots "
                         f"{entry_slots.dtype} {tuple(entry_slots.shape)} (see tilelang_ced_attention.supports)")
    T, H, D = q.shape
    where = dict(pos=pos, cut=cut, fresh_lo=fresh_lo, fresh_start=fresh_start, ring_slot=ring_slot)
    bad = [f"{k} {v.dtype} {tuple(v.shape)}" for k, v in where.items() if v.shape != (T,) or v.dtype != torch.int64]
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        bad.append(f"window {window!r}")
    if bad:
        raise ValueError(f"pos, cut, fresh_lo, fresh_start, ring_slot must be int64 tensors [T={T}] and window a "
                         f"positive int; got {', '.join(bad)}")
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    rc, rs = ring
    K = entry_slots.shape[1]
    has_entries = entries is not None and K > 0 and entries[0].shape[0] > 0
    if has_entries:
        ec, es = entries
        sel = entry_slots if entry_slots.is_contiguous() else entry_slots.contiguous()
    else:  # never read by this variant
        G = GROUPS.get(entry_fmt, 16)
        ec = tlc.dummy(q.device, (1, D // 2), torch.uint8)
        es = tlc.dummy(q.device, (1, D // G), torch.uint8)
        sel = tlc.dummy(q.device, (1, 1), torch.int64)
    if entry_fmt != "mxfp4":
        es = es.view(torch.float8_e4m3fn)
    cfg = launch_config(H, D)
    BN = int(block_n) if block_n is not None else cfg["BLOCK_N"]
    head_tiles = tlc.cdiv(H, cfg["BLOCK_H"])
    w_tiles = tlc.cdiv(window, BN)
    tiles = w_tiles + (tlc.cdiv(K, BN) if has_entries else 0)
    S = num_splits if num_splits is not None else choose_splits(T, head_tiles, tiles, q.device)
    S = max(1, min(int(S), tiles))
    sinks_arg = sinks.contiguous() if sinks is not None else tlc.dummy(q.device, (H,), torch.float32)
    kernel = kernel_for(H, D, q.dtype, entry_fmt, has_entries, None if sinks is None else sinks.dtype, S == 1, BN,
                        q.device)
    # E4M3 codes go in as float8_e4m3fn views (the kernel converts them with the hardware); FP4 codes as their
    # bytes, the packed float4_e2m1fn argument's storage.
    args = (q, kv, rc.view(torch.float8_e4m3fn), rs, ec, es, sel, sinks_arg, pos.contiguous(),
            cut.contiguous(), fresh_lo.contiguous(), fresh_start.contiguous(), ring_slot.contiguous(), window,
            float(scale) * LOG2E)
    if S == 1:  # the kernel finishes the softmax itself; the partials are never touched
        mid = (tlc.dummy(q.device, (1, H, 1), torch.float32), tlc.dummy(q.device, (1, H, 1), torch.float32),
               tlc.dummy(q.device, (1, H, 1, D), torch.float32))
        tlc.launch(kernel, *args, *mid, out)
        return out
    mid = (torch.empty((T, H, S), dtype=torch.float32, device=q.device),
           torch.empty((T, H, S), dtype=torch.float32, device=q.device),
           torch.empty((T, H, S, D), dtype=torch.float32, device=q.device))
    tlc.launch(kernel, *args, *mid, out)
    return tlc.merge(*mid, sinks, out)
