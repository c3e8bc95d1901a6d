"""triton_moe.fused_experts' launch knobs at decode batch sizes: each GEMM's tile, K step, warps and stages against
launch_config's choice, at the CED bench config's MoE shape (32 experts, top-4, F=512, d=2048, bf16).

    python benchmarks/moe_launch_sweep.py --out $OUT/moe_launch.jsonl      # H200, ~2 min
    python benchmarks/moe_launch_sweep.py --prefill --out $OUT/moe_launch_prefill.jsonl   # a 16K prefill's layer

``--prefill`` (tokens 16384 unless --tokens says otherwise) sweeps the large-M regime instead: M-blocks of 64 and
128 rows, N tiles 64-256, K steps 32-128, 4 or 8 warps, 2-4 stages (a 16K bounded prefill spends ~9.5 ms of its
75 in these two GEMMs on the H100, ~46% of the bf16 matmul rate). ``--fp8`` takes block-scaled FP8 expert weights
(128 x 128 scale blocks, as FP8 checkpoints are served) instead of bf16, checked against the weights they dequantize
to (the 32nd session's sweep gave FP8 weights at 128-row M-blocks their own tiles, FP8_PREFILL_TILES).

A decode step's routed experts stream nearly every expert's weights once, so each row also reports the weight
bytes the touched experts hold over the time (TB/s). GEMM 1's knobs are swept with GEMM 2 at launch_config's and
the other way round, so a row's time moves with its own GEMM only. Every variant's output is checked against
launch_config's (relative error) and that against the float32 reference, before timing from one CUDA graph of
calls rotating over routings (kernels_gpu.time_calls). The table's last lines: per token count the best variant
of each GEMM and its speed-up, which is what launch_config should pick.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from deepinfer.bench import format_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import time_calls  # noqa: E402


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def variants(smoke: bool) -> list:
    """(gemm, overrides): launch_config's own, then each GEMM's grid of knobs (stages: launch_config's rule)."""
    if smoke:
        return [("default", {}), ("gemm1", dict(BN1=16, BK1=32)), ("gemm2", dict(BN2=32, BK2=16))]
    out = [("default", {})]
    for bn, bk, w in itertools.product((16, 32, 64), (64, 128, 256), (2, 4)):
        out.append(("gemm1", dict(BN1=bn, BK1=bk, warps1=w)))
    for st in (2, 3, 5):
        out.append(("gemm1", dict(stages1=st)))
    for bn, bk, w in itertools.product((32, 64, 128), (64, 128, 256), (2, 4)):
        out.append(("gemm2", dict(BN2=bn, BK2=bk, warps2=w)))
    for st in (2, 3, 5):
        out.append(("gemm2", dict(stages2=st)))
    return out


def prefill_variants() -> list:
    """The large-M grid: each GEMM's tile, K step and warps (stages: launch_config's rule), then stages alone, then
    both GEMMs on 64-row M-blocks (BLOCK_M: fused_experts' block_m; the padding is per expert segment)."""
    out = [("default", {})]
    for bn, bk, w in itertools.product((64, 128), (32, 64, 128), (4, 8)):
        out.append(("gemm1", dict(BN1=bn, BK1=bk, warps1=w)))
    for bn, bk, w in itertools.product((64, 128, 256), (32, 64), (4, 8)):
        out.append(("gemm2", dict(BN2=bn, BK2=bk, warps2=w)))
    for st in (2, 3, 4):
        out += [("gemm1", dict(stages1=st)), ("gemm2", dict(stages2=st))]
    for w in (4, 8):
        out.append(("both", dict(BLOCK_M=64, warps1=w, warps2=w)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="moe_launch.jsonl")
    ap.add_argument("--also", nargs="*", default=[], type=json.loads,
                    help='more variants of both GEMMs as JSON knobs, e.g. \'{"BN1": 32, "stages2": 4}\' (a previous '
                         'launch_config, timed in the same run)')
    ap.add_argument("--fp8", action="store_true", help="block-scaled FP8 expert weights instead of bf16")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: small shapes, checks the script")
    ap.add_argument("--prefill", action="store_true", help="the large-M grid (prefill_variants) at 16384 tokens")
    a = ap.parse_args(argv)
    if a.prefill and a.tokens == ap.get_default("tokens"):
        a.tokens = [16384]
    if a.smoke:
        a.hidden, a.intermediate, a.experts, a.top_k, a.tokens, a.reps = 64, 32, 8, 2, [3], 1
    elif not torch.cuda.is_available():
        print("needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    from deepinfer.backends.nvidia import triton_moe
    from deepinfer.backends.reference import moe as ref_moe

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    E, d, F, k = a.experts, a.hidden, a.intermediate, a.top_k
    if a.fp8:  # the kernels read (codes, scales); the reference the float32 weights they dequantize to
        from deepinfer.testing.kernels import fp8_weights

        w13, s13, ref13 = fp8_weights(g, E, 2 * F, d, dev)
        w2, s2, ref2 = fp8_weights(g, E, d, F, dev)
        scales = dict(w13_scale=s13, w2_scale=s2)
    else:
        w13 = (torch.randn(E, 2 * F, d, generator=g) * d ** -0.5).to(dev, torch.bfloat16)
        w2 = (torch.randn(E, d, F, generator=g) * F ** -0.5).to(dev, torch.bfloat16)
        ref13, ref2, scales = w13.float(), w2.float(), {}
    w_bytes = w13.element_size()
    rows = []
    with open(a.out, "w") as f:
        for T in a.tokens:
            sets = []
            for _ in range(4 if a.smoke else 8):
                wts, ids = ref_moe.route(torch.randn(T, E, generator=g), k)
                sets.append((torch.randn(T, d, generator=g).to(dev, torch.bfloat16), wts.to(dev), ids.to(dev)))
            touched = sum(len(set(s[2].flatten().tolist())) for s in sets) / len(sets)
            x, wts, ids = sets[0]
            ref = ref_moe.experts_dense(x.float(), ref13, ref2, wts, ids, clamp=10.0)
            base = triton_moe.fused_experts(x, w13, w2, wts, ids, clamp=10.0, **scales)
            cfg = triton_moe.launch_config(T * k, E, F, d, dev, w_bytes=w_bytes)
            grid = prefill_variants() if a.prefill else variants(a.smoke)
            if a.prefill and a.smoke:  # its first tile variant and the 64-row M-blocks only
                grid = grid[:2] + grid[-1:]
            for gemm, knobs in grid + [("given", k) for k in a.also]:
                if gemm in ("gemm1", "gemm2") and all(cfg.get(key) == v for key, v in knobs.items()):
                    continue  # launch_config's own: the default row
                tiles = {key: v for key, v in knobs.items() if key != "BLOCK_M"}
                bm = knobs.get("BLOCK_M")
                try:
                    out = triton_moe.fused_experts(x, w13, w2, wts, ids, clamp=10.0, launch=tiles, block_m=bm,
                                                   **scales)
                except Exception as e:  # a tile that does not compile (shared memory): say so, go on
                    print(f"  T={T} {gemm} {knobs}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                    continue
                calls = [lambda s=s: triton_moe.fused_experts(s[0], w13, w2, s[1], s[2], clamp=10.0, launch=tiles,
                                                              block_m=bm, **scales) for s in sets]
                ms, mode = time_calls(calls, a.reps)
                nbytes = touched * 3 * F * d * w_bytes
                row = dict(bench="moe_launch", tokens=T, weights="fp8" if a.fp8 else "bf16", gemm=gemm,
                           knobs=" ".join(f"{key}={v}" for key, v in knobs.items()) or "launch_config",
                           us=round(ms * 1e3, 2), tb_s=round(nbytes / (ms * 1e-3) / 1e12, 3),
                           tflop_s=round(6 * T * k * F * d / (ms * 1e-3) / 1e12, 1),
                           rel_err_vs_default=rel(out, base), default_rel_err=rel(base, ref),
                           experts_touched=round(touched, 1), launch_config=json.dumps(cfg), timing=mode,
                           device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
                rows.append(row)
                f.write(json.dumps(row) + "\n")
    print(format_table(rows, (("tokens", "tokens", "{}"), ("gemm", "gemm", "{}"), ("knobs", "knobs", "{}"),
                              ("us", "us", "{}"), ("TB/s", "tb_s", "{}"), ("TFLOP/s", "tflop_s", "{}"),
                              ("err vs default", "rel_err_vs_default",
                                                                          "{:.1e}"))))
    for T in a.tokens:
        mine = [r for r in rows if r["tokens"] == T]
        base = next((r for r in mine if r["gemm"] == "default"), None)
        if base is None:
            continue
        for gemm in ("gemm1", "gemm2", "both", "given"):
            theirs = [r for r in mine if r["gemm"] == gemm]
            if theirs:
                best = min(theirs, key=lambda r: r["us"])
                print(f"T={T} {gemm}: launch_config {base['us']} us; best {best['knobs']} {best['us']} us "
                      f"({base['us'] / best['us']:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
