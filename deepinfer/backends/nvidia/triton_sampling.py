"""Sampling filter (temperature, top-k, top-p, min-p) in Triton, without sorting the vocabulary.

Keeps exactly the tokens that ``reference.sampling._filter`` keeps, and returns the same values for them
(``logits / temperature``, -inf elsewhere), so softmax and the exponential race that follow give the same
tokens as the reference. One program per row walks the row a few times:

  A. the row maximum ``m`` of y = logits / temperature (float32, correctly rounded division);
  B. counts and exp-masses (sums of exp(y - m)) of y >= m - c for a few offsets c (0.5 .. 32, and -inf:
     the whole row, whose mass is Z), which give a loose threshold ``theta0`` that provably lies below
     the final cut: count >= k when top-k is on (exact integers), else mass >= (top_p + MARGIN) * Z;
  C. the values y >= theta0, in index order, are compacted into the front of the output row (the
     "candidates"; usually a few hundred tokens, at most V);
  search: over the candidates only, a multi-pivot bisection on the float's order-preserving integer key
     finds the exact k-th largest value (top-k) and then the top-p cut: the largest value t whose mass
     sum(exp(y - m) for y >= t, y >= kth) reaches top_p * Z_k (Z_k: the mass of the top-k set, as the
     reference's softmax after top-k). Each round splits the key range into NP
     bins and also shrinks it to the smallest and largest key actually present, so it ends in at most
     12 rounds (usually a handful);
  D. the output row: y where kept, -inf elsewhere; min-p keeps y >= m + log(min_p), as the reference.

Ties: top-k keeps every token tied with the k-th value (as the reference). Top-p, like the reference's
stable sort, takes tokens tied at the cut in index order: the first n of them, n = the number whose mass
before them, S(y > t) + i * exp(t - m), stays below top_p * Z_k (at least one).

Precision: top-k, min-p and temperature are exact (same float32 operations and comparisons as the
reference). Top-p sums float32 exponentials in another order than the reference's sorted cumsum, so a
token whose cumulative mass lies within ~1e-6 (relative) of top_p may fall the other way; away from that
boundary the kept set is identical. NaN logits are not supported (the reference's sort order for them
differs).

Limits: one program per row, so a single long row is bound by one SM's bandwidth (tens of microseconds at
V = 152k); a flat distribution with top_p near 1 makes most of the row candidates and the search rounds
then read the whole row. No host sync; launch parameters depend on shapes only (CUDA-graph safe).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)
NP = 8  # pivots per search round (3 bits of the 32-bit key per round)
ROUNDS = 12  # ceil(32 / 3) + 1: enough for any float32 key range
NB = 8  # loose thresholds of pass B: m - 0.5 * 2^j (j < NB - 1), and -inf
MARGIN = 1e-4  # extra top-p mass pass B asks for, far above float32 summation error
_INT_MIN = tl.constexpr(-2147483647)  # below every key (key(-inf) = -2139095041)


@triton.jit
def _bound(n, LOOP: tl.constexpr):
    """Loop bound: ``n`` compiled; under the interpreter (no tensor loop bounds there) the host's LOOP."""
    if LOOP > 0:
        return LOOP
    else:
        return n


@triton.jit
def _key(y):
    """int32 key with key(a) < key(b) iff a < b for float32 a, b (+0.0 and -0.0 share key 0)."""
    b = y.to(tl.int32, bitcast=True)
    k = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return tl.where(y == 0.0, 0, k)


@triton.jit
def _unkey(k):
    """float32 value of a key."""
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)


@triton.jit
def _scaled(x_row, offs, V, temp):
    """(y = x / temp as the reference rounds it, in-range mask); -inf past the row's end."""
    mask = offs < V
    y = tl.load(x_row + offs, mask=mask, other=float("-inf"))
    if temp != 1.0:  # x / 1 is x: skip the correctly rounded division (several instructions)
        y = tl.math.div_rn(y, temp)
    return y, mask


