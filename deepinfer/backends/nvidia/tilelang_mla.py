"""MLA decode attention over the compressed latent cache, in TileLang (the absorbed form of DeepSeek-V2/V3).

The same contract as triton_mla.mla_decode: each cached token is one row of r + rope values, the normed latent
c_kv then the rotated k_pe; the absorbed query q [B, H, r + rope] attends with K = the whole row and V = its
first r values, all H heads sharing the one latent (MQA). Output [B, H, r].

A program owns one (row, block of BLOCK_H heads, context split) and walks its share of the row's keys BLOCK_N
tokens at a time. Each token's cache row comes from the block table; the rows of a tile are gathered into shared
memory by 16-byte cp.async copies, double-buffered (TileLang's software pipeline), so the next tile is in flight
while the tensor cores (wgmma at 64 heads) compute the scores q·row and P @ c_kv on this one: the one tile serves
as K and, through its first r columns, as V. Tokens past the split's end read the split's last visible row
instead (their scores are masked), so no row that no query may see is ever loaded: a NaN there cannot reach
P @ V. Online softmax in float32; P is rounded to the cache dtype for P @ V, as flash attention does.

Splits are chosen as triton_mla chooses them (its cost model: one 64-head program fills an SM here too, with
~226 KB of shared memory at r = 512, rope = 64, BLOCK_N = 64), from shapes only, so a launch can be captured in a
CUDA graph. One split writes the output in the kernel; more write float32 partials that tilelang_common's merge
kernel combines.

Compiled once per (H, r, rope, dtype, block size, slot stride, table and length dtypes, tile config, split or
direct) and cached; B, the slot count, the block table's width and the scale are runtime values. tilelang is imported
on first use. Supports bf16/fp16, r a multiple of 64 (<= 512), rope a multiple of 32 (<= 128), any block size,
caches [slots, r + rope] or [slots, 1, r + rope] whose slot stride is a multiple of 8 values (16-byte rows).
"""

from typing import Optional  # no "from __future__ import annotations": TileLang reads the annotations

import torch

from . import tilelang_common as tlc

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634


def supports(q: torch.Tensor, cache: torch.Tensor, block_table: Optional[torch.Tensor], block_size: int,
             kv_lora_rank: int, seq_lens: Optional[torch.Tensor] = None) -> bool:
    """Whether mla_decode can run these inputs (otherwise the Triton kernel or the reference op): the Triton
    kernel's contract (triton_mla.supports), narrowed to bf16/fp16, r a multiple of 64, rope a multiple of 32,
    16-byte aligned rows and int32/int64 lengths."""
    from . import triton_mla

    if not triton_mla.supports(q, cache, block_table, block_size, kv_lora_rank):
        return False
    rows = triton_mla._rows(cache)
    r, rope = int(kv_lora_rank), q.shape[2] - int(kv_lora_rank)
    if q.dtype not in SUPPORTED_DTYPES or r % 64 or rope % 32 or rows.stride(0) % 8 or rows.data_ptr() % 16:
        return False
    return seq_lens is None or seq_lens.dtype in (torch.int32, torch.int64)


def launch_config(H: int, r: int, rope: int) -> dict:
    """64 heads per program at H >= 64 (two warpgroups, wgmma), else the heads padded to 16 or 32 with one
    warpgroup; BLOCK_N = 64 tokens, two pipeline stages: at r = 512, rope = 64 and 64 heads, Q 72 KB + two key
    tiles 144 KB + P 8 KB of shared memory (one program per SM), ~255 registers with ~100 bytes spilled."""
    BH = 64 if H >= 64 else max(16, tlc.pow2(H))
    return {"BLOCK_H": BH, "BLOCK_N": 64, "num_stages": 2, "threads": 256 if BH == 64 else 128}


