"""CED sparse attention's launch knobs on the GPU (triton_ced_attention.sparse_attention's ``launch`` and
``num_splits``), at the CED bench config's decode (batch 1, 16, 64; 16K of context; benchmarks/tilelang_vs_triton's
ced_case inputs: each query's own ring, 512 FP4 entries drawn from a large cache).

    python benchmarks/ced_attn_sweep.py --out $OUT/ced_attn_sweep.jsonl     # H200, ~2 min

Each setting is checked against the reference op first (relative L2 error under 1e-2, or it cannot win), then
timed as tilelang_vs_triton times (one CUDA graph of calls over rotating input sets). Settings: BLOCK_N x
num_warps x num_stages x splits (the default split count scaled by 1/2, 1, 2, or 1 split: no merge kernel) x
prefetch (the entry loop software-pipelined or not; "default pN" is the shipped launch with the other choice than
triton_ced_attention.prefetch_entries makes). A
row per (batch, setting); the table prints each batch's default and best, and the last line the setting with
the lowest total over the batches (what launch_config and choose_splits should give). ``--prefill-chunk N`` adds
one prefill chunk of N queries ending at the context (its best printed apart: a 2048-query chunk at 16K took
2.4 ms a layer on the default launch, most of a 16K prefill).
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
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="also one prefill chunk of this many queries ending at --context (0: decode only)")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--split-scale", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0], help="0: one split")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 1],
                    help="the entry loop software-pipelined (1) or not (0); 'default' runs tca.prefetch_entries' choice")
    ap.add_argument("--raw", type=int, nargs="+", default=[0],
                    help="1: also each setting on the entries decoded once to bf16 (entry_fmt 'bf16'), 0: FP4")
    ap.add_argument("--trans", type=int, nargs="+", default=[0],
                    help="1: the transposed products (launch key trans: keys / latent on the MMA's M side), 0: not")
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[0],
                    help="registers a thread at most (launch key maxnreg; 0: the compiler's choice)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="ced_attn_sweep.jsonl")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from deepinfer.backends.nvidia import triton_ced_attention as tca, triton_fp4 as tfp4
    from deepinfer.backends.nvidia.host_math import cdiv

    totals, rows = {}, []
    with open(a.out, "w") as f:
        cases = [(B, 1) for B in a.batches] + ([(1, a.prefill_chunk)] if a.prefill_chunk else [])
        for B, chunk in cases:
            case = ced_case(B, a.context, chunk, 256.0, [])
            first = case["sets"][0]
            want = case["reference"](*first)
            q = first[0][0]
            T, H, D = q.shape
            cfg0 = tca.launch_config(H, D, q.dtype)
            K = first[0][4].shape[1]
            tiles = max(cdiv(first[1]["window"], cfg0["BLOCK_N"]), cdiv(K, cfg0["BLOCK_N"]))
            s0 = tca.choose_splits(T, cdiv(H, cfg0["BLOCK_H"]), tiles, q.device)  # (the sweep's splits scale this)
            shipped = tca.wide_launch(T, H, D, q.dtype, first[1]["window"], K)  # what "default" runs at wide latents
            s_default = shipped[1] if shipped else s0
            settings = [("default", None, None)]
            if shipped:  # the shipped launch with the other prefetch choice
                other = int(not tca.prefetch_entries({**cfg0, **shipped[0]}))
                settings.append((f"default p{other}", dict(shipped[0], prefetch=other), shipped[1]))
            grid = itertools.product(a.block_n, a.warps, a.stages, a.split_scale, a.prefetch, a.trans, a.maxnreg)
            for bn, nw, ns, sc, pf, tr, nr in grid:
                splits = 1 if sc == 0 else max(1, min(32, round(s0 * sc)))
                name = f"bn{bn} w{nw} s{ns} x{sc:g} p{pf}" + (" t1" if tr else "") + (f" r{nr}" if nr else "")
                settings.append((name, dict(BLOCK_N=bn, num_warps=nw, num_stages=ns, prefetch=pf,
                                            **({"trans": 1} if tr else {}),
                                            **({"maxnreg": nr} if nr else {})), splits))
            ec, es = first[0][3]
            table = tfp4.dequantize(ec, es, first[1]["entry_fmt"], torch.bfloat16).view(torch.uint8)
            settings = [(f"{n} raw" if r else n, lc, sp, r) for n, lc, sp in settings for r in a.raw]
            for name, launch, splits, raw in settings:
                def fn(args, kw, _l=launch, _s=splits, _r=raw):
                    if _r:  # the same entries, decoded (the table's decode is not timed: once per full layer)
                        args, kw = (*args[:3], (table, None), args[4]), dict(kw, entry_fmt="bf16")
                    return tca.sparse_attention(*args, launch=_l, num_splits=_s, **kw)
                row = dict(bench="ced_attn_sweep", batch=B, chunk=chunk, context=a.context, setting=name,
                           splits=splits or s_default, device=torch.cuda.get_device_name())
                try:
                    row.update(errors(fn(*first), want))
                    row["ok"] = row["finite"] and row["rel_l2_err"] < 1e-2
                    us, row["timing"] = time_calls([lambda s=s: fn(*s) for s in case["sets"]], a.reps)
                    row["us"] = round(us * 1e3, 2)
                except Exception as e:  # a setting that does not build (registers, shared memory) loses
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-300:]}")
                f.write(json.dumps(row) + "\n")
                rows.append(row)
                if name != "default" and chunk == 1:  # (the decode total; a prefill chunk is printed apart)
                    totals[name] = totals.get(name, 0.0) + (row["us"] if row["ok"] else float("inf"))
            del case
            torch.cuda.empty_cache()
            mine = [r for r in rows if r["batch"] == B and r["chunk"] == chunk and r["ok"]]
            d = next((r for r in mine if r["setting"] == "default"), None)
            b = min(mine, key=lambda r: r["us"])
            label = f"B{B}" if chunk == 1 else f"chunk{chunk}"
            print(f"{label:<5} default {d['us'] if d else float('nan'):8.1f} us (splits {s_default})   "
                  f"best {b['us']:8.1f} us  {b['setting']} (splits {b['splits']})", flush=True)
        if totals:
            best = min(totals, key=totals.get)
            print(f"lowest total over batches {a.batches}: {best} ({totals[best]:.1f} us)")
            f.write(json.dumps(dict(bench="ced_attn_sweep_best", setting=best, total_us=round(totals[best], 1))) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
