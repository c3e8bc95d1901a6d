"""Counting passes of the top-K threshold searches on the CPU (numpy): how many counts over a row each search
needs, per score distribution, before any GPU time is spent on it.

    python benchmarks/topk_search_sim.py --rows 40 --out rows.jsonl

Ports of triton_ced_indexer's two searches on the same int32 keys (the float scores' order-preserving map):
``bits`` (TOPK_SEARCH 0: one bit a pass from the top, stopping where exactly K keys reach the prefix) and
``interp`` (TOPK_SEARCH 1: one pass for the row's extremes, then Illinois' regula falsi on the counts, bisection
after INTERP_PROBES probes, stopping where exactly K keys reach a probe). Rows: mean and max passes per
distribution and row length; a table prints them. The kernel's time per pass is what the GPU measures
(benchmarks/ced_prefill_kernels.py); this counts only how many.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))

PROBES = 24  # triton_ced_indexer.INTERP_PROBES


def keys_of(s: np.ndarray) -> np.ndarray:
    b = np.where(s == 0, 0.0, s).astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(b < 0, b ^ 0x7FFFFFFF, b)


def value_of(k: int) -> np.float32:
    b = k if k >= 0 else k ^ 0x7FFFFFFF
    return np.array([b], dtype=np.int64).astype(np.int32).view(np.float32)[0]


def bits(keys: np.ndarray, K: int) -> int:
    u, prefix, passes = keys + 2**31, 0, 0
    for b in range(32):
        c = int((u >= (prefix | (1 << (31 - b)))).sum())
        passes += 1
        if c >= K:
            prefix |= 1 << (31 - b)
            if c == K:
                break
    return passes


def interp(keys: np.ndarray, K: int) -> int:
    n = keys.size
    if n <= K:
        return 0
    lo, hi, passes, probes, side = int(keys.min()), int(keys.max()) + 1, 1, 0, 0
    c_lo, c_hi, target = np.float32(n), np.float32(0), np.float32(K + 0.5)
    while hi - lo > 1:
        lv, hv = value_of(lo), value_of(hi - 1)
        with np.errstate(all="ignore"):
            v = np.float32(lv + (c_lo - target) / (c_lo - c_hi) * (hv - lv))
        p = int(keys_of(np.array([v]))[0]) if np.isfinite(v) and probes < PROBES else lo + (hi - lo) // 2
        p = min(max(p, lo + 1), hi - 1)
        probes += 1
        c = int((keys >= p).sum())
        passes += 1
        up = c >= K
        if up and side == 1:
            c_hi = target + (c_hi - target) * np.float32(0.5)
        if not up and side == -1:
            c_lo = target + (c_lo - target) * np.float32(0.5)
        if up:
            lo, c_lo = p, np.float32(c)
        else:
            hi, c_hi = p, np.float32(c)
        side = 1 if up else -1
        if c == K:
            break
    return passes


DISTS = {
    "normal": lambda g, n: g.standard_normal(n),
    "relu-sum": lambda g, n: (np.maximum(g.standard_normal((n, 16)), 0) * g.standard_normal(16)).sum(1),
    "lognormal": lambda g, n: np.exp(g.standard_normal(n) * 3),
    "8 values": lambda g, n: g.integers(0, 8, n).astype(float),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from deepinfer.bench import format_table

    g = np.random.default_rng(0)
    rows = []
    for name, draw in DISTS.items():
        for n in a.lengths:
            counts = {"bits": [], "interp": []}
            for _ in range(a.rows):
                keys = keys_of(draw(g, n))
                counts["bits"].append(bits(keys, a.k))
                counts["interp"].append(interp(keys, a.k))
            rows.append(dict(bench="topk_search_sim", scores=name, length=n, k=a.k,
                             bits_mean=float(np.mean(counts["bits"])), bits_max=max(counts["bits"]),
                             interp_mean=float(np.mean(counts["interp"])), interp_max=max(counts["interp"])))
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(format_table(rows, [("scores", "scores", "{}"), ("length", "length", "{}"),
                              ("bits mean", "bits_mean", "{:.1f}"), ("bits max", "bits_max", "{}"),
                              ("interp mean", "interp_mean", "{:.1f}"), ("interp max", "interp_max", "{}")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