def _build(H: int, R: int, P: int, dtype: str, bs: int, stride: int, bt_dtype: str, lens_dtype: str, BH: int,
           BN: int, stages: int, threads: int, direct: bool):
    """The prim_func builder for one config (called with tilelang.language as T)."""

    def build(T):
        acc = "float32"
        D = R + P
        HB = tlc.cdiv(H, BH)
        B, BM, NSL, NB, NS = (T.dynamic(n) for n in ("B", "BM", "NSL", "NB", "NS"))
        reset, softmax_step = tlc.softmax_reset(T), tlc.online_softmax(T, BH, BN, R)
        write_partials = tlc.partials_writer(T, H, BH, R)

        @T.macro
        def attend(Q, KV, BT, LENS, qk, b, hb, sp, NSPL):
            """-> (o [BH, R], m, l [BH]), float32 fragments: this split's unnormalised output, running max (raw
            score units) and denominator."""
            o, m, l, scratch = tlc.softmax_fragments(T, BH, R)
            reset(o, m, l)
            qs = T.alloc_shared((BH, D), dtype)
            ks = T.alloc_shared((BN, D), dtype)
            ps = T.alloc_shared((BH, BN), dtype)
            s = T.alloc_fragment((BH, BN), acc)
            n = T.alloc_var("int32")
            per = T.alloc_var("int32")
            start = T.alloc_var("int32")
            end = T.alloc_var("int32")
            n = T.Cast("int32", LENS[b])
            per = T.ceildiv(T.ceildiv(n, NSPL), BN) * BN  # whole tiles per split, as triton_mla
            start = sp * per
            end = T.min(start + per, n)
            for i, d in T.Parallel(BH, D):
                qs[i, d] = Q[b, T.min(hb * BH + i, H - 1), d]
            for it in T.Pipelined(T.ceildiv(T.max(end - start, 0), BN), num_stages=stages):
                for i, d in T.Parallel(BN, D):  # token past the end: the last visible one (masked below)
                    tok = T.min(start + it * BN + i, end - 1)
                    ks[i, d] = KV[T.Cast("int64", BT[b, tok // bs]) * bs + tok % bs, d]
                for i, j in T.Parallel(BH, BN):
                    s[i, j] = T.Select(start + it * BN + j < end, T.float32(0), -T.infinity(acc))
                T.gemm(qs, ks, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                softmax_step(s, m, l, o, scratch, ps, qk)
                T.gemm(ps, ks[0:BN, 0:R], o, policy=T.GemmWarpPolicy.FullRow)  # V = the c_kv columns
            return o, m, l

        @T.prim_func
        def main(Q: T.Tensor((B, H, D), dtype), KV: T.StridedTensor((NSL, D), (stride, 1), dtype),
                 BT: T.Tensor((B, NB), bt_dtype), LENS: T.Tensor((B,), lens_dtype), QK: T.float32,
                 MID_M: T.Tensor((BM, H, NS), acc), MID_L: T.Tensor((BM, H, NS), acc),
                 MID_O: T.Tensor((BM, H, NS, R), acc), O: T.Tensor((B, H, R), dtype)):
            with T.Kernel(B, HB, 1 if direct else NS, threads=threads) as (b, hb, sp):
                o, m, l = attend(Q, KV, BT, LENS, QK, b, hb, sp, 1 if direct else NS)
                if direct:  # a row with seq_len 0 gives zeros
                    for i, d in T.Parallel(BH, R):
                        if hb * BH + i < H:
                            O[b, hb * BH + i, d] = T.Cast(dtype, o[i, d] / T.Select(l[i] > 0, l[i], T.float32(1)))
                else:  # float32 partials for tilelang_common.merge
                    write_partials(MID_M, MID_L, MID_O, b, hb * BH, sp, o, m, l, QK)

        return main

    return build


def kernel_for(H: int, r: int, rope: int, dtype: torch.dtype, block_size: int, stride: int, bt_dtype: torch.dtype,
               lens_dtype: torch.dtype, direct: bool, block_n: Optional[int] = None,
               device: Optional[torch.device] = None):
    """The compiled kernel of one config (built on first use; ``device`` None builds for DEEPINFER_TILELANG_ARCH,
    as the compile tests do without a GPU)."""
    cfg = launch_config(H, r, rope)
    BN = int(block_n) if block_n is not None else cfg["BLOCK_N"]
    key = (H, r, rope, tlc.DTYPES[dtype], int(block_size), int(stride), str(bt_dtype).split(".")[-1],
           str(lens_dtype).split(".")[-1], cfg["BLOCK_H"], BN, cfg["num_stages"], cfg["threads"], direct)
    return tlc.compile_kernel(_build(*key), key, device)


def _splits(B: int, H: int, r: int, rope: int, dtype: torch.dtype, width: int, block_size: int, BN: int,
            device: torch.device) -> int:
    from .triton_mla import choose_splits  # the same cost model (pure Python, cached)

    BH = launch_config(H, r, rope)["BLOCK_H"]
    elt = torch.empty((), dtype=dtype).element_size()
    return choose_splits(B * tlc.cdiv(H, BH), width * block_size, tlc.sm_count(device), BN, BN * (r + rope) * elt,
                         BH * (r + rope) * elt, BH * r * 4)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, block_size: int,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, *, num_splits: Optional[int] = None,
               block_n: Optional[int] = None) -> torch.Tensor:
    """MLA decode attention over the latent cache, as triton_mla.mla_decode.

    q [B, H, r + rope] (row b is sequence b's one query, at position seq_lens[b] - 1); cache [slots, r + rope] or
    [slots, 1, r + rope] rows of (c_kv, k_pe); block_table [B, NB] int32/int64 block ids; seq_lens [B] context
    lengths; scale: softmax scale; kv_lora_rank: r. Returns [B, H, r] in q's dtype. ``num_splits`` and
    ``block_n`` override the shape-derived launch (benchmarks, tests).
    """
    if not supports(q, cache, block_table, block_size, kv_lora_rank, seq_lens):
        raise ValueError(f"mla_decode: unsupported inputs: q {q.dtype} {tuple(q.shape)}, cache {cache.dtype} "
                         f"{tuple(cache.shape)} strides {tuple(cache.stride())}, kv_lora_rank {kv_lora_rank}, "
                         f"block_table {getattr(block_table, 'dtype', None)} (see tilelang_mla.supports)")
    B, H, D = q.shape
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be [B={B}], got shape {tuple(seq_lens.shape)}")
    r = int(kv_lora_rank)
    out = torch.empty((B, H, r), dtype=q.dtype, device=q.device)
    if B == 0 or H == 0:
        return out
    from .triton_mla import _rows

    rows = _rows(cache)
    q = q if q.is_contiguous() else q.contiguous()
    block_table = block_table if block_table.is_contiguous() else block_table.contiguous()
    seq_lens = seq_lens if seq_lens.is_contiguous() else seq_lens.contiguous()
    BN = int(block_n) if block_n is not None else launch_config(H, r, D - r)["BLOCK_N"]
    S = num_splits if num_splits is not None else _splits(B, H, r, D - r, q.dtype, block_table.shape[1],
                                                          int(block_size), BN, q.device)
    S = max(1, int(S))
    kernel = kernel_for(H, r, D - r, q.dtype, block_size, rows.stride(0), block_table.dtype, seq_lens.dtype, S == 1,
                        BN, q.device)
    qk = float(scale) * LOG2E  # raw scores -> log2 units
    if S == 1:  # the kernel finishes the softmax itself; the partials are never touched
        mid = (tlc.dummy(q.device, (1, H, 1), torch.float32), tlc.dummy(q.device, (1, H, 1), torch.float32),
               tlc.dummy(q.device, (1, H, 1, r), torch.float32))
        tlc.launch(kernel, q, rows, block_table, seq_lens, qk, *mid, out)
        return out
    mid = (torch.empty((B, H, S), dtype=torch.float32, device=q.device),
           torch.empty((B, H, S), dtype=torch.float32, device=q.device),
           torch.empty((B, H, S, r), dtype=torch.float32, device=q.device))
    tlc.launch(kernel, q, rows, block_table, seq_lens, qk, *mid, out)
    return tlc.merge(*mid, None, out)
