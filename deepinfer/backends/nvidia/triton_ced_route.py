"""CED's MoE router glue in one Triton launch: sqrt-softplus scores, the selection bias, top-k, renormalisation
and the routed scaling (reference.moe.route with scoring="sqrt_softplus", no expert groups).

The torch formulas run as ~9 small kernels per layer and step (cast, softplus, sqrt, add, topk, gather, sum,
add, div, mul); a decode step's router is latency, not work. One program per token holds the token's E
logits in registers:

    scores = sqrt(softplus(logits))            (float32; softplus(x) = x above 20, as torch's threshold)
    ids    = the k largest of scores + bias    (descending, ties to the lower expert id)
    w      = scores[ids] / (sum + 1e-20) * scaling   (renormalize=True), or scores[ids] * scaling

Precision: softplus is log1p(exp(x)) through Kahan's log1p (exp and log from the device's math library), so
scores may differ from the reference's in the last float32 bits; where two experts' selection scores are that close, the chosen set may
differ. Capture-safe: nothing is read back to the host.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from deepinfer.backends.nvidia.host_math import next_pow2
from . import triton_tickets
from .triton_pdl import launch_kw, pdl_start

INTERPRET = bool(triton.knobs.runtime.interpret)
_INTERP = tl.constexpr(INTERPRET)
MAX_EXPERTS = 1024
MAX_TOPK = 32
# Tokens a program where route() gets at least ROWS_FROM of them (0: one a program): one token a program left a 16K
# prefill's router latency-bound, 51 us a call for 2 MB of logits on the H100 (34th session: 16K programs of one
# warp, each a chain of K max-reductions). On since the 35th session (s35a, H100, 16K bounded prefill, two runs
# each alternating): _route_kernel 0.52 ms over 16 calls against 0.80-0.81 one token a program.
ROWS = 16
ROWS_FROM = 2048


@triton.jit
def _route_kernel(logits_ptr, gate_ptr, bias_ptr, w_ptr, ids_ptr, stride_l, stride_g, stride_w, stride_i, E, DIN,
                  scaling, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RENORM: tl.constexpr, FROM_HIDDEN: tl.constexpr, BLOCK_D: tl.constexpr, DIN_I: tl.constexpr,
                  T=1, ROWS: tl.constexpr = 1, PDL: tl.constexpr = 0):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    if ROWS > 1:  # ROWS tokens a program (route_rows is row by row: the same bits as one a program)
        r = t * ROWS + tl.arange(0, ROWS)[:, None]
        m = r < T
        x = tl.load(logits_ptr + r * stride_l + e[None, :], mask=m & ok[None, :], other=0.0).to(tl.float32)
        w, ids = route_rows(x, bias_ptr, E, scaling, K, BLOCK_E, BLOCK_K, HAS_BIAS, RENORM)
        kk = tl.arange(0, BLOCK_K)[None, :]
        tl.store(w_ptr + r * stride_w + kk, w, mask=m & (kk < K))
        tl.store(ids_ptr + r * stride_i + kk, ids.to(tl.int64), mask=m & (kk < K))
    else:
        if FROM_HIDDEN:  # logits = x.float() @ gate.T, x [T, DIN] the hidden rows, gate [E, DIN] float32
            acc = tl.zeros([BLOCK_E], dtype=tl.float32)
            for d0 in range(0, DIN_I if _INTERP else DIN, BLOCK_D):  # (the interpreter takes constexpr bounds)
                d = d0 + tl.arange(0, BLOCK_D)
                xd = tl.load(logits_ptr + t * stride_l + d, mask=d < DIN, other=0.0).to(tl.float32)
                g = tl.load(gate_ptr + e[:, None] * stride_g + d[None, :], mask=ok[:, None] & (d < DIN)[None, :],
                            other=0.0).to(tl.float32)
                acc += tl.sum(g * xd[None, :], axis=1)
            x = acc
        else:
            x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=0.0).to(tl.float32)
        w, ids = route_rows(x[None, :], bias_ptr, E, scaling, K, BLOCK_E, BLOCK_K, HAS_BIAS, RENORM)
        kk = tl.arange(0, BLOCK_K)[None, :]
        tl.store(w_ptr + t * stride_w + kk, w, mask=kk < K)
        tl.store(ids_ptr + t * stride_i + kk, ids.to(tl.int64), mask=kk < K)


@triton.jit
def route_rows(x, bias_ptr, E, scaling, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
               HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    """Logits x [R, BLOCK_E] float32 (columns from E on ignored) -> (weights [R, BLOCK_K] float32, ids [R,
    BLOCK_K] int32), the module doc's formulas row by row. The renormalising sum adds the weights in pick order,
    so a row's result does not depend on R or on the launch's layout."""
    e = tl.arange(0, BLOCK_E)[None, :]
    ok = e < E
    u = tl.exp(tl.minimum(x, 20.0))
    v = 1.0 + u
    # log1p(u) to a few ulp (Kahan's trick): log(v) * u / (v - 1) cancels the rounding of 1 + u
    lp = tl.where(v == 1.0, u, tl.log(v) * (u / tl.where(v == 1.0, 1.0, v - 1.0)))
    sp = tl.where(x > 20.0, x, lp)
    score = tl.sqrt(sp)
    choice = score
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    kk = tl.arange(0, BLOCK_K)[None, :]
    ids = tl.zeros([x.shape[0], BLOCK_K], dtype=tl.int32)
    w = tl.zeros([x.shape[0], BLOCK_K], dtype=tl.float32)
    total = tl.zeros([x.shape[0]], dtype=tl.float32)
    taken = tl.zeros([x.shape[0], BLOCK_E], dtype=tl.int1)
    for i in tl.static_range(K):
        c = tl.where(taken, float("-inf"), choice)
        best = tl.max(c, axis=1)
        # the lowest id among the maxima (a NaN-free row has one; -inf rows pick the lowest id not yet taken)
        pick = tl.min(tl.where((c == best[:, None]) & ~taken & ok, e, BLOCK_E), axis=1)
        taken = taken | (e == pick[:, None])
        ids = tl.where(kk == i, pick[:, None], ids)
        wi = tl.sum(tl.where(e == pick[:, None], score, 0.0), axis=1)  # (one term: exact)
        w = tl.where(kk == i, wi[:, None], w)
        total += wi
    if RENORM:
        w = w / (total[:, None] + 1e-20)
    return w * scaling, ids


@triton.jit
def route_tail(count_ptr, programs, logits_ptr, stride_l, M, E, w_ptr, ids_ptr, bias_ptr, scaling,
               K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
               HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    """The router on a logits product's last program (``Tail``): each of the product's ``programs`` calls this
    after storing its logits and takes a ticket; the one that takes the last reads every row's logits back [M, E]
    (float32, past L1) and stores the weights and ids [M, K] (contiguous), then resets the counter for the next
    call (a CUDA graph's replay included)."""
    tl.debug_barrier()  # every thread's logits are stored before the ticket (release) below
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if ticket == programs - 1:
        rows = tl.arange(0, BLOCK_M)[:, None]
        e = tl.arange(0, BLOCK_E)[None, :]
        x = tl.load(logits_ptr + rows * stride_l + e, mask=(rows < M) & (e < E), other=0.0, cache_modifier=".cg")
        w, ids = route_rows(x, bias_ptr, E, scaling, K, BLOCK_E, BLOCK_K, HAS_BIAS, RENORM)
        kk = tl.arange(0, BLOCK_K)[None, :]
        at = rows * K + kk
        tl.store(w_ptr + at, w, mask=(rows < M) & (kk < K))
        tl.store(ids_ptr + at, ids.to(tl.int64), mask=(rows < M) & (kk < K))
        tl.atomic_xchg(count_ptr, 0)


def supports(logits: torch.Tensor, top_k: int, scoring: str, n_group, bias: Optional[torch.Tensor]) -> bool:
    """Whether route() runs these inputs (otherwise the reference op)."""
    if scoring != "sqrt_softplus" or n_group is not None or logits.dim() != 2:
        return False
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16) or (logits.stride(1) != 1 and logits.shape[1] > 1):
        return False
    return _choice_ok(logits.shape[1], top_k, bias)


