"""Device diagnosis of the shared expert on the pair kernels (backends/nvidia/ops.py MOE_SHARED_ON_PAIRS): with it
on, run the tests that parted from their twin runs on the H200 while every eager call of moe_experts_shared is
also computed apart (the routed experts, then the shared expert's linear / ced_swiglu / linear) and by a float64
oracle written here; each call's relative errors go to OUT/diag_shared_pairs.jsonl, a summary to stdout. Calls
made while a CUDA graph is being captured are counted, not compared (their values do not exist yet).

    python scripts/diag_shared_pairs.py [pytest node ids ...]     # on the device; OUT defaults to /tmp/out
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.backends.nvidia import ops as nv
from deepinfer.backends.reference.moe import experts_dense

TESTS = ["tests/test_swa_pool.py", "tests/test_speculative.py::test_greedy_speculation_reproduces_plain_decoding"]
ROWS: list = []


def oracle(x, w13, w2, weights, ids, sw13, sw2, clamp):
    """float64: the routed experts by the reference's dense oracle, plus the shared expert's clamped SwiGLU."""
    x, w13, w2, weights, sw13, sw2 = (t.double() for t in (x, w13, w2, weights, sw13, sw2))
    gu = x @ sw13.T
    g, u = gu.chunk(2, dim=-1)
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return experts_dense(x, w13, w2, weights, ids, clamp=clamp) + (torch.nn.functional.silu(g) * u) @ sw2.T


def rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def install() -> None:
    nv.MOE_SHARED_ON_PAIRS = True
    inner = nv.NvidiaOps.moe_experts_shared

    def watched(self, x, w13, w2, weights, ids, shared_w13, shared_w2, *, clamp=None, w13_scale=None,
                w2_scale=None):
        out = inner(self, x, w13, w2, weights, ids, shared_w13, shared_w2, clamp=clamp, w13_scale=w13_scale,
                    w2_scale=w2_scale)
        row = {"T": x.shape[0], "k": ids.shape[1], "d": x.shape[1], "F": w13.shape[1] // 2,
               "Fs": shared_w13.shape[0] // 2, "dtype": str(x.dtype), "x_stride": list(x.stride()),
               "fused": out is not None, "test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]}
        if out is not None and torch.cuda.is_current_stream_capturing():
            row["capturing"] = True
        elif out is not None:
            apart = self.moe_experts(x, w13, w2, weights, ids, clamp=clamp, impl="routed") \
                + self.linear(self.ced_swiglu(self.linear(x, shared_w13), clamp), shared_w2)
            ref = oracle(x, w13, w2, weights, ids, shared_w13, shared_w2, clamp)
            row.update(fused_vs_oracle=rel(out, ref), apart_vs_oracle=rel(apart, ref),
                       fused_vs_apart=rel(out, apart.double()), finite=bool(torch.isfinite(out).all()))
        ROWS.append(row)
        return out

    nv.NvidiaOps.moe_experts_shared = watched


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    install()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-rfE", *(sys.argv[1:] or TESTS)])
    with open(out / "diag_shared_pairs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    fused = [r for r in ROWS if r["fused"]]
    compared = [r for r in fused if "fused_vs_oracle" in r]
    print(f"moe_experts_shared calls {len(ROWS)}, fused {len(fused)}, under capture {len(fused) - len(compared)}, "
          f"compared {len(compared)}")
    for key in ("fused_vs_oracle", "apart_vs_oracle", "fused_vs_apart"):
        if compared:
            worst = max(compared, key=lambda r: r[key])
            print(f"  worst {key}: {worst[key]:.3g} at {worst}")
    bad = [r for r in compared if r["fused_vs_oracle"] > 10 * max(r["apart_vs_oracle"], 1e-6)]
    print(f"calls whose fused error is over 10x the apart one's: {len(bad)}; first: {bad[:3]}")
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
