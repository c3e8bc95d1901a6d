"""Batch-invariant execution: while ``batch_invariant(device)`` is active, each row of every matmul and of every
op whose result could depend on the rows beside it is computed the same way whatever the batch holds.

Why a model's output can depend on its batch: a GEMM library picks its blocking (and on a GPU its split-K and
tile config) from the shape, so row i of ``X @ W`` gets other roundings when X has 3 rows than when it has 300;
torch's vectorised CPU loops compute the elements of a last, partial vector (and of each thread's chunk's
tail) with the scalar function, which differs from the SIMD one by an ulp for sigmoid, silu, softplus, pow and
bf16 rsqrt (measured: tests/test_batch_invariant.py); GPU reductions split a row across blocks when there
are few rows. None of these is wrong; each makes a request's output a function of its neighbours.

What this module does (the models are not edited: they call nn.Linear / F.linear / torch.einsum as before):
while the context is active it overrides aten kernels for one dispatch key through ``torch.library``, and
removes the overrides on exit (nested contexts share one installation).

- CPU: ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv`` run the GEMM on fixed-shape row tiles of
  ``ROW_TILE`` rows (the last tile zero-padded, all in a fresh buffer), as one call of the un-overridden
  ``bmm`` (its ``out=`` overload) whose every matrix product has one shape, against a contiguous right
  operand (a weight's transpose is copied once and kept: CPU weights are held twice in this mode). The
  ``UNARY`` elementwise ops and ``pow(Scalar, Tensor)`` run on a contiguous copy padded to whole SIMD vectors,
  in pieces small enough for one thread, so every element goes through the vector function; the ``EXACT``
  calls (pow by 2, 0.5 or -1, float32 rsqrt), whose two loops compute the same correctly rounded function,
  run unpadded. A Python override costs ~5 us a call before it does anything, so each keeps its own work to a
  few C calls (torch's bindings, not aten OpOverloads).
- CUDA (``nvidia/triton_batch_invariant.py``): ``mm``, ``addmm``, ``bmm`` through one Triton matmul whose
  reduction (k-blocks, and for narrow products a split of K) follows the product's shape, never M;
  ``mean.dim``, ``sum.dim_IntList``, ``_softmax`` and ``_log_softmax`` over fixed chunks sized by the row's
  length (a sum over a middle dim in index order where it lies).

Attention and MoE are the backends' own ops: with ``ops.batch_invariant`` set (the engine sets it from
EngineConfig.batch_invariant), the reference backend attends over the KV in fixed blocks from position 0
(reference/invariant_attention.py) and the nvidia backend routes every row through one attention kernel and
one MoE tile config. What is guaranteed, and what is not, is in README.md ("Deterministic inference").

The override is process-wide for the dispatch key while active (another thread's CPU matmuls take the tiled
path too: slower, same function). Tensors that need a gradient are not supported inside the context.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

# Rows per matrix product on the CPU. Measured (the demo's 256 x 768 projection, one thread, contiguous weight):
# 1 row costs 2.1x a GEMV at 8 (3.3x at 16, 1.6x at 4); 256 rows 1.02x one GEMM at 8 (1.0x at 16, 1.16x at 4).
ROW_TILE = 8
PAD = 256  # elementwise inputs are padded to a multiple of this many elements (whole vectors, any ISA)
PIECE = 16384  # elements per elementwise call: below torch's grain size (32768), so one thread runs it
# Elementwise ops whose vectorised CPU loops treat a tail differently (or may): (name, overload, out overload).
UNARY = (("exp", "default", "out"), ("log", "default", "out"), ("sin", "default", "out"),
         ("cos", "default", "out"), ("tanh", "default", "out"), ("sigmoid", "default", "out"),
         ("silu", "default", "out"), ("rsqrt", "default", "out"), ("erf", "default", "out"),
         ("log1p", "default", "out"), ("expm1", "default", "out"), ("gelu", "default", "out"),
         ("softplus", "default", "out"), ("pow", "Tensor_Scalar", "Tensor_Scalar_out"))
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Calls of a UNARY op whose vectorised and scalar CPU loops compute one function of correctly rounded IEEE
# operations, so a tail changes no bit and they run unpadded: pow(x, 2 / 0.5 / -1) is base * base, sqrt(base),
# 1 / base in both loops (PowKernel's special cases; bf16/fp16 in float, one rounding back); float32/float64
# rsqrt is 1 / sqrt in both (Vectorized::rsqrt divides by a correctly rounded sqrt; bf16 rsqrt is not: it
# differs). tests/test_batch_invariant.py holds each over batch size, row position and threads, and shows
# that a wrong claim (pow 1.5, bf16 rsqrt) fails the same check.
EXACT_POW = (2, 0.5, -1)
EXACT = {"pow.Tensor_Scalar": lambda x, e: type(e) in (int, float) and e in EXACT_POW,
         "rsqrt": lambda x: x.dtype in (torch.float32, torch.float64)}

_lock = threading.Lock()
_active: dict = {}  # dispatch key -> [depth, torch.library.Library]


# ------------------------------------------------------------------------------------------------ CPU
_WEIGHT_COPIES: dict = {}  # id(Parameter) -> (weakref to it, {view key: (its version, contiguous copy)})


def _contiguous_rhs(b: torch.Tensor) -> torch.Tensor:
    """b (the right operand: [K, N], or [B, K, N]) contiguous. torch's CPU bmm is 2-3x slower on a transposed
    right operand, which every F.linear passes (weight.t()); a view of an nn.Parameter (a weight) is copied
    once and kept while the parameter lives and is unchanged (its version), anything else is copied per call."""
    if b.is_contiguous():
        return b
    base = b._base
    if not isinstance(base, torch.nn.Parameter):
        return b.contiguous()
    key = (b.storage_offset(), tuple(b.shape), b.stride(), b.dtype)
    entry = _WEIGHT_COPIES.get(id(base))
    if entry is None or entry[0]() is not base:
        entry = _WEIGHT_COPIES[id(base)] = (weakref.ref(base), {})
        weakref.finalize(base, _WEIGHT_COPIES.pop, id(base), None)  # the copies go with the parameter
    copies = entry[1]
    hit = copies.get(key)
    if hit is None or hit[0] != base._version:
        hit = copies[key] = (base._version, b.contiguous())
    return hit[1]


def _fresh_rows(a: torch.Tensor, pad: int) -> torch.Tensor:
    """a [..., M, K] in a fresh contiguous buffer with ``pad`` zero rows after its M (constant_pad_nd keeps a
    transposed a's strides when pad is 0, so that case is a contiguous clone)."""
    if pad == 0:
        return a.clone(memory_format=torch.contiguous_format)
    return torch.constant_pad_nd(a, (0, 0, 0, pad)).contiguous()


def cpu_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] as one bmm over ROW_TILE-row tiles of a (zero-padded, in a fresh buffer) against b
    (expanded, not copied): every matrix product has one shape, so row i's result depends on neither M nor i."""
    M, K = a.shape
    N = b.shape[1]
    dtype = a.dtype if a.dtype == b.dtype else torch.result_type(a, b)
    if M == 0:
        return torch.empty(0, N, dtype=dtype, device=a.device)
    tiles = -(-M // ROW_TILE)
    pad = tiles * ROW_TILE - M
    ap = _fresh_rows(a, pad)
    res = torch.empty(tiles, ROW_TILE, N, dtype=dtype, device=a.device)
    torch.bmm(ap.view(tiles, ROW_TILE, K), _contiguous_rhs(b).expand(tiles, K, N), out=res)  # bmm.out: not overridden
    return res.view(M, N) if pad == 0 else res.view(tiles * ROW_TILE, N)[:M]


def cpu_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N]: M padded to whole ROW_TILE tiles, each tile one matrix of one bmm call."""
    B, M, K = a.shape
    N = b.shape[2]
    dtype = a.dtype if a.dtype == b.dtype else torch.result_type(a, b)
    if B == 0 or M == 0:
        return torch.empty(B, M, N, dtype=dtype, device=a.device)
    tiles = -(-M // ROW_TILE)
    pad = tiles * ROW_TILE - M
    ap = _fresh_rows(a, pad).view(B * tiles, ROW_TILE, K)
    # each tile's own copy of its b (one copy, whatever b's strides), or b itself (kept contiguous) for one tile
    bp = _contiguous_rhs(b) if tiles == 1 else b[:, None].expand(B, tiles, K, N).reshape(B * tiles, K, N)
    res = torch.empty(B * tiles, ROW_TILE, N, dtype=dtype, device=a.device)
    torch.bmm(ap, bp, out=res)
    return res.view(B, M, N) if pad == 0 else res.view(B, tiles * ROW_TILE, N)[:, :M].contiguous()


def _scaled(out, bias, beta, alpha):
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    return out + (bias if beta == 1 else bias * beta)


def cpu_addmm(bias, a, b, *, beta=1, alpha=1):
    return _scaled(cpu_mm(a, b), bias, beta, alpha)


def cpu_baddbmm(bias, a, b, *, beta=1, alpha=1):
    return _scaled(cpu_bmm(a, b), bias, beta, alpha)


def cpu_mv(a, v):
    return cpu_mm(a, v[:, None])[:, 0]


def _unary(op, op_out, exact=None):
    """An elementwise op computed on a contiguous copy padded to whole vectors, PIECE elements per call (in
    place on the copy: the out overload with out= its input, the same kernel). ``exact(x, *args)``, where
    given, names the calls whose vector and scalar loops compute one IEEE-exact function (EXACT): those run
    as torch computes them, unpadded."""

    def impl(x, *args, **kwargs):
        if x.dtype not in FLOATS or x.numel() == 0:  # as the op computes it (the out overload is not overridden)
            dtype = op(x.to("meta"), *args, **kwargs).dtype  # the result dtype the op decides (ints -> float, ...)
            return op_out(x, *args, **kwargs, out=torch.empty(0, dtype=dtype, device=x.device))
        if exact is not None and exact(x, *args):
            return op_out(x, *args, **kwargs, out=torch.empty_like(x))
        n = x.numel()
        pad = -n % PAD
        buf = torch.constant_pad_nd(x.reshape(-1), (0, pad))  # a fresh copy, so the op may write into it
        if n + pad <= PIECE:
            op_out(buf, *args, **kwargs, out=buf)
        else:
            for lo in range(0, n + pad, PIECE):
                piece = buf[lo:lo + PIECE]
                op_out(piece, *args, **kwargs, out=piece)
        return (buf if pad == 0 else buf[:n]).view(x.shape)

    return impl


def _pow_scalar_base():
    """pow(Scalar base, Tensor exponent): the tensor is the second argument."""
    tensor_first = _unary(lambda e, base: torch.ops.aten.pow.Scalar(base, e),
                          lambda e, base, out: torch.pow(base, e, out=out))  # pow.Scalar_out
    return lambda base, exponent: tensor_first(exponent, base)


def _out_binding(name: str, op_out):
    """The out overload through torch's C binding where it has one (torch.exp(x, out=), torch._C._nn.silu(x,
    out=)): the same kernel as ``op_out`` (aten's OpOverload), a microsecond less per call."""
    fn = getattr(torch, name, None) or getattr(torch._C._nn, name, None)
    return op_out if fn is None else fn


def _cpu_impls() -> dict:
    impls = {"mm": cpu_mm, "bmm": cpu_bmm, "addmm": cpu_addmm, "baddbmm": cpu_baddbmm, "mv": cpu_mv,
             "pow.Scalar": _pow_scalar_base()}
    for name, overload, out in UNARY:
        key = name if overload == "default" else f"{name}.{overload}"
        packet = getattr(torch.ops.aten, name)
        impls[key] = _unary(getattr(packet, overload), _out_binding(name, getattr(packet, out)), EXACT.get(key))
    return impls


_IMPLS: dict = {}  # dispatch key -> its impls, built once (a step enters the context twice)


def _impls(key: str) -> dict:
    if key not in _IMPLS:
        _IMPLS[key] = _build_impls(key)
    return _IMPLS[key]


def _build_impls(key: str) -> dict:
    if key == "CPU":
        return _cpu_impls()
    if key == "CUDA":
        from .nvidia import triton_batch_invariant

        return triton_batch_invariant.cuda_impls()
    raise ValueError(f"batch_invariant: no batch-invariant kernels for dispatch key {key!r} (CPU or CUDA)")


def dispatch_key(device) -> str:
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"batch_invariant: device {kind!r} has no batch-invariant kernels (cpu or cuda)")
    return kind.upper()


@contextlib.contextmanager
def batch_invariant(device="cpu"):
    """Override the batch-dependent aten kernels of ``device``'s dispatch key while the block runs."""
    key = dispatch_key(device)
    with _lock:
        entry = _active.get(key)
        if entry is None:
            import warnings

            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
                warnings.simplefilter("ignore")
                for name, fn in _impls(key).items():
                    lib.impl(name, fn, key)
            entry = _active[key] = [0, lib]
        entry[0] += 1
    try:
        yield
    finally:
        with _lock:
            entry[0] -= 1
            if entry[0] == 0:
                entry[1]._destroy()
                del _active[key]


def is_active(device="cpu") -> bool:
    return dispatch_key(device) in _active


def kernel_mode(enabled: bool, ops):
    """What an engine runs its device stages in: with ``enabled``, ``batch_invariant(ops.device)`` (and
    ``ops.batch_invariant`` set, which switches the backend's attention and MoE to their invariant paths);
    otherwise a null context. Returns a callable that makes a fresh context each time."""
    if not enabled:
        return contextlib.nullcontext
    dispatch_key(ops.device)  # fails now, naming the device, where there are no invariant kernels
    ops.batch_invariant = True
    return lambda: batch_invariant(ops.device)