def _choice_ok(E: int, top_k, bias) -> bool:
    if not 1 <= E <= MAX_EXPERTS or isinstance(top_k, bool) or not isinstance(top_k, int) \
            or not 1 <= top_k <= min(E, MAX_TOPK):
        return False
    return bias is None or (bias.shape == (E,) and bias.is_contiguous() and bias.is_floating_point())


def route(logits: torch.Tensor, top_k: int, *, renormalize: bool = True, scaling: float = 1.0,
          bias: Optional[torch.Tensor] = None, rows: Optional[int] = None):
    """logits [T, E] -> (weights [T, top_k] float32, ids [T, top_k] int64), ids by descending selection score.
    ``rows``: tokens a program (a power of two; default per ROWS / ROWS_FROM), the same bits at any."""
    if not supports(logits, top_k, "sqrt_softplus", None, bias):
        raise ValueError(f"route: unsupported inputs: logits {logits.dtype} {tuple(logits.shape)} stride "
                         f"{logits.stride()}, top_k {top_k!r}, bias "
                         f"{None if bias is None else (bias.dtype, tuple(bias.shape))}")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 or rows & (rows - 1)
                             or rows * next_pow2(logits.shape[1]) > 8192):
        raise ValueError(f"route: rows must be a power of two with rows x experts (padded) <= 8192, got {rows!r}")
    return _launch(logits, None, top_k, renormalize, scaling, bias, rows)


