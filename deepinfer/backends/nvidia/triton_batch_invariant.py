"""Batch-invariant CUDA kernels in Triton: the aten overrides ``batch_invariant("cuda")`` installs.

- ``matmul``: C = alpha * A @ B (+ beta * bias), batched or not, one program per (BLOCK_M x BLOCK_N) output
  tile walking the whole K in BLOCK_K steps from 0 (no split-K, no stream-K). What fixes a row's reduction,
  BLOCK_M, BLOCK_K and the k order into one float32 accumulator, depends on the dtype only, never on M, so
  every row of A meets the same sequence of tensor-core steps whatever M is (cuBLAS picks its kernel, split-K
  included, from M). For 16-bit dtypes the output tile's width and the pipeline depth follow M in two bands
  (a decode step's few rows: narrow tiles that spread a weight over the SMs; more rows: wide tiles): they do
  not enter a row's reduction, and the GPU test test_tile_bands_give_the_same_bits holds the device to that
  (on the H200 every width and depth gave the same bits: benchmarks/bi_matmul_tiles.py). Float32 uses the
  "ieee" dot (no TF32) and one config.
- ``row_sum`` / ``row_mean`` (aten sum.dim_IntList, mean.dim) and ``softmax`` / ``log_softmax``: one program
  per row, the row walked in BLOCK-wide chunks from its start, per-lane float32 accumulation, then one
  tree reduction of the BLOCK lanes: the order depends on the row's length only (torch's reductions split a
  row across blocks when there are few rows). Reduced dims that are not the last are moved there first.

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
ROW_BLOCK = 16 if INTERPRET else 1024  # lanes of the row kernels


def _i(n: int) -> int:
    """A loop bound for the interpreter (runtime ints are not range() bounds there); 0 when compiled."""
    return int(n) if INTERPRET else 0


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M (Triton would specialise M == 1, M % 16)
def _mm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
               s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_xb, s_xm, s_xn, alpha, beta,
               HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, K_I: tl.constexpr):
    pid_m, pid_n, bat = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + bat * s_ab + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + bat * s_bb + rk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_I if _INTERP else K, BLOCK_K):
        kmask = k0 + rk < K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & (rn[None, :] < N), other=0.0)
        if _INTERP:
            acc += tl.dot(to_f32(a), to_f32(b))
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    if SCALED:
        acc = acc * alpha
    cmask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_BIAS:
        x = tl.load(bias_ptr + bat * s_xb + rm[:, None].to(tl.int64) * s_xm + rn[None, :] * s_xn, mask=cmask,
                    other=0.0)
        acc = acc + beta * to_f32(x)
    tl.store(c_ptr + bat * s_cb + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn,
             cast_rne(acc, c_ptr.dtype.element_ty), mask=cmask)


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
    if out.numel():
        has_bias = bias is not None and beta != 0
        x = bias.expand(nb, M, N) if has_bias else out  # broadcast by strides (0 along expanded dims)
        cfg = INTERP_MM if INTERPRET else mm_config(a.dtype, N, M)
        grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), nb)
        _mm_kernel[grid](A, Bm, out, x, M, N, K, *A.stride(), *Bm.stride(), *out.stride(), *x.stride(),
                         float(alpha), float(beta), HAS_BIAS=has_bias, SCALED=alpha != 1,
                         BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                         PRECISION="ieee" if a.dtype == torch.float32 else "tf32", K_I=_i(K),
                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    elif K == 0 and bias is not None and beta != 0:
        out = out.zero_() + beta * bias
    else:
        out.zero_()
    return out if batched else out[0]


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, N, s_x, scale, BLOCK: tl.constexpr, N_I: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, N_I if _INTERP else N, BLOCK):
        acc += to_f32(tl.load(x_ptr + row * s_x + c + cols, mask=c + cols < N, other=0.0))
    tl.store(out_ptr + row, cast_rne(tl.sum(acc, 0) * scale, out_ptr.dtype.element_ty))


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


def _reduce(x, dim, keepdim, dtype, mean: bool):
    op = torch.ops.aten.mean.out if mean else torch.ops.aten.sum.IntList_out
    out_dtype = dtype or (x.dtype if x.dtype.is_floating_point else torch.int64)
    if x.dtype not in KERNEL_DTYPES or out_dtype not in KERNEL_DTYPES or x.numel() == 0 or x.dim() == 0:
        return op(x, dim, keepdim, dtype=dtype, out=torch.empty(0, dtype=out_dtype, device=x.device))
    dims = _dims(x, dim)
    rows, kept = _as_rows(x, dims)
    R, n = rows.shape
    out = torch.empty(R, dtype=out_dtype, device=x.device)
    _row_sum_kernel[(R,)](rows, out, n, rows.stride(0), 1.0 / n if mean else 1.0, BLOCK=ROW_BLOCK, N_I=_i(n))
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
    _softmax_kernel[(R,)](rows, out, n, rows.stride(0), out.stride(0), LOG=log, BLOCK=ROW_BLOCK, N_I=_i(n))
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