@triton.jit
def _round(c_row, n_c, floor, lo, hi, target, m,
           USE_MASS: tl.constexpr, NPIV: tl.constexpr, CHUNK: tl.constexpr, LOOP: tl.constexpr):
    """One search round over the candidates with key >= floor: NPIV pivots spread over [lo, hi]. Returns
    the new (lo, hi): the pivot bin holding the largest key v with G(v) >= target (G = count, or exp-mass,
    of keys >= v), shrunk to the keys actually present in [lo, hi]."""
    j = tl.arange(0, NPIV)
    step = (hi - lo) // NPIV + 1  # int64; pivots lo, lo + step, ... cover [lo, hi]
    piv = tl.minimum(lo + j.to(tl.int64) * step, hi)
    piv32 = piv.to(tl.int32)
    lo32 = lo.to(tl.int32)
    hi32 = hi.to(tl.int32)
    if USE_MASS:
        g = tl.zeros([NPIV], dtype=tl.float32)
    else:
        g = tl.zeros([NPIV], dtype=tl.int32)
    amin = hi32
    amax = lo32
    for c0 in range(0, _bound(n_c, LOOP), CHUNK):
        if c0 < n_c:  # always, compiled; skips the interpreter's extra trips
            offs = c0 + tl.arange(0, CHUNK)
            y = tl.load(c_row + offs, mask=offs < n_c, other=float("-inf"))
            k = _key(y)
            ok = (offs < n_c) & (k >= floor)
            ge = ok[:, None] & (k[:, None] >= piv32[None, :])  # [CHUNK, NPIV]
            if USE_MASS:
                e = tl.exp(y - m)
                g += tl.sum(tl.where(ge, e[:, None], 0.0), axis=0)
            else:
                g += tl.sum(ge.to(tl.int32), axis=0)
            inr = ok & (k >= lo32) & (k <= hi32)
            amin = tl.minimum(amin, tl.min(tl.where(inr, k, hi32), axis=0))
            amax = tl.maximum(amax, tl.max(tl.where(inr, k, lo32), axis=0))
    # cond(lo) is the search's invariant (or no key qualifies and the answer stays lo).
    jstar = tl.max(tl.where((g >= target) | (j == 0), j, 0), axis=0)
    new_lo = tl.sum(tl.where(j == jstar, piv, 0), axis=0)
    new_hi = tl.minimum(new_lo + step - 1, hi)
    return tl.maximum(new_lo, amin.to(tl.int64)), tl.minimum(new_hi, amax.to(tl.int64))


