"""CED's router logits at prefill sizes (triton_router_logits) over its launch knobs, beside the reference's
float32 path, in one run (GPU).

    python benchmarks/router_logits_sweep.py --out $OUT/router_logits_sweep.jsonl     # ~1 min

The 33rd session's 16K bounded prefill ran the kernel at ~83 us a call for 64 MB of x (about a third of the
H100's copy rate): every program re-reads and re-splits the whole float32 gate, and 64-row tiles make ~2 waves.
Rows of --rows x --hidden bf16 against a float32 gate of --experts rows: each launch (block_m x block_k x warps x
stages) checked against a float64 product (relative L2 under 1e-6) and timed from a CUDA graph
(kernels_gpu.time_calls), with ``x.float() @ w.T`` (the reference path: a cast and a float32 GEMM) first.
Writes a JSONL row per variant and prints a table against the first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import errors, time_calls  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--block-m", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="router_logits_sweep.jsonl")
    a = ap.parse_args(argv)
    from deepinfer.backends.nvidia import triton_router_logits as trl
    from deepinfer.bench import format_table

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    rows = []
    for M in a.rows:
        sets = [(torch.randn(M, a.hidden, generator=g).to(dev, torch.bfloat16),
                 (torch.randn(a.experts, a.hidden, generator=g) * a.hidden ** -0.5).to(dev)) for _ in range(3)]
        want = sets[0][0].double() @ sets[0][1].double().T
        variants = [("reference: x.float() @ w.T", lambda x, w: x.float() @ w.T)]
        shipped = dict(block_m=trl.BLOCK_M, block_k=trl.BLOCK_K, num_warps=trl.NUM_WARPS, num_stages=trl.NUM_STAGES)
        variants.append((f"shipped {shipped}", lambda x, w: trl.logits(x, w)))
        for bm, bk, nw, ns in itertools.product(a.block_m, a.block_k, a.warps, a.stages):
            knobs = dict(block_m=bm, block_k=bk, num_warps=nw, num_stages=ns)
            if knobs != shipped:
                variants.append((str(knobs), lambda x, w, _k=knobs: trl.logits(x, w, **_k)))
        first = None
        for name, fn in variants:
            try:
                err = errors(fn(*sets[0]), want)
                ms, how = time_calls([lambda _s=s, _f=fn: _f(*_s) for s in sets], a.reps)
            except Exception as e:  # a launch that does not fit (shared memory): a row that says so
                rows.append(dict(bench="router_logits_sweep", rows=M, variant=name, error=repr(e)[:200]))
                continue
            us = ms * 1e3
            first = first or us
            row = dict(bench="router_logits_sweep", rows=M, hidden=a.hidden, experts=a.experts, variant=name,
                       us=us, vs_first=us / first, timing=how, ok=err["rel_l2_err"] < 1e-6, **err,
                       gbps=M * a.hidden * 2 / us / 1e3, device=torch.cuda.get_device_name() if dev == "cuda" else dev)
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(format_table([r for r in rows if "us" in r],
                       [("rows", "rows", "{}"), ("variant", "variant", "{}"), ("us", "us", "{:.1f}"),
                        ("vs first", "vs_first", "{:.3f}"), ("x GB/s", "gbps", "{:.0f}"), ("ok", "ok", "{}"),
                        ("rel L2", "rel_l2_err", "{:.1e}")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