def rows_per_program(T: int, E: int) -> int:
    """route()'s default tokens a program: ROWS (fewer for wide expert counts, at most 1024 logits a program) from
    ROWS_FROM tokens on, else one."""
    if not ROWS_FROM or T < ROWS_FROM:
        return 1
    return max(1, min(ROWS, 1024 // next_pow2(E)))


def _launch(rows, gate, top_k, renormalize, scaling, bias, per: Optional[int] = None):
    T, E = rows.shape[0], (gate if gate is not None else rows).shape[0 if gate is not None else 1]
    w = torch.empty(T, top_k, dtype=torch.float32, device=rows.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=rows.device)
    per = 1 if gate is not None else (rows_per_program(T, E) if per is None else per)
    BE = next_pow2(E)
    if T and per > 1:
        _route_kernel[(triton.cdiv(T, per),)](
            rows, rows, bias if bias is not None else rows, w, ids, rows.stride(0), 0, w.stride(0), ids.stride(0),
            E, rows.shape[1], float(scaling), K=top_k, BLOCK_E=BE, BLOCK_K=next_pow2(top_k),
            HAS_BIAS=bias is not None, RENORM=bool(renormalize), FROM_HIDDEN=False, BLOCK_D=16, DIN_I=0, ROWS=per,
            T=T, num_warps=1 if INTERPRET else max(1, min(4, per * BE // 128)), **launch_kw(rows.device))
    elif T:
        bd = max(16, min(next_pow2(rows.shape[1]), (1024 if INTERPRET else 8192) // BE))
        _route_kernel[(T,)](rows, gate if gate is not None else rows, bias if bias is not None else rows, w, ids,
                            rows.stride(0), gate.stride(0) if gate is not None else 0, w.stride(0), ids.stride(0),
                            E, rows.shape[1], float(scaling), K=top_k, BLOCK_E=BE,
                            BLOCK_K=next_pow2(top_k), HAS_BIAS=bias is not None,
                            RENORM=bool(renormalize), FROM_HIDDEN=gate is not None, BLOCK_D=bd,
                            DIN_I=rows.shape[1] if INTERPRET else 0,
                            num_warps=1 if INTERPRET or (E <= 256 and gate is None) else 4,
                            **launch_kw(rows.device))
    return w, ids


MAX_TAIL_LOGITS = 8192  # rows x experts (powers of two) the last program of a product holds for Tail


def supports_tail(M: int, E: int, top_k: int, bias: Optional[torch.Tensor], block_m: int) -> bool:
    """Whether a product of M rows (padded to block_m) and E logits may carry the router (``Tail``)."""
    return 0 < M <= block_m and block_m * next_pow2(E) <= MAX_TAIL_LOGITS and _choice_ok(E, top_k, bias)


class Tail:
    """The router on a logits product's launch (triton_gemv and triton_splitk take it as ``route=``): the product
    stores the float32 logits [M, E] as usual, then its last program (a ticket counter picks it: route_tail) routes
    every row as route() does and fills ``w`` [M, top_k] float32 and ``ids`` [M, top_k] int64. One launch where the
    product and the router kernel took two. The counter: triton_tickets."""

    def __init__(self, M: int, E: int, top_k: int, *, device: torch.device, bias: Optional[torch.Tensor] = None,
                 scaling: float = 1.0, renormalize: bool = True):
        if not _choice_ok(E, top_k, bias):
            raise ValueError(f"Tail: unsupported router: {E} experts, top_k {top_k!r}, bias "
                             f"{None if bias is None else (bias.dtype, tuple(bias.shape))}")
        self.w = torch.empty(M, top_k, dtype=torch.float32, device=device)
        self.ids = torch.empty(M, top_k, dtype=torch.int64, device=device)
        count = triton_tickets.counter("route", device)
        self.E, self.top_k = E, top_k
        self.kernel_kw = dict(tail_count=count, tail_w=self.w, tail_ids=self.ids,
                              tail_bias=bias if bias is not None else self.w, tail_scale=float(scaling), ROUTE=True,
                              TOPK=top_k, BLOCK_E=next_pow2(E), BLOCK_TK=next_pow2(top_k),
                              HAS_BIAS=bias is not None, RENORM=bool(renormalize))


MAX_HIDDEN_ROWS = 256  # past this many tokens the gate GEMM goes to cuBLAS (each program reads the whole gate)


def supports_hidden(x: torch.Tensor, gate: torch.Tensor, top_k: int, bias: Optional[torch.Tensor]) -> bool:
    """Whether route_from_hidden runs these inputs: few rows (decode), a float32 gate [E, d] over x [T, d]."""
    return x.dim() == 2 and gate.dim() == 2 and x.shape[0] <= MAX_HIDDEN_ROWS and gate.dtype == torch.float32 \
        and x.shape[1] == gate.shape[1] and x.stride(1) == 1 and gate.stride(1) == 1 \
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _choice_ok(gate.shape[0], top_k, bias)


def route_from_hidden(x: torch.Tensor, gate: torch.Tensor, top_k: int, *, renormalize: bool = True,
                      scaling: float = 1.0, bias: Optional[torch.Tensor] = None):
    """route() of the logits x.float() @ gate.T, computed in the same launch (x [T, d], gate [E, d] float32):
    a decode step's router GEMV, cast and glue in one kernel. The logits' float32 sums run in another order
    than cuBLAS's, so they may differ in the last bits."""
    if not supports_hidden(x, gate, top_k, bias):
        raise ValueError(f"route_from_hidden: unsupported inputs: x {x.dtype} {tuple(x.shape)}, gate {gate.dtype} "
                         f"{tuple(gate.shape)}, top_k {top_k!r} (at most {MAX_HIDDEN_ROWS} rows)")
    return _launch(x, gate, top_k, renormalize, scaling, bias)
