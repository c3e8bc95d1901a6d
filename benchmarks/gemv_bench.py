"""A decode step's projections on the GPU: cuBLAS (F.linear, the grouped einsum) against triton_gemv's kernel and
its launch knobs (and its tensor-core variant), at the CED bench config's shapes and 1-16 rows, bf16.

    python benchmarks/gemv_bench.py --out $OUT/gemv.jsonl      # H200, ~2 min

Every output is checked first against a float64 product (relative L2 error; a variant over 1e-2 cannot win).
Timing: benchmarks/kernels_gpu.time_calls (one CUDA graph of calls replayed, median per call), rotating over
enough weight copies (``--rotate-mb``) that no call finds its weight in the 50 MB L2, as a decode step's
layers do not. A row per (shape, rows, implementation); then, per row count, the step's total over the shapes
(each weighted by its calls per step) for cuBLAS and for each knob setting. The last lines print the knobs
whose total is lowest at one row (triton_gemv's TILE, PROGRAMS_PER_SM, NUM_WARPS) and GEMV_MAX_ROWS for
backends/nvidia/ops.py: the largest row count up to which the shipped knobs' total beats cuBLAS's at every count
(likewise CED_ROUTE_LOGITS_GEMV_MAX_ROWS from the router's row), and GEMV_DOT_MAX_ROWS: past that, the largest
row count up to which the tensor-core variant ("dot" rows, up to 64 rows) beats cuBLAS at every count; then
SPLITK_MAX_ROWS: past those, the largest row count up to which triton_splitk's kernel ("splitk" rows, its knobs
swept by ``--splitk-knobs``; up to 64 rows) beats cuBLAS at every count, and the knobs with the lowest total
summed over the row counts it would serve.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import time_calls  # noqa: E402

# (name, groups, N, K, calls per decode step) of the CED bench config (models/ced/config.py SIZES["bench"]:
# d 2048, 16 heads x 512, q_lora 1024, 8 output groups of 1024, 16 layers, 3 full + 1 reindex, vocab 4096).
SHAPES = [("wq_a", 1, 1024, 2048, 16), ("wq_b", 1, 8192, 1024, 16), ("wkv", 1, 512, 2048, 16),
          ("wo_a", 8, 1024, 1024, 16), ("wo_b", 1, 2048, 8192, 16), ("shared_w13", 1, 1024, 2048, 16),
          ("shared_w2", 1, 2048, 512, 16), ("wiq", 1, 2048, 1024, 4), ("lm_head", 1, 4096, 2048, 1)]
# The router's logits: bf16 rows against the float32 gate [32 experts, 2048] into float32 (cuBLAS: x.float() and a
# float32 GEMV; the kernel: one launch). Timed and totalled apart (CED_ROUTE_LOGITS_GEMV_MAX_ROWS).
ROUTER = ("router", 1, 32, 2048, 16)


def rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--splitk-knobs", nargs="*", default=["4,128,64,16,3", "2,128,64,16,3", "8,128,64,16,3",
                                                          "4,64,64,16,4", "4,128,128,16,3", "4,128,64,8,3",
                                                          "4,256,64,16,2", "4,128,32,16,3"],
                    help="triton_splitk launches: per_sm,block_k,block_n,max_splits,num_stages[,swap] (swap 1: the "
                         "weight tile as the MMA's M side; not for the router's float32 weight)")
    ap.add_argument("--tiles", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--per-sm", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rotate-mb", type=float, default=256.0)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="gemv.jsonl")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: shapes / 32, checks the script")
    a = ap.parse_args(argv)
    shapes = SHAPES + [ROUTER]
    if a.smoke:
        shapes = [(n, G, max(1, N // 32), max(1, K // 32), c) for n, G, N, K, c in shapes]
        a.rows, a.tiles, a.per_sm, a.warps, a.reps, a.rotate_mb = [1, 2, 16, 64], [256], [4], [4], 2, 0.01
        a.splitk_knobs = a.splitk_knobs[:2]
    elif not torch.cuda.is_available():
        print("needs CUDA (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from deepinfer.backends.nvidia import triton_gemv as tg, triton_splitk as tsk

    dev, g = torch.device("cpu" if a.smoke else "cuda"), torch.Generator().manual_seed(0)
    knobs = list(itertools.product(a.tiles, a.per_sm, a.warps))
    shipped = (tg.TILE, tg.PROGRAMS_PER_SM, tg.NUM_WARPS)  # what the backend runs: the limits are judged on it
    if not a.smoke and shipped not in knobs:
        knobs.append(shipped)
    shipped_name = "gemv t%d p%d w%d" % (shipped if not a.smoke else knobs[0])
    totals = {}  # (rows, impl, router) -> us per step
    with open(a.out, "w") as f:
        for name, G, N, K, per_step in shapes:
            router = name == "router"
            wdtype = torch.float32 if router else torch.bfloat16
            nbytes = G * N * K * (4 if router else 2)
            copies = max(2, min(64, int(a.rotate_mb * 2**20 // nbytes) + 1))
            ws = [(torch.randn(G, N, K, generator=g) * K ** -0.5).to(dev, wdtype) for _ in range(copies)]
            for M in a.rows:
                xs = [torch.randn(M, G, K, generator=g).to(dev, torch.bfloat16) for _ in range(copies)]
                ref = torch.einsum("mgk,gnk->mgn", xs[0].double(), ws[0].double())
                if router:
                    cublas = lambda x, w: torch.nn.functional.linear(x[:, 0].float(), w[0])  # noqa: E731
                elif G == 1:
                    cublas = lambda x, w: torch.nn.functional.linear(x[:, 0], w[0])  # noqa: E731
                else:
                    cublas = lambda x, w: torch.einsum("tgi,goi->tgo", x, w)  # noqa: E731
                impls = {"cublas": cublas}
                out_dtype = torch.float32 if router else None
                for tile, per_sm, nw in knobs if M <= tg.MAX_ROWS else ():
                    impls[f"gemv t{tile} p{per_sm} w{nw}"] = (
                        lambda x, w, _k=dict(tile=tile, per_sm=per_sm, num_warps=nw, out_dtype=out_dtype):
                        tg.grouped_gemv(x, w, **_k))
                for tile, per_sm in dict.fromkeys((t, p) for t, p, _ in knobs) if M <= tg.DOT_ROWS else ():
                    impls[f"dot t{tile} p{per_sm}"] = (  # the tensor-core variant (GEMV_DOT_MAX_ROWS)
                        lambda x, w, _k=dict(tile=tile, per_sm=per_sm, out_dtype=out_dtype, dot=True):
                        tg.grouped_gemv(x, w, **_k))
                for knob in a.splitk_knobs if M <= tsk.MAX_ROWS else ():
                    ps, bk, bn, ms, st, sw = ([int(v) for v in knob.split(",")] + [0])[:6]
                    if sw and router:
                        continue
                    impls[f"splitk p{ps} k{bk} n{bn} s{ms} st{st}" + (" swap" if sw else "")] = (
                        lambda x, w, _k=dict(per_sm=ps, block_k=bk, block_n=bn, max_splits=ms, num_stages=st,
                                             swap=bool(sw)):
                        tsk.grouped_splitk(x, w, **_k))
                for impl, fn in impls.items():
                    out = fn(xs[0], ws[0]).reshape(ref.shape)
                    err = rel(out, ref)
                    us, mode = time_calls([lambda x=x, w=w: fn(x, w) for x, w in zip(xs, ws)], a.reps)
                    us *= 1e3
                    row = dict(bench="gemv", shape=name, groups=G, N=N, K=K, rows=M, impl=impl, us=round(us, 2),
                               tb_s=round(nbytes / (us * 1e-6) / 1e12, 3), rel_err=err, ok=err < 1e-2,
                               per_step=per_step, timing=mode,
                               device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")
                    f.write(json.dumps(row) + "\n")
                    key = (M, impl, router)
                    totals[key] = totals.get(key, 0.0) + (us if row["ok"] else float("inf")) * per_step
                print(f"{name:<11} rows {M}  bytes {nbytes / 2**20:6.1f} MB  done", flush=True)
        for router, limit in ((False, "GEMV_MAX_ROWS"), (True, "CED_ROUTE_LOGITS_GEMV_MAX_ROWS")):
            print(f"\n{'router' if router else 'projections'}:\n{'rows':>4}  {'cublas us/step':>14}  "
                  f"{'shipped us/step':>15}  {'best gemv us/step':>17}  {'best dot us/step':>16}  best knobs")
            max_rows, winning, dot_rows, dot_winning = 0, True, 0, True
            for M in a.rows:
                mine = {i: v for (m, i, r), v in totals.items() if m == M and r == router}
                cub = mine["cublas"]
                gem = {i: v for i, v in mine.items() if i.startswith("gemv")}
                dots = {i: v for i, v in mine.items() if i.startswith("dot")}
                best = min(gem, key=gem.get) if gem else None
                bdot = min(dots, key=dots.get) if dots else None
                ship = gem.get(shipped_name, float("inf"))
                nan = float("nan")
                print(f"{M:>4}  {cub:14.1f}  {ship if gem else nan:15.1f}  {gem[best] if gem else nan:17.1f}  "
                      f"{dots[bdot] if dots else nan:16.1f}  {best} / {bdot}")
                f.write(json.dumps(dict(bench="gemv_step", router=router, rows=M, cublas_us=round(cub, 1),
                                        shipped_us=round(ship, 1) if gem else None,
                                        gemv_us=round(gem[best], 1) if gem else None, knobs=best,
                                        dot_us=round(dots[bdot], 1) if dots else None, dot_knobs=bdot)) + "\n")
                if router and not gem:  # past the CUDA-core kernel's rows the router takes the tensor-core variant
                    ship = dots[bdot] if dots else float("inf")
                winning = winning and ship < cub
                if winning:
                    max_rows = M
                if M > max_rows and dots:  # the tensor-core variant past the CUDA-core kernel's rows
                    dot_winning = dot_winning and dots[bdot] < cub
                    if dot_winning:
                        dot_rows = M
            splitk_summary(a.rows, totals, max(max_rows, dot_rows) if not router else max_rows, f, router)
            if not router:
                one = {i: v for (m, i, r), v in totals.items() if m == a.rows[0] and not r and i.startswith("gemv")}
                if one:  # (none where the first row count is past the CUDA-core kernel's rows)
                    print(f"knobs at {a.rows[0]} row(s): {min(one, key=one.get)}")
                print(f"GEMV_DOT_MAX_ROWS (backends/nvidia/ops.py) by these rows: {dot_rows}")
            print(f"{limit} (backends/nvidia/ops.py) by these rows: {max_rows}")
    return 0


def splitk_summary(rows: list, totals: dict, after: int, f, router: bool = False) -> None:
    """Per row count the split-K kernel's best knobs against cuBLAS; SPLITK_MAX_ROWS: the largest count past
    ``after`` (the GEMV kernels' reach) up to which its best beats cuBLAS at every count, and the knobs with the
    lowest total over those counts (what ops.py would ship)."""
    print(f"\n{'rows':>4}  {'cublas us/step':>14}  {'best splitk us/step':>19}  knobs")
    limit, sums, winning = 0, {}, True
    for M in rows:
        mine = {i: v for (m, i, r), v in totals.items() if m == M and r == router}
        sk = {i: v for i, v in mine.items() if i.startswith("splitk")}
        if not sk:
            continue
        best = min(sk, key=sk.get)
        print(f"{M:>4}  {mine['cublas']:14.1f}  {sk[best]:19.1f}  {best}")
        f.write(json.dumps(dict(bench="gemv_step_splitk", router=router, rows=M, cublas_us=round(mine["cublas"], 1),
                                splitk_us=round(sk[best], 1), knobs=best)) + "\n")
        if M > after and winning:
            winning = sk[best] < mine["cublas"]
            if winning:
                limit = M
                for i, v in sk.items():
                    sums[i] = sums.get(i, 0.0) + v
    name = "CED_ROUTE_LOGITS_SPLITK_MAX_ROWS" if router else "SPLITK_MAX_ROWS"
    print(f"{name} (backends/nvidia/ops.py) by these rows: {limit}"
          + (f"; knobs with the lowest total over them: {min(sums, key=sums.get)}" if sums else ""))


if __name__ == "__main__":
    raise SystemExit(main())
