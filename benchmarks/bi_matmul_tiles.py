"""Tile configs of the batch-invariant Triton matmul (backends/nvidia/triton_batch_invariant.py) against cuBLAS
on a model's projection shapes, at the batch sizes a decode and a prefill step run: per shape and M, cuBLAS, the
fastest config and the one mm_config picks (DECODE_TILES and MM_CONFIG come from these rows). Also reports whether every config gives the same bits (tests/test_triton_batch_invariant.py's
test_tile_bands_give_the_same_bits relies on it for the configs mm_config picks).

    python benchmarks/bi_matmul_tiles.py --out rows.jsonl     # CUDA only
    python benchmarks/bi_matmul_tiles.py --picked --shape ced-bench --ms 1 16 64 1024 --out rows.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

SHAPES = {"llama-3.1-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                           "down": (14336, 4096), "lm_head": (4096, 128256)},
          # the CED bench config's products (K, N[, groups]): what a decode step's matmul calls are
          "ced-bench": {"q_down": (2048, 1024), "q_up": (1024, 8192), "kv": (2048, 512),
                        "out_groups": (1024, 1024, 8), "o": (8192, 2048), "router": (2048, 32),
                        "index_q": (1024, 2048), "index_w": (2048, 16), "index_k": (2048, 128),
                        "lm_head": (2048, 4096)}}


def picked(shape: str, ms, out) -> None:
    """tbi.matmul as dispatched (k_splits' splits: partials for few rows, one walk for many) against the same
    product unsplit and cuBLAS, per product and M; the rows say whether split and unsplit differ in bits (they
    may: a different order of reduction) and whether split rows agree across M (they must)."""
    from deepinfer.backends.nvidia import triton_batch_invariant as bi
    dt = torch.bfloat16
    rows = []
    for name, dims in SHAPES[shape].items():
        K, N, nb = (*dims, 1)[:3]
        w = torch.randn(nb, N, K, device="cuda", dtype=dt) / K ** 0.5
        b = w.transpose(1, 2)
        big = torch.randn(nb, max(ms), K, device="cuda", dtype=dt)
        ref = bi.matmul(big, b)
        for M in ms:
            a = big[:, :M].contiguous()
            t_split = bench(lambda: bi.matmul(a, b))
            same_across_m = bool(torch.equal(bi.matmul(a, b), ref[:, :M]))
            saved = bi.k_splits
            bi.k_splits = lambda dtype, K, N, nb=1: (1, -(-K // bi.MM_CONFIG[dtype]["BLOCK_K"]))
            try:
                t_one = bench(lambda: bi.matmul(a, b))
            finally:
                bi.k_splits = saved
            t_cublas = bench(lambda: torch.bmm(a, b))
            row = dict(bench="bi_matmul_picked", shape=shape, proj=name, K=K, N=N, groups=nb, M=M,
                       splits=bi.k_splits(dt, K, N, nb)[0], us_split=t_split, us_unsplit=t_one, us_cublas=t_cublas,
                       split_rows_same_across_m=same_across_m)
            rows.append(row)
            out.write(json.dumps(row) + "\n")
    print(f"{'product':10s} {'K':>6s} {'N':>6s} {'g':>2s} {'M':>5s} {'S':>3s} {'split us':>9s} {'unsplit':>9s} "
          f"{'cuBLAS':>9s}  same bits across M")
    for r in rows:
        print(f"{r['proj']:10s} {r['K']:6d} {r['N']:6d} {r['groups']:2d} {r['M']:5d} {r['splits']:3d} "
              f"{r['us_split']:9.1f} {r['us_unsplit']:9.1f} {r['us_cublas']:9.1f}  {r['split_rows_same_across_m']}")


def bench(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1e3  # us


def main():
    from deepinfer.backends.nvidia import triton_batch_invariant as bi
    import triton
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    ap.add_argument("--out", default="bi_matmul_tiles.jsonl")
    ap.add_argument("--picked", action="store_true", help="time the dispatched path (splits) vs unsplit vs cuBLAS")
    args = ap.parse_args()
    if args.picked:
        with open(args.out, "a") as f:
            picked(args.shape, args.ms, f)
        return
    dt = torch.bfloat16
    cfgs = [dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
            for bn, bk, w, st in itertools.product([16, 32, 64, 128], [64, 128], [4], [3, 4, 5])]
    rows = []
    with open(args.out, "w") as f:
        for name, (K, N) in SHAPES[args.shape].items():
            w = torch.randn(N, K, device="cuda", dtype=dt) / K ** 0.5
            b = w.t()
            for M in args.ms:
                a = torch.randn(M, K, device="cuda", dtype=dt)
                out = torch.empty(1, M, N, device="cuda", dtype=dt)
                t_cublas = bench(lambda: a @ b)
                ref = None
                for ci, cfg in enumerate(cfgs):
                    def run(cfg=cfg):
                        grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), 1)
                        bi._mm_kernel[grid](a[None], b[None], out, out, M, N, K, *a[None].stride(),
                                            *b[None].stride(), *out.stride(), *out.stride(), 1.0, 1.0,
                                            HAS_BIAS=False, SCALED=False, BLOCK_M=64, BLOCK_N=cfg["BLOCK_N"],
                                            BLOCK_K=cfg["BLOCK_K"], PRECISION="tf32", K_I=0,
                                            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
                    try:
                        t = bench(run)
                    except Exception as exc:  # out of shared memory for a deep pipeline, say
                        print(name, M, cfg, "failed", type(exc).__name__)
                        continue
                    run()
                    if ref is None:
                        ref = out.clone()
                    same = bool(torch.equal(out, ref))  # against the first config (BLOCK_N 16, BLOCK_K 64)
                    row = dict(shape=args.shape, proj=name, K=K, N=N, M=M, cfg=ci, **cfg, us=t, cublas_us=t_cublas,
                               ratio=t_cublas / t, bitwise_equal_first=same)
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
            print(f"{name:8s} K={K:6d} N={N:6d}")
            for M in args.ms:
                r = {x["cfg"]: x for x in rows if x["proj"] == name and x["M"] == M}
                fast = min(r, key=lambda i: r[i]["us"])
                cur = bi.mm_config(dt, N, M)
                cur_t = next((r[i]["us"] for i, c in enumerate(cfgs) if c == cur and i in r), float("nan"))
                same = all(x["bitwise_equal_first"] for x in r.values())
                print(f"   M={M:5d} cublas {r[fast]['cublas_us']:8.1f} us  fastest {r[fast]['us']:8.1f} "
                      f"(BLOCK_N {cfgs[fast]['BLOCK_N']}, BLOCK_K {cfgs[fast]['BLOCK_K']}, stages "
                      f"{cfgs[fast]['num_stages']})  mm_config {cur_t:8.1f}  all configs same bits {same}")


if __name__ == "__main__":
    main()
