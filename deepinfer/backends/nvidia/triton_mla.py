"""MLA decode attention over the compressed latent cache, in Triton (the absorbed form of DeepSeek-V2/V3).

Each cached token is one row of r + rope values: the normed latent c_kv (r = kv_lora_rank) then the rotated
k_pe (rope = qk_rope_head_dim). The absorbed query q [B, H, r + rope] attends with K = the whole row and
V = its first r values, all H heads sharing the one latent "KV head" (MQA). Output [B, H, r] (the caller
multiplies by W_UV).

Each program owns one (row, block of BLOCK_H query heads, context split). It walks its share of the row's
keys BLOCK_N tokens at a time, finding each token's cache slot through the block table, and loads each
tile once as two pieces, kn = c_kv [BLOCK_N, r] and kp = k_pe [BLOCK_N, rope] (power-of-two tiles, masked
when r or rope is not one). The scores are q_nope·kn + q_pe·kp (one float32 accumulator), and the same kn
tile is the V operand of P @ V, so the latent is read once per head block rather than once for K and again
for V. The head block is the M side of both matrix products (16 to 64 heads: H = 128 needs two blocks),
so the tensor cores see real tiles and every KV byte serves up to 64 heads. Online softmax in float32:
running max ``m``, denominator ``l`` and unnormalised output ``acc``.

When rows x head blocks would not fill the GPU, the context is split (flash-decoding): each split writes
(m, l, acc) partials and a second kernel merges them, tiled over the r output values. The split count is
a function of shapes only (B, H, the block table's width), never of values, so a launch can be captured
in a CUDA graph; nothing in the launch syncs with the host.

Supports any r and rope (r <= 512, rope <= 128), any block size, block tables of int32 or int64, caches
[slots, r + rope] or [slots, 1, r + rope] with any slot stride (e.g. one layer of [layers, slots, 1, D]),
bf16/fp16/fp32. Keys visible to row b are positions 0 .. seq_lens[b] - 1 (a decode query sits at the
last position); a row with seq_lens 0 gives zeros. No sliding window, no sinks (MLA models have neither).

Precision: both products use float32 accumulation (bf16/fp16 products are exact on the tensor cores;
float32 inputs use the "ieee" dot, not tf32); P is rounded to the cache dtype for P @ V, as flash attention
does; the softmax and the split merge are float32. Expect ~1e-7 relative error in float32 and a few 1e-3
in bf16 against a float64 oracle.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .triton_attention import LOG2E, sm_count
from .triton_norm import cast_rne, to_f32

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_RANK = 512  # kv_lora_rank: acc [BLOCK_H, r] lives in registers
MAX_ROPE = 128
MAX_SPLITS = 64


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b with float32 accumulation. The interpreter multiplies bf16 as raw bits: upcast there."""
    if _INTERP:
        return tl.dot(to_f32(a), to_f32(b), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _latent_tile(qn, qp, m_i, l_i, acc, t0, end, cache_ptr, bt_row, stride_s, qk_scale, R,
                 r_off, r_mask, p_off, p_mask,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over tokens t0 .. t0 + BLOCK_N - 1 (those < end)."""
    toks = t0 + tl.arange(0, BLOCK_N)
    t_mask = toks < end
    block_id = tl.load(bt_row + toks // BLOCK_SIZE, mask=t_mask, other=0)
    row = cache_ptr + (block_id.to(tl.int64) * BLOCK_SIZE + toks % BLOCK_SIZE) * stride_s  # [BLOCK_N]
    kn = tl.load(row[:, None] + r_off[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0)  # [N, BR]
    kp = tl.load(row[:, None] + R + p_off[None, :], mask=t_mask[:, None] & p_mask[None, :], other=0.0)  # [N, BP]
    s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    s = _mma(qn, tl.trans(kn), s, PRECISION)
    s = _mma(qp, tl.trans(kp), s, PRECISION)
    s = tl.where(t_mask[None, :], s * qk_scale, float("-inf"))  # log2 units
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: a visited tile has at least one visible key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _mma(cast_rne(p, kn.dtype), kn, acc * alpha[:, None], PRECISION)  # V = the c_kv tile already loaded
    return m_new, l_i, acc


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, bt_ptr, lens_ptr,
    out_ptr, mid_m_ptr, mid_l_ptr, mid_o_ptr,
    stride_qb, stride_qh, stride_s, stride_bt, stride_ob, stride_oh,
    qk_scale, H, R, P, NUM_SPLITS,
    DIRECT: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr,
    INTERP_LOOP: tl.constexpr, MAX_TILES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets throughout
    hb = tl.program_id(1)
    split = tl.program_id(2)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    r_off = tl.arange(0, BLOCK_R)
    r_mask = r_off < R
    p_off = tl.arange(0, BLOCK_P)
    p_mask = p_off < P

    # This split's share of positions [0, seq_len), in whole BLOCK_N tiles.
    n = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, n)

    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    qn = tl.load(q_row + r_off[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    qp = tl.load(q_row + R + p_off[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_P]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt

    if INTERP_LOOP:
        # Triton's interpreter cannot take tensor loop bounds under numpy >= 2.4 (triton-lang/triton#9171):
        # walk a host-side upper bound of tiles and skip those past this split's end.
        for it in range(0, MAX_TILES):
            t0 = start + it * BLOCK_N
            if t0 < end:
                m_i, l_i, acc = _latent_tile(qn, qp, m_i, l_i, acc, t0, end, cache_ptr, bt_row, stride_s, qk_scale,
                                             R, r_off, r_mask, p_off, p_mask, BLOCK_SIZE, BLOCK_N, BLOCK_H,
                                             PRECISION)
    else:
        for t0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _latent_tile(qn, qp, m_i, l_i, acc, t0, end, cache_ptr, bt_row, stride_s, qk_scale,
                                         R, r_off, r_mask, p_off, p_mask, BLOCK_SIZE, BLOCK_N, BLOCK_H, PRECISION)

    if DIRECT:  # one split: finish here
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty row (seq_len 0) gives zeros
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + r_off[None, :],
                 cast_rne(o, out_ptr.dtype.element_ty), mask=h_mask[:, None] & r_mask[None, :])
    else:
        # Partials: m, l [B, H, NUM_SPLITS]; acc [B, H, NUM_SPLITS, R].
        ml = (b * H + heads) * NUM_SPLITS + split
        tl.store(mid_m_ptr + ml, m_i, mask=h_mask)
        tl.store(mid_l_ptr + ml, l_i, mask=h_mask)
        tl.store(mid_o_ptr + ml[:, None] * R + r_off[None, :], acc, mask=h_mask[:, None] & r_mask[None, :])


@triton.jit
def _mla_merge_kernel(
    mid_m_ptr, mid_l_ptr, mid_o_ptr, out_ptr,
    stride_ob, stride_oh, H, R, NUM_SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program per (row, head, BLOCK_C output values): out = sum_s w_s acc_s / sum_s w_s l_s with
    w_s = exp2(m_s - max m). Empty splits have m = -inf and l = acc = 0."""
    bh = tl.program_id(0).to(tl.int64)
    c_off = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c_off < R
    s_off = tl.arange(0, BLOCK_S)
    s_mask = s_off < NUM_SPLITS
    base = bh * NUM_SPLITS
    m = tl.load(mid_m_ptr + base + s_off, mask=s_mask, other=float("-inf"))
    l = tl.load(mid_l_ptr + base + s_off, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)  # an all-empty row: no NaN
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_ref))  # [BLOCK_S]
    denom = tl.sum(l * w, axis=0)
    o = tl.load(mid_o_ptr + (base + s_off)[:, None] * R + c_off[None, :], mask=s_mask[:, None] & c_mask[None, :],
                other=0.0)  # [BLOCK_S, BLOCK_C]
    num = tl.sum(o * w[:, None], axis=0)
    denom = tl.where(denom > 0, denom, 1.0)
    b = bh // H
    h = bh % H
    tl.store(out_ptr + b * stride_ob + h * stride_oh + c_off, cast_rne(num / denom, out_ptr.dtype.element_ty),
             mask=c_mask)


