"""CED indexer scores at prefill sizes over a decoded key table (``TABLE``, on).

triton_ced_indexer's ``_score_kernel`` is one (query block, key tile) a program: it loads the block's queries,
finds and decodes one tile of FP4 keys, runs one 64 x BLOCK_J x dh product and stores. At a 16K prefill's
2048-query chunk that is ~32K programs of one product each, and the FP4 decode is repeated for every 4
queries: ~424 us of scores a chunk on the H100 (~150 TFLOP/s; this kernel ~220). Here a call first decodes each
sequence's keys once into a [R * J, dh] table in the queries' dtype (FP4 values times their scale are exact in
bf16 and fp16, so the products are the FP4 path's), then each program keeps its BLOCK_Q queries' heads in
registers and walks a run of key tiles, plain row loads the pipeline can prefetch (``num_stages``).

Scores are sum_h w[t, h] * relu(q[t, h] . k[j]) in float32, -inf past each query's visible count, as
``_score_kernel`` writes them; a block whose queries span sequences scores each query against its own
sequence's keys. Shapes alone decide the grid and the loop bounds, so a CUDA-graph capture holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention import sm_count
from .triton_ced_indexer import _head_scores, _query_rows, launch_bounds
from .triton_pdl import launch_kw, pdl_signal, pdl_start
from deepinfer.backends.nvidia.host_math import cdiv, merge_launch, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
# Whether indexer_topk takes this path where it may (prefill-sized 16-bit calls whose queries read each table
# row READS times or more on average when all are visible, and whose table fits MAX_BYTES). On the H100 (33rd
# session): a 2048-query chunk at 16K, scores and top-K 494.5 us against the FP4 kernel's 694.3; the 16K bounded
# prefill's scores 1.95 ms against 4.60 (with the tiled router logits: wall 71.3 / 70.2 ms against 73.6 / 74.1).
TABLE = True
READS = 8
MAX_BYTES = 64 << 20
MAX_HEAD_DIM = 128  # (wider index heads keep the FP4 kernel)
# Programs a launch aims for, per SM: the key tiles of a query block are split into runs to reach it.
PROGRAMS_PER_SM = 4


def wanted(Tq: int, R: int, J: int, dh: int, dtype: torch.dtype, blocked: bool) -> bool:
    """Whether a call of Tq queries over R sequences' J entries of dh channels takes the table (TABLE on). Up to
    MAX_HEAD_DIM channels: 128 MMA rows of queries and two stages of key tiles fit shared memory there."""
    return TABLE and blocked and dtype in (torch.bfloat16, torch.float16) + ((torch.float32,) if INTERPRET else ()) \
        and 0 < dh <= MAX_HEAD_DIM and R * J > 0 and Tq >= READS * R \
        and R * J * dh * torch.finfo(dtype).bits // 8 <= MAX_BYTES


def launch_config(nh: int, dh: int) -> dict:
    """BLOCK_Q queries' heads make 128 MMA rows (16 at most heads of 128), 64-key tiles, 8 warps, 2 stages."""
    BLOCK_H = max(16, next_pow2(nh))
    return {"BLOCK_Q": max(1, 128 // BLOCK_H), "BLOCK_H": BLOCK_H, "BLOCK_D": max(32, next_pow2(dh)),
            "BLOCK_J": 16 if INTERPRET else 64, "num_warps": 8, "num_stages": 2}


@triton.jit
def _one_sequence_tile(q, w, table_ptr, base, ok, j0, j_end, nvis, tq, t_ok, out_ptr, stride_k, stride_ot, DH, J,
                       BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """Key tile j0 of one sequence (table rows base + j), scored for all the block's queries and stored."""
    j = j0 + tl.arange(0, BLOCK_J)
    d = tl.arange(0, BLOCK_D)
    k = tl.load(table_ptr + (base + j)[:, None] * stride_k + d[None, :],
                mask=((j < j_end) & ok)[:, None] & (d < DH)[None, :], other=0.0)
    s = _head_scores(q, w, k, BLOCK_Q, BLOCK_H, DOT_PRECISION)
    s = tl.where(j[None, :] < nvis[:, None], s, float("-inf"))
    tl.store(out_ptr + tq[:, None] * stride_ot + j[None, :], s, mask=t_ok[:, None] & (j < J)[None, :])


@triton.jit
def _mixed_tile(q, w, table_ptr, rows, j0, nvis, tq, t_ok, out_ptr, stride_k, stride_ot, DH, J,
                BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """Key tile j0 for a block whose queries span sequences: each query's rows of the product against its own
    sequence's keys."""
    j = j0 + tl.arange(0, BLOCK_J)
    d = tl.arange(0, BLOCK_D)
    qi = tl.arange(0, BLOCK_Q)
    s = tl.full([BLOCK_Q, BLOCK_J], float("-inf"), dtype=tl.float32)
    for i in range(BLOCK_Q):
        row_i = tl.sum(tl.where(qi == i, rows, 0), axis=0)
        vis = (j < tl.sum(tl.where(qi == i, nvis, 0), axis=0)) & (row_i >= 0)
        k = tl.load(table_ptr + (row_i.to(tl.int64) * J + j)[:, None] * stride_k + d[None, :],
                    mask=vis[:, None] & (d < DH)[None, :], other=0.0)
        s_i = _head_scores(q, w, k, BLOCK_Q, BLOCK_H, DOT_PRECISION)
        s = tl.where((qi == i)[:, None], s_i, s)
    s = tl.where(j[None, :] < nvis[:, None], s, float("-inf"))
    tl.store(out_ptr + tq[:, None] * stride_ot + j[None, :], s, mask=t_ok[:, None] & (j < J)[None, :])


@triton.jit
def _table_scores_kernel(q_ptr, w_ptr, table_ptr, rows_ptr, nvis_ptr, out_ptr,
                         stride_qt, stride_qh, stride_wt, stride_wh, stride_k, stride_ot,
                         Tq, NH, DH, J, TILES_PER,
                         BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_J: tl.constexpr, STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         INTERP: tl.constexpr, INTERP_TILES: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_start(PDL, True)
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_Q
    tq = t0 + tl.arange(0, BLOCK_Q)
    t_ok = tq < Tq
    nvis = tl.minimum(tl.load(nvis_ptr + tq, mask=t_ok, other=0), J)
    rows = tl.load(rows_ptr + tq, mask=t_ok, other=-1)
    row0 = tl.load(rows_ptr + t0)
    one = tl.sum((t_ok & (rows != row0)).to(tl.int32), axis=0) == 0
    q, w = _query_rows(q_ptr, w_ptr, t0, stride_qt, stride_qh, stride_wt, stride_wh, Tq, NH, DH, BLOCK_Q, BLOCK_H,
                       BLOCK_D)
    j_lo = tl.program_id(1) * TILES_PER * BLOCK_J  # this program's run of key tiles: j_lo .. j_hi
    j_hi = tl.minimum(j_lo + TILES_PER * BLOCK_J, J)
    j_end = tl.minimum(j_hi, tl.max(nvis, axis=0))  # the run's visible keys end here; past it only -inf
    # (The interpreter cannot range over a device value: it walks the whole run, INTERP_TILES = TILES_PER, the masks
    # giving -inf past j_end.)
    if one:
        base = row0.to(tl.int64) * J
        if INTERP:
            for i in range(INTERP_TILES):
                _one_sequence_tile(q, w, table_ptr, base, row0 >= 0, j_lo + i * BLOCK_J, j_end, nvis, tq, t_ok,
                                   out_ptr, stride_k, stride_ot, DH, J, BLOCK_Q, BLOCK_H, BLOCK_D, BLOCK_J,
                                   DOT_PRECISION)
        else:
            for j0 in tl.range(j_lo, j_end, BLOCK_J, num_stages=STAGES):
                _one_sequence_tile(q, w, table_ptr, base, row0 >= 0, j0, j_end, nvis, tq, t_ok, out_ptr, stride_k,
                                   stride_ot, DH, J, BLOCK_Q, BLOCK_H, BLOCK_D, BLOCK_J, DOT_PRECISION)
    else:
        if INTERP:
            for i in range(INTERP_TILES):
                _mixed_tile(q, w, table_ptr, rows, j_lo + i * BLOCK_J, nvis, tq, t_ok, out_ptr, stride_k, stride_ot,
                            DH, J, BLOCK_Q, BLOCK_H, BLOCK_D, BLOCK_J, DOT_PRECISION)
        else:
            for j0 in range(j_lo, j_end, BLOCK_J):
                _mixed_tile(q, w, table_ptr, rows, j0, nvis, tq, t_ok, out_ptr, stride_k, stride_ot, DH, J,
                            BLOCK_Q, BLOCK_H, BLOCK_D, BLOCK_J, DOT_PRECISION)
    pdl_signal(PDL)
    if not INTERP:  # the run's tiles past its last visible key: from the first tile the loops above did not reach
        j_fill = j_lo + tl.maximum(j_end - j_lo + BLOCK_J - 1, 0) // BLOCK_J * BLOCK_J
        for j0 in range(j_fill, j_hi, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            tl.store(out_ptr + tq[:, None] * stride_ot + j[None, :],
                     tl.full([BLOCK_Q, BLOCK_J], float("-inf"), dtype=tl.float32),
                     mask=t_ok[:, None] & (j < J)[None, :])


def key_table(codes: torch.Tensor, scales: torch.Tensor, fmt: str, entry_slots: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """Each sequence's keys decoded once: [R * J, dh] in dtype, row r * J + j the key of entry_slots[r, j] (a -1
    slot decodes cache row 0, which no query reads: it is past every visible count)."""
    from .triton_fp4 import dequantize

    return dequantize(codes, scales, fmt, dtype, rows=entry_slots.reshape(-1))  # (gathered in the launch)


def scores(q: torch.Tensor, weights: torch.Tensor, table: torch.Tensor, J: int, q_rows: torch.Tensor,
           num_visible: torch.Tensor, out: torch.Tensor, launch=None) -> torch.Tensor:
    """The indexer's [Tq, J] float32 scores into ``out`` from key_table's rows (inputs checked by indexer_topk)."""
    Tq, nh, dh = q.shape
    cfg = launch_config(nh, dh)
    cfg = merge_launch("indexer_table", cfg, launch, dict(launch_bounds(cfg), num_stages=(1, 4, False)))
    BQ, BJ = cfg["BLOCK_Q"], cfg["BLOCK_J"]
    blocks, tiles = cdiv(Tq, BQ), cdiv(J, BJ)
    runs = max(1, min(tiles, cdiv(PROGRAMS_PER_SM * (1 if INTERPRET else sm_count(q.device)), blocks)))
    per = cdiv(tiles, runs)
    _table_scores_kernel[(blocks, cdiv(tiles, per))](
        q, weights, table, q_rows, num_visible, out,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), table.stride(0), out.stride(0),
        Tq, nh, dh, J, per,
        BLOCK_Q=BQ, BLOCK_H=cfg["BLOCK_H"], BLOCK_D=cfg["BLOCK_D"], BLOCK_J=BJ, STAGES=cfg["num_stages"],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INTERP=INTERPRET,
        INTERP_TILES=per if INTERPRET else 0, num_warps=cfg["num_warps"],
        **launch_kw(q.device))
    return out
