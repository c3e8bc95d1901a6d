"""A decode step's routed experts on the GPU: triton_moe.fused_experts (sort by expert, two GEMMs, k-sum: five
launches) against triton_moe_pairs.pair_experts (a GEMV per pair, two launches), per token count, at the CED
bench config's MoE shape, bf16 and FP8 block-scaled weights.

    python benchmarks/moe_pairs_bench.py --out $OUT/moe_pairs.jsonl      # H200, ~30 s

Both are checked first against the reference (experts_dense on float32 copies: relative error of each, and of
one against the other); then timed from one CUDA graph of several calls rotating over input sets
(benchmarks/kernels_gpu.time_calls, as the decode graphs replay them). Where pair_experts is faster is where the
nvidia backend should take it: the last line prints the MOE_PAIRS_MAX of backends/nvidia/ops.py these rows give
(0 until this has run on the H200: never dispatched; triton_moe_pairs.MAX_PAIRS caps it).

``--shared``: instead, the routed experts with the shared expert (Fs = F, bf16) at 1, 2 and 4 tokens, apart (the
pair kernels, then NvidiaOps' linear, ced_swiglu and linear for the shared expert: five launches, the sum left to
the next norm as the engine leaves it) against together (pair_experts(shared=...): two launches).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from deepinfer.bench import format_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import time_calls  # noqa: E402


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="moe_pairs.jsonl")
    ap.add_argument("--shared", action="store_true", help="the shared expert apart vs on the pair kernels")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    if a.shared:
        return shared_rows(a)
    from deepinfer.backends.nvidia import triton_moe, triton_moe_pairs as tmp
    from deepinfer.backends.reference import moe as ref_moe
    from deepinfer.testing.kernels import fp8_weights

    dev, g = torch.device("cuda"), torch.Generator().manual_seed(0)
    E, d, F, k = a.experts, a.hidden, a.intermediate, a.top_k
    w13 = (torch.randn(E, 2 * F, d, generator=g) * d ** -0.5).to(dev)
    w2 = (torch.randn(E, d, F, generator=g) * F ** -0.5).to(dev)
    formats = {"bf16": (w13.bfloat16(), w2.bfloat16(), {}, w13, w2)}
    q13, s13, dq13 = fp8_weights(g, E, 2 * F, d, dev)
    q2, s2, dq2 = fp8_weights(g, E, d, F, dev)
    formats["fp8"] = (q13, q2, {"w13_scale": s13, "w2_scale": s2}, dq13, dq2)
    rows = []
    with open(a.out, "w") as f:
        for name, (m13, m2, kw, ref13, ref2) in formats.items():
            for T in a.tokens:
                sets = []
                for _ in range(8):
                    x = torch.randn(T, d, generator=g).bfloat16().to(dev)
                    wts, ids = ref_moe.route(torch.randn(T, E, generator=g), k)
                    sets.append((x, wts.to(dev), ids.to(dev)))
                x, wts, ids = sets[0]
                ref = ref_moe.experts_dense(x.float(), ref13, ref2, wts, ids, clamp=10.0)
                o_fused = triton_moe.fused_experts(x, m13, m2, wts, ids, clamp=10.0, **kw)
                o_pairs = tmp.pair_experts(x, m13, m2, wts, ids, clamp=10.0, **kw)
                fused = [lambda s=s: triton_moe.fused_experts(s[0], m13, m2, s[1], s[2], clamp=10.0, **kw)
                         for s in sets]
                pairs = [lambda s=s: tmp.pair_experts(s[0], m13, m2, s[1], s[2], clamp=10.0, **kw) for s in sets]
                t_fused, mode = time_calls(fused, a.reps)
                t_pairs, _ = time_calls(pairs, a.reps)
                row = dict(bench="moe_pairs", weights=name, tokens=T, hidden=d, intermediate=F, experts=E, top_k=k,
                           fused_us=round(t_fused * 1e3, 2), pairs_us=round(t_pairs * 1e3, 2),
                           pairs_over_fused=round(t_pairs / t_fused, 3), fused_rel_err=rel(o_fused, ref),
                           pairs_rel_err=rel(o_pairs, ref), pairs_vs_fused=rel(o_pairs, o_fused), timing=mode,
                           device=torch.cuda.get_device_name())
                rows.append(row)
                f.write(json.dumps(row) + "\n")
    print(format_table(rows, (("weights", "weights", "{}"), ("tokens", "tokens", "{}"), ("fused us", "fused_us", "{}"),
                              ("pairs us", "pairs_us", "{}"), ("ratio", "pairs_over_fused", "{}"),
                              ("err fused", "fused_rel_err", "{:.2e}"), ("err pairs", "pairs_rel_err", "{:.2e}"))))
    print(f"MOE_PAIRS_MAX (backends/nvidia/ops.py) by these rows: {pairs_max(rows)}")
    return 0


def shared_rows(a) -> int:
    from deepinfer.backends.nvidia import triton_moe_pairs as tmp
    from deepinfer.backends.nvidia.ops import NvidiaOps
    from deepinfer.backends.reference import moe as ref_moe

    dev, g = torch.device("cuda"), torch.Generator().manual_seed(1)
    E, d, F, k = a.experts, a.hidden, a.intermediate, a.top_k
    bf = torch.bfloat16
    w13 = (torch.randn(E, 2 * F, d, generator=g) * d ** -0.5).to(dev, bf)
    w2 = (torch.randn(E, d, F, generator=g) * F ** -0.5).to(dev, bf)
    sw13 = (torch.randn(2 * F, d, generator=g) * d ** -0.5).to(dev, bf)
    sw2 = (torch.randn(d, F, generator=g) * F ** -0.5).to(dev, bf)
    ops = NvidiaOps(dev)

    def apart(x, wts, ids):
        routed = tmp.pair_experts(x, w13, w2, wts, ids, clamp=10.0)
        return routed, ops.linear(ops.ced_swiglu(ops.linear(x, sw13), 10.0), sw2)

    def together(x, wts, ids):
        return tmp.pair_experts(x, w13, w2, wts, ids, clamp=10.0, shared=(sw13, sw2))

    rows = []
    with open(a.out, "w") as f:
        for T in [t for t in a.tokens if t * (k + 1) <= tmp.MAX_PAIRS and t <= 4]:
            sets = []
            for _ in range(8):
                wts, ids = ref_moe.route(torch.randn(T, E, generator=g), k)
                sets.append((torch.randn(T, d, generator=g).to(dev, bf), wts.to(dev), ids.to(dev)))
            r, sh = apart(*sets[0])
            t_apart, mode = time_calls([lambda s=s: apart(*s) for s in sets], a.reps)
            t_together, _ = time_calls([lambda s=s: together(*s) for s in sets], a.reps)
            row = dict(bench="moe_pairs_shared", tokens=T, hidden=d, intermediate=F, experts=E, top_k=k,
                       apart_us=round(t_apart * 1e3, 2), together_us=round(t_together * 1e3, 2),
                       together_over_apart=round(t_together / t_apart, 3),
                       rel_err=rel(together(*sets[0]), r.float() + sh.float()), timing=mode,
                       device=torch.cuda.get_device_name())
            rows.append(row)
            f.write(json.dumps(row) + "\n")
    print(format_table(rows, (("tokens", "tokens", "{}"), ("apart us", "apart_us", "{}"),
                              ("together us", "together_us", "{}"), ("ratio", "together_over_apart", "{}"),
                              ("rel err", "rel_err", "{:.2e}"))))
    return 0


def pairs_max(rows: list) -> int:
    """The most (token, expert) pairs up to which pair_experts beat fused_experts at every measured count, in every
    weight format (0: it never did); past the first count where it lost, fused_experts."""
    best = None
    for name in sorted({r["weights"] for r in rows}):
        won = 0
        for r in sorted((r for r in rows if r["weights"] == name), key=lambda r: r["tokens"]):
            if r["pairs_over_fused"] >= 1:
                break
            won = r["tokens"] * r["top_k"]
        best = won if best is None else min(best, won)
    return best or 0


if __name__ == "__main__":
    sys.exit(main())
