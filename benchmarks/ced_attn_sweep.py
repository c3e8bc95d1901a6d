"""CED sparse attention's launch knobs on the GPU (triton_ced_attention.sparse_attention's ``launch`` and
``num_splits``), at the CED bench config's decode (batch 1, 16, 64; 16K of context; benchmarks/tilelang_vs_triton's
ced_case inputs: each query's own ring, 512 FP4 entries drawn from a large cache).

    python benchmarks/ced_attn_sweep.py --out $OUT/ced_attn_sweep.jsonl     # H200, ~2 min

Each setting is checked against the reference op first (relative L2 error under 1e-2, or it cannot win), then
timed as tilelang_vs_triton times (one CUDA graph of calls over rotating input sets). Settings: BLOCK_N x
num_warps x num_stages x splits (the default split count scaled by 1/2, 1, 2, or 1 split: no merge kernel). A
row per (batch, setting); the table prints each batch's default and best, and the last line the setting with
the lowest total over the batches (what launch_config and choose_splits should give).
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
from tilelang_vs_triton import ced_case  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--split-scale", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0], help="0: one split")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="ced_attn_sweep.jsonl")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from deepinfer.backends.nvidia import triton_ced_attention as tca
    from deepinfer.backends.nvidia.host_math import cdiv

    totals, rows = {}, []
    with open(a.out, "w") as f:
        for B in a.batches:
            case = ced_case(B, a.context, 1, 256.0, [])
            first = case["sets"][0]
            want = case["reference"](*first)
            q = first[0][0]
            T, H, D = q.shape
            cfg0 = tca.launch_config(H, D, q.dtype)
            K = first[0][4].shape[1]
            tiles = max(cdiv(first[1]["window"], cfg0["BLOCK_N"]), cdiv(K, cfg0["BLOCK_N"]))
            s0 = tca.choose_splits(T, cdiv(H, cfg0["BLOCK_H"]), tiles, q.device)
            settings = [("default", None, None)]
            for bn, nw, ns, sc in itertools.product(a.block_n, a.warps, a.stages, a.split_scale):
                splits = 1 if sc == 0 else max(1, min(32, round(s0 * sc)))
                settings.append((f"bn{bn} w{nw} s{ns} x{sc:g}", dict(BLOCK_N=bn, num_warps=nw, num_stages=ns), splits))
            for name, launch, splits in settings:
                fn = lambda args, kw, _l=launch, _s=splits: tca.sparse_attention(*args, launch=_l, num_splits=_s, **kw)  # noqa: E731
                row = dict(bench="ced_attn_sweep", batch=B, context=a.context, setting=name, splits=splits or s0,
                           device=torch.cuda.get_device_name())
                try:
                    row.update(errors(fn(*first), want))
                    row["ok"] = row["finite"] and row["rel_l2_err"] < 1e-2
                    us, row["timing"] = time_calls([lambda s=s: fn(*s) for s in case["sets"]], a.reps)
                    row["us"] = round(us * 1e3, 2)
                except Exception as e:  # a setting that does not build (registers, shared memory) loses
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-300:]}")
                f.write(json.dumps(row) + "\n")
                rows.append(row)
                if name != "default":
                    totals[name] = totals.get(name, 0.0) + (row["us"] if row["ok"] else float("inf"))
            del case
            torch.cuda.empty_cache()
            mine = [r for r in rows if r["batch"] == B and r["ok"]]
            d = next((r for r in mine if r["setting"] == "default"), None)
            b = min(mine, key=lambda r: r["us"])
            print(f"B{B:<3} default {d['us'] if d else float('nan'):8.1f} us (splits {s0})   best {b['us']:8.1f} us  "
                  f"{b['setting']} (splits {b['splits']})", flush=True)
        best = min(totals, key=totals.get)
        print(f"lowest total over batches {a.batches}: {best} ({totals[best]:.1f} us)")
        f.write(json.dumps(dict(bench="ced_attn_sweep_best", setting=best, total_us=round(totals[best], 1))) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