# ----------------------------------------------------------------------------------------------- host side
def _rows(cache: torch.Tensor) -> Optional[torch.Tensor]:
    """The cache as [slots, r + rope] (a view), or None when it has another shape."""
    if cache.dim() == 3 and cache.shape[1] == 1:
        return cache[:, 0]
    if cache.dim() == 2:
        return cache
    return None


def value_prefix_rank(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """r when v_cache is MLA's value view, the first r channels of the one-head k_cache (same storage, same
    slot stride, r < k_cache.shape[-1]); 0 otherwise. How NvidiaOps tells an MLA decode call apart."""
    if k_cache.dim() != 3 or v_cache.dim() != 3 or k_cache.shape[1] != 1 or v_cache.shape[:2] != k_cache.shape[:2]:
        return 0
    if v_cache.data_ptr() != k_cache.data_ptr() or v_cache.stride(0) != k_cache.stride(0):
        return 0
    r = v_cache.shape[2]
    return r if 0 < r < k_cache.shape[2] and v_cache.stride(2) == 1 else 0


def supports(q: torch.Tensor, cache: torch.Tensor, block_table: Optional[torch.Tensor], block_size: int,
             kv_lora_rank: int) -> bool:
    """Whether mla_decode can run these inputs (otherwise use the reference op)."""
    rows = _rows(cache)
    if rows is None or block_table is None or block_size <= 0 or q.dim() != 3:
        return False
    if q.dtype not in SUPPORTED_DTYPES or cache.dtype != q.dtype:
        return False
    r, D = int(kv_lora_rank), q.shape[2]
    if not (0 < r < D) or rows.shape[1] != D or r > MAX_RANK or D - r > MAX_ROPE or rows.stride(1) != 1:
        return False
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or block_table.dtype not in (torch.int32,
                                                                                                   torch.int64):
        return False
    return True


def mla_call_rank(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table, block_size: int,
                  window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> int:
    """r when a paged_attention(q, k_cache, v_cache, ...) call is MLA's absorbed form that mla_decode serves
    (V the first r channels of the one-head K cache, no window, no sinks, supported shapes); else 0. The
    caller still checks that the step is decode (one query per row, at position seq_len - 1) and devices."""
    r = value_prefix_rank(k_cache, v_cache)
    if not r or window is not None or sinks is not None:
        return 0
    return r if supports(q, k_cache, block_table, block_size, r) else 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # host integers: triton.cdiv is a constexpr function, ~3 us a call from Python


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def launch_config(H: int, r: int, rope: int, dtype: torch.dtype) -> dict:
    """Tile sizes from shapes (deterministic; no autotuning, so a launch is capture-safe).

    bf16/fp16 on sm_90: up to 64 heads per program (H = 128 -> two head blocks; 64 rows make Triton use
    wgmma), BLOCK_N = 32 tokens, 8 warps, two pipeline stages. At r = 512, rope = 64 that is ~147 KB of
    shared memory (Q 64 x 576 and two K tiles 32 x 576) and ~255 registers with no spills; 16 or 32 heads
    use the mma.sync path at ~145 / 187 registers. 4 warps at 64 heads would hold acc [64, 512] float32 in
    one warpgroup and spill; 16 warps cap registers at 128 and spill. One program of 128 heads is out of
    reach: acc [128, 512] float32 alone is the whole register file. float32 (tests, small models): 16
    heads x 16 tokens. Numbers from ptxas for sm_90 (tests/test_triton_mla.py compiles these configs).
    """
    BLOCK_R = _pow2(max(r, 16))
    BLOCK_P = _pow2(max(rope, 16))
    if INTERPRET:
        return dict(BLOCK_H=16, BLOCK_N=16, BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P, num_warps=4, num_stages=1)
    num_warps = 8 if BLOCK_R >= 256 else 4
    if dtype == torch.float32:
        return dict(BLOCK_H=16, BLOCK_N=16, BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P, num_warps=num_warps, num_stages=2)
    BLOCK_H = max(16, min(64, _pow2(H)))
    return dict(BLOCK_H=BLOCK_H, BLOCK_N=32, BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P, num_warps=num_warps, num_stages=2)


MIN_SPLIT_TILES = 2  # a split of one tile leaves the two-stage pipeline nothing to overlap


@functools.lru_cache(maxsize=4096)
def choose_splits(programs: int, max_ctx: int, sms: int, block_n: int, tile_bytes: int, query_bytes: int,
                  part_bytes: int) -> int:
    """Context splits from shapes only (programs = rows x head blocks, the block table's width), never values.

    A program at 64 heads fills an SM (shared memory and registers: one program per SM), so the grid runs
    in waves of ``sms`` programs and a second wave is serial time, not hidden latency. Modelled time in
    bytes moved per SM: waves x (the split's KV tiles + the query it loads, ``query_bytes`` + its float32
    partials, ``part_bytes``) + the merge's read of all partials spread over the SMs. At B = 1 and 4K
    context (DeepSeek-V3, 132 SMs) that is ~43-64 splits (86-128 programs); splitting stops where a wave is
    full (B = 32: 2, B >= 64: 1). Every split gets at least MIN_SPLIT_TILES tiles, and only counts whose
    tile rounding leaves no split empty are considered (43, not 50: 50 splits of 3 tiles cover 128 tiles
    with 43). Cached: a pure function of its integer arguments.
    """
    programs = max(1, programs)
    tiles = max(1, _cdiv(max_ctx, block_n))
    most = max(1, min(MAX_SPLITS, tiles // MIN_SPLIT_TILES))
    best, best_cost = 1, None
    for s in range(1, most + 1):
        per = _cdiv(tiles, s)  # tiles per split (the kernel rounds a row's share up to whole tiles)
        if _cdiv(tiles, per) != s:
            continue  # some split would be empty: a smaller count does the same work with fewer partials
        cost = _cdiv(programs * s, sms) * (per * tile_bytes + query_bytes + (part_bytes if s > 1 else 0))
        if s > 1:
            cost += programs * s * part_bytes / sms  # the merge
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


class _Launch(NamedTuple):
    cfg: dict
    head_blocks: int
    splits: int
    max_tiles: int  # interpreter loop bound
    block_s: int  # merge: splits, padded to a power of two
    block_c: int  # merge: output values per program


@functools.lru_cache(maxsize=4096)
def _plan(B: int, H: int, r: int, rope: int, dtype: torch.dtype, width: int, block_size: int, sms: int,
          block_h: Optional[int], block_n: Optional[int], num_splits: Optional[int]) -> _Launch:
    """Everything about a launch that follows from shapes, computed once per shape (host time matters at
    small batches, where the GPU work is a few microseconds)."""
    cfg = launch_config(H, r, rope, dtype)
    for name, val, key in (("block_h", block_h, "BLOCK_H"), ("block_n", block_n, "BLOCK_N")):
        if val is not None:
            if int(val) < 16 or int(val) & (int(val) - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (a tensor-core tile side), got {val}")
            cfg[key] = int(val)
    BLOCK_H, BLOCK_N = cfg["BLOCK_H"], cfg["BLOCK_N"]
    head_blocks = _cdiv(H, BLOCK_H)
    max_ctx = width * block_size
    elt = torch.empty((), dtype=dtype).element_size()
    if num_splits is None:
        S = choose_splits(B * head_blocks, max_ctx, sms, BLOCK_N, BLOCK_N * (r + rope) * elt,
                          BLOCK_H * (r + rope) * elt, BLOCK_H * r * 4)
    else:
        S = max(1, min(int(num_splits), MAX_SPLITS))
    return _Launch(cfg, head_blocks, S, _cdiv(max_ctx, BLOCK_N) + 1 if INTERPRET else 0, max(2, _pow2(S)),
                   min(cfg["BLOCK_R"], 128))


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, block_size: int,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, *, num_splits: Optional[int] = None,
               block_h: Optional[int] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """MLA decode attention over the latent cache.

    q [B, H, r + rope] (row b is sequence b's one query, at position seq_lens[b] - 1); cache [slots, r + rope]
    or [slots, 1, r + rope] rows of (c_kv, k_pe), any slot stride, unit stride on the last dim; block_table
    [B, NB] int32/int64 block ids; seq_lens [B] context lengths; scale: softmax scale; kv_lora_rank: r.
    Keys = whole rows, values = their first r values. Returns [B, H, r] in q's dtype. ``num_splits``,
    ``block_h``, ``block_n`` override the shape-derived launch (benchmarks, tests).
    """
    rows = _rows(cache)
    if rows is None:
        raise ValueError(f"cache must be [slots, r + rope] or [slots, 1, r + rope], got shape {tuple(cache.shape)}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, r + rope], got shape {tuple(q.shape)}")
    B, H, D = q.shape
    r = int(kv_lora_rank)
    if not (0 < r < D):
        raise ValueError(f"kv_lora_rank must be in 1 .. {D - 1} (q's last dim is r + rope = {D}), got {r}")
    if rows.shape[1] != D:
        raise ValueError(f"cache rows have {rows.shape[1]} values but q has r + rope = {D}")
    if r > MAX_RANK or D - r > MAX_ROPE:
        raise ValueError(f"kv_lora_rank {r} / rope {D - r} above the kernel's {MAX_RANK} / {MAX_ROPE}")
    if q.dtype not in SUPPORTED_DTYPES or cache.dtype != q.dtype:
        raise ValueError(f"q and cache must share a dtype among {SUPPORTED_DTYPES}, got {q.dtype} and {cache.dtype}")
    if rows.stride(1) != 1:
        raise ValueError(f"cache must have unit stride on its last dim, got strides {tuple(cache.stride())}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be [B={B}, max_blocks] int32/int64, got {tuple(block_table.shape)} "
                         f"{block_table.dtype}")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be [B={B}], got shape {tuple(seq_lens.shape)}")
    if int(block_size) <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out = torch.empty((B, H, r), dtype=q.dtype, device=q.device)
    if B == 0 or H == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()

    plan = _plan(B, H, r, D - r, q.dtype, block_table.shape[1], int(block_size), sm_count(q.device),
                 block_h, block_n, num_splits)
    cfg, head_blocks, S = plan.cfg, plan.head_blocks, plan.splits
    if S > 1:
        mid_m = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
        mid_l = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
        mid_o = torch.empty((B, H, S, r), dtype=torch.float32, device=q.device)
    else:
        mid_m = mid_l = mid_o = out  # unused
    _mla_decode_kernel[(B, head_blocks, S)](
        q, rows, block_table, seq_lens,
        out, mid_m, mid_l, mid_o,
        q.stride(0), q.stride(1), rows.stride(0), block_table.stride(0), out.stride(0), out.stride(1),
        float(scale) * LOG2E, H, r, D - r, S,
        DIRECT=S == 1, BLOCK_SIZE=int(block_size), BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_R=cfg["BLOCK_R"], BLOCK_P=cfg["BLOCK_P"], PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERP_LOOP=INTERPRET, MAX_TILES=plan.max_tiles,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if S > 1:
        _mla_merge_kernel[(B * H, _cdiv(r, plan.block_c))](
            mid_m, mid_l, mid_o, out, out.stride(0), out.stride(1), H, r, S,
            BLOCK_S=plan.block_s, BLOCK_C=plan.block_c, num_warps=4,
        )
    return out