@triton.jit
def _search(c_row, n_c, floor, lo, hi, target, m,
            USE_MASS: tl.constexpr, NPIV: tl.constexpr, N_ROUNDS: tl.constexpr, CHUNK: tl.constexpr,
            LOOP: tl.constexpr):
    """Largest candidate key v in [lo, hi] (keys >= floor only) with G(v) >= target; lo if there is none.
    lo must be a key present among the candidates."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    for _ in range(N_ROUNDS):
        if lo < hi:
            lo, hi = _round(c_row, n_c, floor, lo, hi, target, m, USE_MASS, NPIV, CHUNK, LOOP)
    return lo.to(tl.int32)


@triton.jit
def _stats(c_row, n_c, floor, t, m, CHUNK: tl.constexpr, LOOP: tl.constexpr):
    """Over candidates with key >= floor: (exp-mass of keys >= t, exp-mass of keys > t, count of key == t)."""
    s_ge = tl.zeros([CHUNK], dtype=tl.float32)
    s_gt = tl.zeros([CHUNK], dtype=tl.float32)
    n_eq = tl.zeros([CHUNK], dtype=tl.int32)
    for c0 in range(0, _bound(n_c, LOOP), CHUNK):
        if c0 < n_c:
            offs = c0 + tl.arange(0, CHUNK)
            y = tl.load(c_row + offs, mask=offs < n_c, other=float("-inf"))
            k = _key(y)
            ok = (offs < n_c) & (k >= floor)
            e = tl.exp(y - m)
            s_ge += tl.where(ok & (k >= t), e, 0.0)
            s_gt += tl.where(ok & (k > t), e, 0.0)
            n_eq += (ok & (k == t)).to(tl.int32)
    return tl.sum(s_ge, axis=0), tl.sum(s_gt, axis=0), tl.sum(n_eq, axis=0)


@triton.jit
def _filter_kernel(
    x_ptr, out_ptr, temp_ptr, topk_ptr, topp_ptr, logminp_ptr,
    stride_x, stride_o, V, margin,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, NPIV: tl.constexpr, N_ROUNDS: tl.constexpr,
    NB_B: tl.constexpr, LOOP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    o_row = out_ptr + row * stride_o  # also the candidates' scratch until pass D overwrites it
    temp = tl.load(temp_ptr + row)
    ar = tl.arange(0, BLOCK)

    # A: row maximum (only temperature to apply: skip).
    mx = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    if HAS_TOP_K or HAS_TOP_P or HAS_MIN_P:
        for s in range(0, _bound(V, LOOP), BLOCK):
            y, _ = _scaled(x_row, s + ar, V, temp)
            mx = tl.maximum(mx, y)
    m = tl.max(mx, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # all -inf: exp(y - m_safe) = 0, no NaN

    thr = tl.full([], _INT_MIN, dtype=tl.int32)  # keep keys > thr, and the first n_keep keys == thr
    n_keep = tl.full([], 2147483647, dtype=tl.int32)
    if HAS_TOP_K or HAS_TOP_P:
        k_eff = V
        if HAS_TOP_K:
            kk = tl.load(topk_ptr + row)
            k_eff = tl.where(kk > 0, tl.minimum(kk, V), V).to(tl.int32)
        p = tl.full([], 1.0, dtype=tl.float32)
        if HAS_TOP_P:
            p = tl.load(topp_ptr + row)
        row_k = k_eff < V
        row_p = p < 1.0
        if row_k | row_p:
            # B: counts and masses above m - c_j; the last offset is -inf (everything: V and Z).
            jb = tl.arange(0, NB_B)
            off = tl.where(jb == NB_B - 1, float("inf"), 0.5 * tl.exp2(jb.to(tl.float32)))
            piv = m - off  # [NB_B]
            cnt = tl.zeros([NB_B], dtype=tl.int32)
            mass = tl.zeros([NB_B], dtype=tl.float32)
            for s in range(0, _bound(V, LOOP), BLOCK):
                y, valid = _scaled(x_row, s + ar, V, temp)
                ge = valid[:, None] & (y[:, None] >= piv[None, :])  # [BLOCK, NB_B]
                cnt += tl.sum(ge.to(tl.int32), axis=0)
                mass += tl.sum(tl.where(ge, tl.exp(y - m_safe)[:, None], 0.0), axis=0)
            z_all = tl.sum(tl.where(jb == NB_B - 1, mass, 0.0), axis=0)
            good = tl.where(row_k, cnt >= k_eff, mass >= (p + margin) * z_all) | (jb == NB_B - 1)
            j0 = tl.min(tl.where(good, jb, NB_B - 1), axis=0)
            theta0 = tl.sum(tl.where(jb == j0, piv, 0.0), axis=0)

            # C: compact y >= theta0 (index order) into the front of the output row.
            n_c = tl.zeros([], dtype=tl.int32)
            cmin = tl.full([BLOCK], float("inf"), dtype=tl.float32)
            for s in range(0, _bound(V, LOOP), BLOCK):
                y, valid = _scaled(x_row, s + ar, V, temp)
                keep = valid & (y >= theta0)
                pos = n_c + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                tl.store(o_row + pos, y, mask=keep)
                n_c += tl.sum(keep.to(tl.int32), axis=0)
                cmin = tl.minimum(cmin, tl.where(keep, y, float("inf")))
            lo = _key(tl.min(cmin, axis=0))
            hi = _key(m)
            tl.debug_barrier()  # other threads' candidate stores are visible before the searches read them

            floor = tl.full([], _INT_MIN, dtype=tl.int32)
            z = z_all
            if row_k:
                floor = _search(o_row, n_c, floor, lo, hi, k_eff, m_safe, False, NPIV, N_ROUNDS, CHUNK, LOOP)
                z, _, _ = _stats(o_row, n_c, floor, floor, m_safe, CHUNK, LOOP)
                lo = floor
            thr = floor
            if row_p:
                target = p * z
                t = _search(o_row, n_c, floor, lo, hi, target, m_safe, True, NPIV, N_ROUNDS, CHUNK, LOOP)
                _, s_gt, c_t = _stats(o_row, n_c, floor, t, m_safe, CHUNK, LOOP)
                e_t = tl.exp(_unkey(t) - m_safe)
                # Tied token i (index order) stays while s_gt + i * e_t < target.
                q = tl.where(e_t > 0, tl.ceil((target - s_gt) / e_t), 2147483647.0)
                q = tl.minimum(tl.maximum(q, 1.0), c_t.to(tl.float32))
                thr = t
                n_keep = q.to(tl.int32)

    # D: the output row.
    if HAS_MIN_P:
        min_val = m + tl.load(logminp_ptr + row)
    tie_base = tl.zeros([], dtype=tl.int32)
    for s in range(0, _bound(V, LOOP), BLOCK):
        offs = s + ar
        y, valid = _scaled(x_row, offs, V, temp)
        k = _key(y)
        eq = valid & (k == thr)
        rank = tie_base + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        tie_base += tl.sum(eq.to(tl.int32), axis=0)
        keep = (k > thr) | (eq & (rank < n_keep))
        if HAS_MIN_P:
            keep = keep & (y >= min_val)
        tl.store(o_row + offs, tl.where(keep, y, float("-inf")), mask=valid)


def supports(logits: torch.Tensor) -> bool:
    """Raw logits ``sample`` can take (any float dtype: the penalised logits it filters are float32)."""
    return logits.dim() == 2 and logits.dtype.is_floating_point and 0 < logits.shape[1] < 2**31 - 1


def launch_config(V: int) -> dict:
    """Full-row passes take BLOCK tokens at a time (pass B holds a [BLOCK, NB] tile), candidate rounds
    CHUNK x NP; 8 warps keep a few values per thread."""
    if INTERPRET:
        return {"BLOCK": 32, "CHUNK": 16, "num_warps": 1}
    return {"BLOCK": 1024, "CHUNK": 256, "num_warps": 8}


def _check_row_param(name: str, t: torch.Tensor, S: int, device: torch.device, floating: bool) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != (S,):
        raise ValueError(f"{name} must be a tensor of shape [{S}], got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, logits on {device}")
    if t.dtype.is_floating_point != floating:
        raise ValueError(f"{name} must be a {'float' if floating else 'integer'} tensor, got {t.dtype}")


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, *, use_top_k: bool = True, use_top_p: bool = True,
                  use_min_p: bool = True) -> torch.Tensor:
    """reference.sampling._filter without the sort: logits [S, V] float32 (penalised) -> [S, V] float32,
    logits / temperature where kept and -inf elsewhere. temperature/top_p/min_p [S] float, top_k [S] int
    (0 = off); rows with temperature < 1e-5 (greedy) are filtered at temperature 1. ``use_*`` skip a filter
    for the whole batch, as SamplingBatch's host flags do."""
    from ..reference.sampling import _GREEDY_EPS

    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be a float32 tensor [S, V], got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}")
    S, V = logits.shape
    if V == 0 or V >= 2**31 - 1:
        raise ValueError(f"logits: vocabulary size must be in [1, 2^31 - 1), got {V}")
    for name, t, fl in (("temperature", temperature, True), ("top_k", top_k, False), ("top_p", top_p, True),
                        ("min_p", min_p, True)):
        _check_row_param(name, t, S, logits.device, fl)
    out = torch.empty((S, V), dtype=torch.float32, device=logits.device)
    if S == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temp = temperature.float()
    temp = torch.where(temp < _GREEDY_EPS, torch.ones_like(temp), temp).contiguous()
    top_k = top_k.contiguous()
    top_p = top_p.float().contiguous()
    log_min_p = min_p.float().log().contiguous()  # the reference's own log, so thresholds agree bit for bit
    cfg = launch_config(V)
    _filter_kernel[(S,)](
        logits, out, temp, top_k, top_p, log_min_p,
        logits.stride(0), out.stride(0), V, MARGIN,
        HAS_TOP_K=bool(use_top_k), HAS_TOP_P=bool(use_top_p), HAS_MIN_P=bool(use_min_p),
        BLOCK=cfg["BLOCK"], CHUNK=cfg["CHUNK"], NPIV=NP, N_ROUNDS=ROUNDS, NB_B=NB,
        LOOP=V if INTERPRET else 0, num_warps=cfg["num_warps"],
    )
    return out


def sample(logits: torch.Tensor, batch, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """reference.sampling.sample with filter_logits in place of the sort-based filter: the same penalties,
    the same exponential race and the same generator draws, so seeded rows return the same tokens."""
    from ..reference.sampling import _GREEDY_EPS, _exponential, _penalized

    penalized = _penalized(logits, batch)  # [S, V] float32
    if batch.all_greedy:
        return penalized.argmax(dim=-1)
    filtered = filter_logits(penalized, batch.temperature, batch.top_k, batch.top_p, batch.min_p,
                             use_top_k=batch.use_top_k, use_top_p=batch.use_top_p, use_min_p=batch.use_min_p)
    probs = filtered.softmax(dim=-1)  # [S, V]
    q = _exponential(probs.shape, batch, generator, probs.device)  # [S, V]
    sampled = (probs / q).argmax(dim=-1)  # [S]
    if batch.all_random:
        return sampled
    greedy = batch.temperature < _GREEDY_EPS
    return torch.where(greedy, penalized.argmax(dim=-1), sampled)
