"""CED sparse attention on the GPU: the compiled Triton kernel against the reference op around the bench config.

Run from the repository root on a CUDA machine:  python scripts/diag_ced_attention.py [--budget-s 45] [--serial]

Prints
- a probe of the Triton 3.6 MMA bug the kernel works around (triton-lang/triton#11691): a [16, K] x [K, 64] bf16
  dot whose right operand is decoded from uint8 nibbles, plain and through triton_fp4.mma_operand,
  with the kWidth Triton chose; plain with K < 8 * kWidth is expected to FAIL on an unpatched Triton;
- one line per case: dtype, D, heads, entry mode (none: no global branch; zero: 512 slots all -1; few: 16 slots,
  some -1; rand: 512 slots, a random number valid; full: 512 valid), splits, rel_err, PASS/FAIL (or ERROR with
  the exception, or SKIP past the time budget). Every case has 6 decode rows, a 20-token chunk reading the ring
  and a row near position 0; ring slots and cache rows no query may read are NaN-poisoned;
- the kernel time at the bench shape (48 decode rows, 16 heads x 512, window 128, top-512, bf16).
Case groups run in parallel processes (compilation dominates), so the whole run takes well under a minute.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepinfer.backends.nvidia import triton_ced_attention as tca  # noqa: E402
from deepinfer.backends.nvidia.triton_attention import _dot  # noqa: E402
from deepinfer.backends.nvidia.triton_fp4 import mma_operand  # noqa: E402
from deepinfer.backends.reference import lowbit  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402

DEVICE = os.environ.get("DIAG_DEVICE", "cuda")  # "cpu" with TRITON_INTERPRET=1: a (slow) dry run of this script
W, ALLOWANCE, BENCH_K = 128, 12, 512  # the bench config's window, ring allowance and top-K
MODES = ("none", "zero", "few", "rand", "full")
NAN_SCALE = {"fp4_e2m1_e4m3": 0x7F, "mxfp4": 0xFF}


def build(g, seqs, H, D, mode, fmt, dtype, dev):
    """seqs = [(fresh_lo, n_queries, cut)]: queries fresh_lo .. + n - 1 are this pass's fresh rows, the ring holds
    the positions before. Returns (args, kwargs) of sparse_attention / the reference op."""
    RING = W + ALLOWANCE
    T = sum(n for _, n, _ in seqs)
    S = len(seqs) + 1
    slot_of = torch.randperm(S, generator=g)[:len(seqs)]
    rc = torch.full((S, RING, D), 0x7F, dtype=torch.uint8)
    rs = torch.full((S, RING, D // 32), 0xFF, dtype=torch.uint8)
    pos, cut, flo, fst, rsl = [], [], [], [], []
    start = 0
    for r, (lo, n, c) in enumerate(seqs):
        old = torch.arange(lo - RING, lo)
        keep = old >= max(c, 0)
        if keep.any():
            codes, scales = lowbit.quantize(torch.randn(int(keep.sum()), D, generator=g), "fp8_e4m3_pow2")
            rc[slot_of[r], old[keep] % RING] = codes
            rs[slot_of[r], old[keep] % RING] = scales
        pos += range(lo, lo + n)
        cut += [c] * n
        flo += [lo] * n
        fst += [start] * n
        rsl += [int(slot_of[r])] * n
        start += n
    K = {"none": 0, "few": 16}.get(mode, BENCH_K)
    entries = None
    sel = torch.full((T, K), -1, dtype=torch.long)
    if mode != "none":
        N = 2 * K + 8
        ents = torch.randn(N, D, generator=g) * torch.pow(2.0, torch.randint(-3, 4, (N, 1), generator=g).float())
        ec, es = lowbit.quantize(ents, fmt)
        for t in range(T):
            k = int(torch.randint(1 if mode == "few" else 0, K + 1, (1,), generator=g))
            k = {"zero": 0, "full": K}.get(mode, k)
            sel[t, torch.randperm(K, generator=g)[:k]] = torch.randperm(N - 1, generator=g)[:k] + 1
        unused = torch.ones(N, dtype=torch.bool)
        unused[sel[sel >= 0]] = False
        es[unused] = NAN_SCALE[fmt]
        entries = (ec.to(dev), es.to(dev))
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(T, D, generator=g).to(dtype)
    lt = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
    args = (q.to(dev), kv.to(dev), (rc.to(dev), rs.to(dev)), entries, sel.to(dev))
    kw = dict(pos=lt(pos), cut=lt(cut), fresh_lo=lt(flo), fresh_start=lt(fst), ring_slot=lt(rsl), window=W,
              ring_fmt="fp8_e4m3_pow2", entry_fmt=fmt, sinks=torch.randn(H, generator=g).to(dev), scale=D ** -0.5)
    return args, kw


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def rel_err(out, ref) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if not bool(out.isfinite().all()):
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def run_group(spec):
    """One (dtype, D, fmt) group: every heads x entry mode x splits case. Returns printable lines."""
    dtype_name, D, fmt, heads, budget_end = spec
    lines = []
    try:
        dev = torch.device(DEVICE)
        dtype = getattr(torch, dtype_name)
        tol = 1e-2 if dtype != torch.float32 else 1e-5
        ref_ops = ReferenceOps(dev)
        g = torch.Generator().manual_seed(D * 7 + len(fmt))
        seqs = [(int(p), 1, 0) for p in torch.randint(W, 3000, (6,), generator=g)] + [(700, 20, 650), (3, 1, 0)]
        for H in heads:
            for mode in MODES:
                name = f"{dtype_name:8s} D={D:3d} H={H:2d} {fmt:13s} entries={mode:4s}"
                if time.time() > budget_end:
                    lines.append(f"{name} SKIP (time budget)")
                    continue
                try:
                    args, kw = build(g, seqs, H, D, mode, fmt, dtype, dev)
                    want = ref_ops.ced_sparse_attention(*args, **kw)
                except Exception as e:  # noqa: BLE001
                    lines.append(f"{name} ERROR building the case / reference: {type(e).__name__}: {e}")
                    continue
                for splits in (None, 1, 7):
                    try:
                        out = tca.sparse_attention(*args, num_splits=splits, **kw)
                        sync(dev)
                        err = rel_err(out, want)
                        ok = err < tol
                        extra = "" if ok else (f"  out[0,0,:4]={out[0, 0, :4].float().tolist()} "
                                               f"want={want[0, 0, :4].float().tolist()}")
                        lines.append(f"{name} splits={str(splits):4s} rel_err={err:.3e} "
                                     f"{'PASS' if ok else 'FAIL'}{extra}")
                    except Exception as e:  # noqa: BLE001
                        lines.append(f"{name} splits={str(splits):4s} ERROR {type(e).__name__}: {str(e)[:300]}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"group {dtype_name} D={D} {fmt}: ERROR {type(e).__name__}: {str(e)[:300]}")
    return lines


@triton.jit
def _probe_kernel(a_ptr, c_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr, OPAQUE: tl.constexpr):
    m = tl.arange(0, 16)
    k = tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    c = tl.load(c_ptr + k[:, None] * (N // 2) + tl.arange(0, N // 2)[None, :]).to(tl.int32)
    b = tl.interleave((c & 15).to(tl.float32), (c >> 4).to(tl.float32))  # [K, N], as fp4_tile builds its tiles
    if OPAQUE:
        b16 = mma_operand(b, tl.bfloat16)
    else:
        b16 = b.to(tl.bfloat16)
    tl.store(out_ptr + m[:, None] * N + tl.arange(0, N)[None, :], _dot(a, b16, "tf32"))


def run_probe(_=None):
    """The Triton MMA kWidth bug in isolation: B [K, 64] decoded from uint8 nibbles, plain and behind mma_operand."""
    lines = []
    try:
        dev = torch.device(DEVICE)
        g = torch.Generator().manual_seed(0)
        N = 64
        for K in (16, 32, 64):
            a = torch.randn(16, K, generator=g).to(torch.bfloat16).to(dev)
            c = torch.randint(0, 256, (K, N // 2), generator=g, dtype=torch.int32).to(torch.uint8).to(dev)
            ci = c.long().cpu()
            want = a.double().cpu() @ torch.stack([ci & 15, ci >> 4], dim=-1).reshape(K, N).double()
            for opaque in (False, True):
                out = torch.empty(16, N, dtype=torch.float32, device=dev)
                k = _probe_kernel[(1,)](a, c, out, K=K, N=N, OPAQUE=opaque, num_warps=4)
                sync(dev)
                kw = sorted(set(re.findall(r"kWidth = (\d+)", getattr(k, "asm", {}).get("ttgir", ""))))
                err = rel_err(out, want)
                lines.append(f"probe dot [16,{K}]x[{K},{N}] B from uint8 nibbles, "
                             f"{'mma_operand' if opaque else 'plain':12s} kWidth={','.join(kw) or '?'} "
                             f"rel_err={err:.3e} {'PASS' if err < 1e-2 else 'FAIL'}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"probe ERROR {type(e).__name__}: {str(e)[:300]}")
    return lines


def bench_timing():
    dev = torch.device(DEVICE)
    g = torch.Generator().manual_seed(1)
    lines = []
    for label, seqs in (("48 decode rows", [(int(p), 1, 0) for p in torch.randint(W, 6000, (48,), generator=g)]),
                        ("300-token chunk", [(700, 300, 572)])):
        args, kw = build(g, seqs, 16, 512, "rand", "fp4_e2m1_e4m3", torch.bfloat16, dev)
        want = ReferenceOps(dev).ced_sparse_attention(*args, **kw)
        T = args[0].shape[0]
        S = tca.choose_splits(T, 1, max(triton.cdiv(W, 16), triton.cdiv(BENCH_K, 16)), dev)
        for splits in (None, 1):
            fn = lambda: tca.sparse_attention(*args, num_splits=splits, **kw)  # noqa: E731
            err = rel_err(fn(), want)
            ms = triton.testing.do_bench(fn, warmup=20, rep=100)
            ref_ms = triton.testing.do_bench(lambda: ReferenceOps(dev).ced_sparse_attention(*args, **kw), warmup=3,
                                             rep=20) if splits is None else float("nan")
            lines.append(f"timing bench {label}: splits={splits if splits is not None else f'auto({S})'} "
                         f"{ms * 1e3:.1f} us (reference op {ref_ms * 1e3:.0f} us) rel_err={err:.2e}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=45.0, help="stop starting new cases after this many seconds")
    ap.add_argument("--serial", action="store_true", help="run every group in this process")
    ap.add_argument("--workers", type=int, default=8)
    a = ap.parse_args()
    t0 = time.time()
    end = t0 + a.budget_s
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)"
    print(f"torch {torch.__version__} triton {triton.__version__} {name}", flush=True)
    groups = [("bfloat16", D, "fp4_e2m1_e4m3", (1, 4, 16), end) for D in (512, 64, 128, 256)]
    groups += [("bfloat16", 512, "mxfp4", (1, 16), end), ("float32", 64, "mxfp4", (1, 16), end),
               ("float32", 512, "fp4_e2m1_e4m3", (16,), end)]
    results = []
    if a.serial:
        for line in run_probe():
            print(line, flush=True)
        for spec in groups:
            for line in run_group(spec):
                results.append(line)
                print(line, flush=True)
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=a.workers, mp_context=mp.get_context("spawn")) as pool:
            futs = {pool.submit(run_probe): "probe"}
            futs.update({pool.submit(run_group, spec): f"{spec[0]} D={spec[1]} {spec[2]}" for spec in groups})
            for f in as_completed(futs):
                try:
                    lines = f.result()
                except Exception as e:  # noqa: BLE001  (a worker that died: e.g. a CUDA fault)
                    lines = [f"group {futs[f]}: worker ERROR {type(e).__name__}: {str(e)[:300]}"]
                for line in lines:
                    if not line.startswith("probe"):
                        results.append(line)
                    print(line, flush=True)
    try:
        for line in bench_timing():
            print(line, flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"timing ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    bad = [r for r in results if " PASS" not in r]
    print(f"SUMMARY {len(results) - len(bad)}/{len(results)} cases PASS, {len(bad)} not "
          f"({sum(' FAIL' in r for r in bad)} FAIL, {sum(' ERROR' in r for r in bad)} ERROR, "
          f"{sum(' SKIP' in r for r in bad)} SKIP) in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
