"""Batch-invariant CUDA kernels in Triton: the aten overrides ``batch_invariant("cuda")`` installs.

- ``matmul``: C = alpha * A @ B (+ beta * bias), batched or not. What fixes a row's reduction, BLOCK_M,
  BLOCK_K, the k order and how K is split (``k_splits``: from K, N and the group count, never from M), depends
  on the product's shape and dtype only, so every row of A meets the same sequence of float32 steps whatever M
  is (cuBLAS picks its kernel, split-K included, from M). A split product's partial sums are added in split
  order: for few rows by a program per split writing float32 partials and ``_mm_combine_kernel``, for many
  rows by one program walking the splits (the same additions, without the partials' memory); only narrow
  products (a router's 32 columns) are split, so that they spread over a few SMs instead of one. For 16-bit dtypes
  the output tile's width and the pipeline depth follow M in two bands (a decode step's few rows: narrow tiles;
  more rows: wide tiles): they do not enter a row's reduction, and the GPU test
  test_tile_bands_give_the_same_bits holds the device to that (on the H200 every width and depth gave the same
  bits: benchmarks/bi_matmul_tiles.py). Float32 uses the "ieee" dot (no TF32) and one config.
- ``row_sum`` / ``row_mean`` (aten sum.dim_IntList, mean.dim) and ``softmax`` / ``log_softmax``: a row walked
  in BLOCK-wide chunks from its start, per-lane float32 accumulation, then one tree reduction of the BLOCK
  lanes, BLOCK (and how many short rows share a program) from the row's length alone (torch's reductions
  split a row across blocks when there are few rows). A sum over one dim that is not the last is read where
  it lies, each element summed in index order; other reduced dims are moved last first.

Every wrapper takes what its aten op takes and falls back to the op's ``out=`` overload (not overridden) for
what the kernels do not cover (integer dtypes, float64, empty tensors): those are either exact or not on a
path a model takes. Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the tests); the interpreter
multiplies bf16 dot operands as raw bits, so they are upcast to float32 there (exact: a bf16 product fits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_norm import cast_rne, to_f32  # noqa: F401  (cast_rne: the stores' rounding, as the other kernels)
from deepinfer.backends.nvidia.host_math import cdiv, next_pow2

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The reduction's tiling (BLOCK_M, BLOCK_K) per dtype, never from M.
MM_CONFIG = {torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3),
             torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
             torch.float16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)}
DECODE_ROWS = 64  # up to this many rows a step reads each weight once and is bound by its bytes
# 16-bit tiles for the decode band, by N (H200, Llama-3.1-8B widths, benchmarks/bi_matmul_tiles.py): narrower
# tiles below 8192 columns keep 2+ programs per SM streaming the weight (down_proj 67 -> 39 us at one row).
DECODE_TILES = ((4096, dict(BLOCK_N=32, num_stages=5)), (8192, dict(BLOCK_N=64, num_stages=4)),
                (None, dict(BLOCK_N=128, num_stages=4)))
INTERP_MM = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1)
# Split-K (k_splits) only for products whose unsplit grid has fewer than SPLIT_BELOW programs (a router's 32 or
# an indexer's 16 columns walking all of K on one SM): aim at SPLIT_TARGET programs, never below SPLIT_MIN_KB
# k-blocks per split. Wider products stay unsplit: on the H200 a split cost more than it gained for every
# product of 512 columns or more (a second kernel and the partials' traffic against ~5 us calls; the walk
# through splits slowed prefill by 10-30%: docs/results/h200_issue16_bi_matmul_picked.jsonl). Up to SPLIT_ROWS
# rows the splits run as programs of their own (partials), above in one. Under the interpreter small numbers,
# so the tests' small shapes take every path.
SPLIT_TARGET, SPLIT_MIN_KB, SPLIT_BELOW, SPLIT_ROWS = (2, 1, 4, 8) if INTERPRET else (64, 4, 32, DECODE_ROWS)
ROW_BLOCK = 16 if INTERPRET else 1024  # most lanes of the row kernels (row_block: fewer for short rows)
COL_BLOCK = 16 if INTERPRET else 256  # output elements per program of a reduction over a dim not the last


def _i(n: int) -> int:
    """A loop bound for the interpreter (runtime ints are not range() bounds there); 0 when compiled."""
    return int(n) if INTERPRET else 0


def k_splits(dtype: torch.dtype, K: int, N: int, nb: int = 1) -> tuple:
    """How a row's reduction over K is split: (splits, k-blocks per split), from the dtype's BLOCK_K, K, N and
    the batch count of a bmm (a weight's shape: never M). A narrow product (a router's 32 columns, an indexer's
    16) leaves all SMs but one idle when one program walks all of K; splitting K gives it SPLIT_TARGET programs'
    worth of parallelism. Every M reduces through the
    same splits (few rows: a program per split writing a float32 partial, summed in split order by
    _mm_combine_kernel; many rows: one program walking the splits in order into one total), so a row's bits do
    not depend on M."""
    cfg = INTERP_MM if INTERPRET else MM_CONFIG[dtype]
    kb = cdiv(max(K, 1), cfg["BLOCK_K"])
    width = cfg["BLOCK_N"] if INTERPRET else mm_config(dtype, N, 1)["BLOCK_N"]  # the decode band's tile width
    programs = cdiv(N, width) * max(nb, 1)
    if programs >= SPLIT_BELOW:
        return 1, kb
    want = max(1, min(cdiv(SPLIT_TARGET, programs), kb // SPLIT_MIN_KB))
    per = cdiv(kb, want)
    return cdiv(kb, per), per


@triton.jit
def _k_run(a_ptrs, b_ptrs, acc, total, kb_lo, kb_hi, kb, rm, rn, rk, M, N, K, s_ak, s_bk,
           BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, KB_PER: tl.constexpr, WALK: tl.constexpr):
    """One k-block of the product into acc; when WALK (one program walking every split), acc closes into
    total at the end of each split, in split order."""
    k0 = kb * BLOCK_K
    kmask = k0 + rk < K
    a = tl.load(a_ptrs + k0 * s_ak, mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
    b = tl.load(b_ptrs + k0 * s_bk, mask=kmask[:, None] & (rn[None, :] < N), other=0.0)
    if _INTERP:
        acc += tl.dot(to_f32(a), to_f32(b))
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if WALK:
        end = ((kb + 1 - kb_lo) % KB_PER == 0) | (kb + 1 == kb_hi)
        total = tl.where(end, total + acc, total)
        acc = tl.where(end, 0.0, acc)
    return acc, total


@triton.jit
def _epilogue(acc, bias_ptr, c_ptr, bat, rm, rn, M, N, s_xb, s_xm, s_xn, s_cb, s_cm, s_cn, alpha, beta,
              HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):
    """alpha * acc + beta * bias, rounded to c's dtype and stored: one function, so that both ways of reducing
    (one kernel, or partials then _mm_combine_kernel) finish a row with the same instructions."""
    if SCALED:
        acc = acc * alpha
    cmask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_BIAS:
        x = tl.load(bias_ptr + bat * s_xb + rm[:, None].to(tl.int64) * s_xm + rn[None, :] * s_xn, mask=cmask,
                    other=0.0)
        acc = acc + beta * to_f32(x)
    tl.store(c_ptr + bat * s_cb + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn,
             cast_rne(acc, c_ptr.dtype.element_ty), mask=cmask)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M (Triton would specialise M == 1, M % 16)
def _mm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, p_ptr, M, N, K, KB, S,
               s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_xb, s_xm, s_xn, alpha, beta,
               HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, KB_PER: tl.constexpr, MODE: tl.constexpr,
               KB_I: tl.constexpr):
    """MODE 0: one split (acc is the row's sum); 1: program (.., .., bat * S + s) writes split s's float32
    partial to p [nb, S, M, N]; 2: one program walks the S splits in order into one total. k-blocks of split s:
    [s * KB_PER, min((s + 1) * KB_PER, KB))."""
    pid_m, pid_n, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if MODE == 1:
        bat, split = (z // S).to(tl.int64), z % S
        kb_lo = split * KB_PER
        kb_hi = tl.minimum(kb_lo + KB_PER, KB)
    else:
        bat, split = z.to(tl.int64), 0
        kb_lo = 0
        kb_hi = KB
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + bat * s_ab + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + bat * s_bb + rk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if _INTERP:  # range() bounds must be Python ints there
        for i in range(KB_I):
            if kb_lo + i < kb_hi:
                acc, total = _k_run(a_ptrs, b_ptrs, acc, total, kb_lo, kb_hi, kb_lo + i, rm, rn, rk, M, N, K,
                                    s_ak, s_bk, BLOCK_K, PRECISION, KB_PER, MODE == 2)
    else:
        for kb in range(kb_lo, kb_hi):
            acc, total = _k_run(a_ptrs, b_ptrs, acc, total, kb_lo, kb_hi, kb, rm, rn, rk, M, N, K,
                                s_ak, s_bk, BLOCK_K, PRECISION, KB_PER, MODE == 2)
    if MODE == 1:
        pmask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(p_ptr + ((bat * S + split) * M + rm[:, None].to(tl.int64)) * N + rn[None, :], acc, mask=pmask)
    else:
        _epilogue(total if MODE == 2 else acc, bias_ptr, c_ptr, bat, rm, rn, M, N, s_xb, s_xm, s_xn,
                  s_cb, s_cm, s_cn, alpha, beta, HAS_BIAS, SCALED)


@triton.jit(do_not_specialize=["M"])
def _mm_combine_kernel(p_ptr, c_ptr, bias_ptr, M, N, S, s_cb, s_cm, s_cn, s_xb, s_xm, s_xn, alpha, beta,
                       HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, S_I: tl.constexpr):
    """The S partials of a split product summed in split order (as MODE 2 walks them), then the epilogue."""
    pid_m, pid_n, bat = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    pmask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = p_ptr + (bat * S * M + rm[:, None].to(tl.int64)) * N + rn[None, :]
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(S_I if _INTERP else S):
        total = total + tl.load(ptrs + s * M * N, mask=pmask, other=0.0)
    _epilogue(total, bias_ptr, c_ptr, bat, rm, rn, M, N, s_xb, s_xm, s_xn, s_cb, s_cm, s_cn, alpha, beta,
              HAS_BIAS, SCALED)


def mm_config(dtype: torch.dtype, N: int, M: int) -> dict:
    """The launch config of an [M, K] @ [K, N] product: BLOCK_M and BLOCK_K from the dtype alone; for 16-bit
    dtypes the tile width and pipeline depth from N and the band M falls in (see the module's docstring)."""
    cfg = dict(MM_CONFIG[dtype])
    if dtype != torch.float32 and M <= DECODE_ROWS:
        cfg.update(next(t for n, t in DECODE_TILES if n is None or N <= n))
    return cfg


def matmul(a: torch.Tensor, b: torch.Tensor, bias=None, alpha=1.0, beta=1.0) -> torch.Tensor:
    """a [M, K] @ b [K, N] or a [B, M, K] @ b [B, K, N] (any strides), times alpha, plus beta * bias
    (broadcastable to the output), in a's dtype (a and b share it)."""
    batched = a.dim() == 3
    A, Bm = (a, b) if batched else (a[None], b[None])
    nb, M, K = A.shape
    N = Bm.shape[2]
    out = torch.empty(nb, M, N, dtype=a.dtype, device=a.device)
    if out.numel() and K:
        has_bias = bias is not None and beta != 0
        x = bias.expand(nb, M, N) if has_bias else out  # broadcast by strides (0 along expanded dims)
        cfg = INTERP_MM if INTERPRET else mm_config(a.dtype, N, M)
        S, per = k_splits(a.dtype, K, N, nb)
        kb = cdiv(K, cfg["BLOCK_K"])
        mode = 0 if S == 1 else (1 if M <= SPLIT_ROWS else 2)
        p = torch.empty(nb, S, M, N, dtype=torch.float32, device=a.device) if mode == 1 else out
        tiles = (cdiv(M, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"]))
        flags = dict(HAS_BIAS=has_bias, SCALED=alpha != 1, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"])
        _mm_kernel[(*tiles, nb * (S if mode == 1 else 1))](
            A, Bm, out, x, p, M, N, K, kb, S, *A.stride(), *Bm.stride(), *out.stride(), *x.stride(),
            float(alpha), float(beta), **flags, BLOCK_K=cfg["BLOCK_K"],
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32", KB_PER=per, MODE=mode,
            KB_I=_i(per if mode == 1 else kb), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if mode == 1:
            _mm_combine_kernel[(*tiles, nb)](p, out, x, M, N, S, *out.stride(), *x.stride(), float(alpha),
                                             float(beta), **flags, S_I=_i(S), num_warps=4)
    elif out.numel() and bias is not None and beta != 0:
        out = out.zero_() + beta * bias
    else:
        out.zero_()
    return out if batched else out[0]


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, R, N, s_x, scale, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                    N_I: tl.constexpr):
    """ROWS rows of x [R, N] per program, each walked in BLOCK-wide chunks into per-lane sums, then a tree of
    the BLOCK lanes (ROWS and BLOCK come from N alone: row_block)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for c in range(0, N_I if _INTERP else N, BLOCK):
        m = (rows[:, None] < R) & (c + cols[None, :] < N)
        acc += to_f32(tl.load(x_ptr + rows[:, None] * s_x + c + cols[None, :], mask=m, other=0.0))
    tl.store(out_ptr + rows, cast_rne(tl.sum(acc, 1) * scale, out_ptr.dtype.element_ty), mask=rows < R)


@triton.jit
def _col_sum_kernel(x_ptr, out_ptr, N, I, s_o, s_n, s_i, scale, BLOCK: tl.constexpr, N_I: tl.constexpr):
    """x viewed [O, N, I] summed over N, each output element in order j = 0 .. N-1 (a reduction over a dim
    that is not the last, read where it lies: no transposed copy, and a short N is not a program per row)."""
    o = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ptrs = x_ptr + o * s_o + cols.to(tl.int64) * s_i
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, N_I if _INTERP else N):
        acc += to_f32(tl.load(ptrs + j * s_n, mask=cols < I, other=0.0))
    tl.store(out_ptr + o * I + cols, cast_rne(acc * scale, out_ptr.dtype.element_ty), mask=cols < I)


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, N, s_x, s_o, LOG: tl.constexpr, BLOCK: tl.constexpr, N_I: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for c in range(0, N_I if _INTERP else N, BLOCK):
        mx = tl.maximum(mx, to_f32(tl.load(x_ptr + row * s_x + c + cols, mask=c + cols < N, other=float("-inf"))))
    m = tl.max(mx, 0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, N_I if _INTERP else N, BLOCK):
        x = to_f32(tl.load(x_ptr + row * s_x + c + cols, mask=c + cols < N, other=float("-inf")))
        acc += tl.exp(x - m)
    total = tl.sum(acc, 0)
    for c in range(0, N_I if _INTERP else N, BLOCK):
        x = to_f32(tl.load(x_ptr + row * s_x + c + cols, mask=c + cols < N, other=float("-inf")))
        if LOG:
            y = x - m - tl.log(total)
        else:
            y = tl.exp(x - m) / total
        tl.store(out_ptr + row * s_o + c + cols, cast_rne(y, out_ptr.dtype.element_ty), mask=c + cols < N)


def _dims(x: torch.Tensor, dim) -> list:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(x.dim(), 1) for d in dims})


def _as_rows(x: torch.Tensor, dims: list) -> tuple:
    """x with ``dims`` moved last and flattened: ([R, n] contiguous, the kept sizes)."""
    keep = [d for d in range(x.dim()) if d not in dims]
    kept = [x.shape[d] for d in keep]
    n = 1
    for d in dims:
        n *= x.shape[d]
    rows = x.permute(*keep, *dims).reshape(-1, n)
    return (rows if rows.is_contiguous() else rows.contiguous()), kept


def row_block(n: int) -> tuple:
    """(rows per program, lanes) of the row kernels for rows of length n: from n alone, so a row's order of
    reduction never depends on how many rows there are; short rows share a program instead of each taking
    1024 lanes."""
    if INTERPRET:
        return 2, ROW_BLOCK
    lanes = min(ROW_BLOCK, max(32, next_pow2(max(n, 1))))
    return max(1, 2048 // lanes) if lanes < ROW_BLOCK else 1, lanes


def _reduce(x, dim, keepdim, dtype, mean: bool):
    op = torch.ops.aten.mean.out if mean else torch.ops.aten.sum.IntList_out
    out_dtype = dtype or (x.dtype if x.dtype.is_floating_point else torch.int64)
    if x.dtype not in KERNEL_DTYPES or out_dtype not in KERNEL_DTYPES or x.numel() == 0 or x.dim() == 0:
        return op(x, dim, keepdim, dtype=dtype, out=torch.empty(0, dtype=out_dtype, device=x.device))
    dims = _dims(x, dim)
    if len(dims) == 1 and dims[0] != x.dim() - 1:  # one dim, not the last: summed where it lies
        d = dims[0]
        n = x.shape[d]
        kept = [x.shape[i] for i in range(x.dim()) if i != d]
        inner = 1
        for size in x.shape[d + 1:]:
            inner *= size
        v = x.reshape(-1, n, inner)
        out = torch.empty(v.shape[0], inner, dtype=out_dtype, device=x.device)
        _col_sum_kernel[(v.shape[0], cdiv(inner, COL_BLOCK))](
            v, out, n, inner, *v.stride(), 1.0 / n if mean else 1.0, BLOCK=COL_BLOCK, N_I=_i(n))
    else:
        rows, kept = _as_rows(x, dims)
        R, n = rows.shape
        out = torch.empty(R, dtype=out_dtype, device=x.device)
        per, lanes = row_block(n)
        _row_sum_kernel[(cdiv(R, per),)](rows, out, R, n, rows.stride(0), 1.0 / n if mean else 1.0,
                                                ROWS=per, BLOCK=lanes, N_I=_i(n))
    if keepdim:
        shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
        return out.view(shape)
    return out.view(kept)


def row_sum(x, dim=None, keepdim=False, *, dtype=None):
    return _reduce(x, dim, keepdim, dtype, mean=False)


def row_mean(x, dim=None, keepdim=False, *, dtype=None):
    return _reduce(x, dim, keepdim, dtype, mean=True)


def _softmax_any(x, dim, half_to_float, log: bool):
    out_dtype = torch.float32 if half_to_float else x.dtype
    op = torch.ops.aten._log_softmax.out if log else torch.ops.aten._softmax.out
    if x.dtype not in KERNEL_DTYPES or x.numel() == 0 or x.dim() == 0:
        return op(x, dim, half_to_float, out=torch.empty(0, dtype=out_dtype, device=x.device))
    d = dim % x.dim()
    rows, _ = _as_rows(x, [d])
    R, n = rows.shape
    out = torch.empty(R, n, dtype=out_dtype, device=x.device)
    _softmax_kernel[(R,)](rows, out, n, rows.stride(0), out.stride(0), LOG=log, BLOCK=row_block(n)[1],
                          N_I=_i(n))
    moved = [x.shape[i] for i in range(x.dim()) if i != d] + [n]
    back = list(range(d)) + [x.dim() - 1] + list(range(d, x.dim() - 1))
    return out.view(moved).permute(*back).contiguous()


def softmax(x, dim, half_to_float=False):
    return _softmax_any(x, dim, half_to_float, log=False)


def log_softmax(x, dim, half_to_float=False):
    return _softmax_any(x, dim, half_to_float, log=True)


def _gemm_ok(a, b) -> bool:
    return a.dtype in KERNEL_DTYPES and a.dtype == b.dtype and a.is_cuda == b.is_cuda


def _mm(a, b):
    if not _gemm_ok(a, b):
        return torch.ops.aten.mm.out(a, b, out=torch.empty(0, dtype=torch.result_type(a, b), device=a.device))
    return matmul(a, b)


def _bmm(a, b):
    if not _gemm_ok(a, b):
        return torch.ops.aten.bmm.out(a, b, out=torch.empty(0, dtype=torch.result_type(a, b), device=a.device))
    return matmul(a, b)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if not _gemm_ok(a, b) or bias.dtype != a.dtype:
        return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha,
                                        out=torch.empty(0, dtype=torch.result_type(a, b), device=a.device))
    return matmul(a, b, bias, alpha, beta)


def _baddbmm(bias, a, b, *, beta=1, alpha=1):
    if not _gemm_ok(a, b) or bias.dtype != a.dtype:
        return torch.ops.aten.baddbmm.out(bias, a, b, beta=beta, alpha=alpha,
                                          out=torch.empty(0, dtype=torch.result_type(a, b), device=a.device))
    return matmul(a, b, bias, alpha, beta)


def cuda_impls() -> dict:
    """aten overload -> implementation, for ``torch.library`` on the CUDA dispatch key."""
    return {"mm": _mm, "bmm": _bmm, "addmm": _addmm, "baddbmm": _baddbmm, "sum.dim_IntList": row_sum,
            "mean.dim": row_mean, "_softmax": softmax, "_log_softmax": log_softmax}
