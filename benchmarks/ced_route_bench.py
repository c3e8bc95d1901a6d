"""CED's MoE router on the GPU: the gate GEMV inside the router kernel against cuBLAS's GEMV then the router
kernel on the logits, at the CED bench config's router shape, per token count.

    python benchmarks/ced_route_bench.py --out $OUT/ced_route.jsonl      # H200, ~20 s

Both variants are checked first on the same inputs (ids equal but where two experts' selection scores are
within float32 noise; weights within 1e-5 relative); then timed from one CUDA graph of several calls that
rotate over input sets (benchmarks/kernels_gpu.time_calls, as the engine's decode graphs replay them).
NvidiaOps.ced_moe_route takes the in-kernel GEMV up to CED_ROUTE_GEMV_MAX_ROWS tokens: this bench is
where that number comes from (docs/benchmarks.md).
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 64, 128, 192, 256])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="ced_route.jsonl")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from deepinfer.backends.nvidia import triton_ced_route as tcr

    dev, g = torch.device("cuda"), torch.Generator().manual_seed(0)
    gate = (torch.randn(a.experts, a.hidden, generator=g) * a.hidden ** -0.5).to(dev)
    bias = (torch.randn(a.experts, generator=g) * 0.01).to(dev)
    rows = []
    with open(a.out, "w") as f:
        for T in a.tokens:
            xs = [torch.randn(T, a.hidden, generator=g).bfloat16().to(dev) for _ in range(8)]
            kw = dict(scaling=2.5, bias=bias)
            fused = [lambda x=x: tcr.route_from_hidden(x, gate, a.top_k, **kw) for x in xs]
            split = [lambda x=x: tcr.route(torch.nn.functional.linear(x.float(), gate), a.top_k, **kw) for x in xs]
            (w1, i1), (w2, i2) = fused[0](), split[0]()
            same = float((i1 == i2).all(-1).float().mean())
            werr = float(((w1 - w2).abs() / w2.abs().clamp_min(1e-6)).max()) if same == 1.0 else None
            t_fused, mode = time_calls(fused, a.reps)
            t_split, _ = time_calls(split, a.reps)
            row = dict(bench="ced_route", tokens=T, hidden=a.hidden, experts=a.experts, top_k=a.top_k,
                       gemv_in_kernel_us=round(t_fused * 1e3, 2), cublas_then_route_us=round(t_split * 1e3, 2),
                       ratio=round(t_fused / t_split, 3), rows_same_ids=same, max_weight_rel_err=werr,
                       timing=mode, device=torch.cuda.get_device_name())
            rows.append(row)
            f.write(json.dumps(row) + "\n")
    print(format_table(rows, (("tokens", "tokens", "{}"), ("in-kernel us", "gemv_in_kernel_us", "{}"),
                              ("cuBLAS+route us", "cublas_then_route_us", "{}"), ("ratio", "ratio", "{}"),
                              ("same ids", "rows_same_ids", "{:.3f}"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
