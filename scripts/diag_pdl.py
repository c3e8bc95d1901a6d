"""Does programmatic dependent launch (PDL) shorten a chain of small dependent kernels in a CUDA graph on this GPU?

A decode step of the CED bench config is ~350 kernels, most a few microseconds long, each waiting for the last.
This times chains of GEMVs (y = W x, the next kernel reads y) captured in one CUDA graph, three ways:
  plain      launched as usual;
  pdl-wait   launch_pdl=True, each program calls griddepcontrol.wait before any load (mode 1 of triton_pdl);
  pdl        as pdl-wait, .launch_dependents first (the next grid launches once every program started: mode 2);
  pdl-pre    as pdl, but each program loads its first weight tile (never written by the chain) before the wait;
  pdl-late   as pdl-wait, .launch_dependents after the loop, before the store.
Also the host cost of one `kernel[grid](...)` launch. Prints a table and writes JSONL (--out).
"""
from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.bench import append_jsonl


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, PRE: tl.constexpr, EARLY: tl.constexpr, LATE: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_first = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=rn[:, None] < N, other=0.0) if PRE else None
    if EARLY:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        if PRE and k0 == 0:
            w = w_first
        else:
            w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :], mask=rn[:, None] < N, other=0.0)
        x = tl.load(x_ptr + k0 + rk)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if LATE:
        gdc_launch_dependents()
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


def chain(ws, x, bufs, mode, block_n):
    pdl, pre = mode != "plain", mode == "pdl-pre"
    early, late = mode in ("pdl", "pdl-pre"), mode == "pdl-late"
    cur = x
    for i, w in enumerate(ws):
        n, k = w.shape
        y = bufs[i % 2][:n]
        _gemv[(triton.cdiv(n, block_n),)](cur, w, y, n, K=k, BLOCK_N=block_n, BLOCK_K=256, PDL=pdl, PRE=pre,
                                          EARLY=early, LATE=late, num_warps=4, launch_pdl=pdl)
        cur = y
    return cur


def time_graph(fn, iters=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--length", type=int, default=256, help="kernels in the chain")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    # (name, N = K): 256 -> 128 KB of weights a kernel (an epilogue-sized op), 1024 -> 2 MB (wq_a-sized), 2048 -> 8 MB
    # in one wave of programs, 4096 -> 32 MB (wo_b-sized) in several
    for name, d, block_n in (("tiny 256", 256, 16), ("gemv 1024", 1024, 8), ("gemv 2048", 2048, 16),
                             ("gemv 4096", 4096, 8)):
        ws = [torch.randn(d, d, device=dev, dtype=torch.bfloat16) / d ** 0.5 for _ in range(args.length)]
        x = torch.randn(d, device=dev, dtype=torch.bfloat16)
        bufs = [torch.empty(d, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        res = {}
        for mode in ("plain", "pdl-wait", "pdl", "pdl-pre", "pdl-late"):
            us, out = time_graph(lambda: chain(ws, x, bufs, mode, block_n))
            res[mode] = (us, out.float().clone())
        ref = res["plain"][1]
        for mode, (us, out) in res.items():
            err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            row = {"bench": "diag_pdl", "case": name, "mode": mode, "kernels": args.length, "graph_us": round(us, 1),
                   "us_per_kernel": round(us / args.length, 3), "rel_err_vs_plain": err}
            rows.append(row)
            print(f"{name:10s} {mode:8s} {us:9.1f} us  {us / args.length:6.3f} us/kernel  err {err:.1e}")
    # host cost of one launch (the wrapper's binding and specialisation), eager, no graph
    w, x, y = ws[0], x, bufs[0]
    for pdl in (False, True):
        for _ in range(20):
            _gemv[(1,)](x, w, y, 16, K=w.shape[1], BLOCK_N=16, BLOCK_K=256, PDL=pdl, PRE=False, EARLY=pdl,
                  LATE=False, launch_pdl=pdl)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            _gemv[(1,)](x, w, y, 16, K=w.shape[1], BLOCK_N=16, BLOCK_K=256, PDL=pdl, PRE=False, EARLY=pdl,
                  LATE=False, launch_pdl=pdl)
        host_us = (time.perf_counter() - t0) / 2000 * 1e6
        torch.cuda.synchronize()
        rows.append({"bench": "diag_pdl", "case": "host launch", "pdl": pdl, "host_us": round(host_us, 2)})
        print(f"host cost of one launch (pdl={pdl}): {host_us:.2f} us")
    if args.out:
        append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
