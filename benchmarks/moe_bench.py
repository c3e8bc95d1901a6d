"""Routed vs dense MoE experts: time per step of one MoEBlock forward, at several token counts, in one run.

    python benchmarks/moe_bench.py                                  # Qwen3-MoE-like block, 8/64/256 tokens
    python benchmarks/moe_bench.py --tokens 8 64 256 --hidden 1024 --experts 64 --top-k 8 --expert-size 256 \
        --repeats 9 --threads 1 --out moe_bench.jsonl

One MoEBlock with random weights (reference backend) runs on T random tokens per step with
``impl="routed"`` (each expert on its own tokens: the serving path) and ``impl="dense"`` (every expert on
every token: the oracle); the router, the expert-load record and everything else in the block are shared.
After one warm-up each, every round times every (tokens, impl) once, in a rotating order, so neither
pays for a noisy moment alone. A row's time is the median over ``--repeats`` rounds; the ratio
(dense / routed) is the median of the per-round ratios. The outputs of the two are checked to agree
before timing.

Writes one JSONL row per (tokens, impl) with every setting and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.bench import append_jsonl, machine_info
from deepinfer.models.expert_load import ExpertLoad
from deepinfer.models.moe import MoEBlock


def make_block(args, impl: str, load: ExpertLoad) -> MoEBlock:
    dtype = getattr(torch, args.dtype)
    block = MoEBlock(args.hidden, args.expert_size, args.experts, args.top_k, ReferenceOps("cpu"), layer=0,
                     renormalize=True, shared_size=args.shared_size, shared_gate=args.shared_size > 0,
                     expert_load=load, impl=impl)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * args.hidden ** -0.5)
    return block.to(dtype).eval()


def time_once(block: MoEBlock, x: torch.Tensor, load: ExpertLoad) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        block(x)
    load.end_step()  # what the engine does after each step
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256], help="tokens per step")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-size", type=int, default=256, help="F of each expert")
    ap.add_argument("--shared-size", type=int, default=0, help="gated shared expert of this F (0 = none)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds (routed and dense alternate)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads (default 1: steadier on a shared machine; 0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="moe_bench.jsonl", help="JSONL file to append the rows to ('' = none)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    impls = ("routed", "dense")
    loads = {i: ExpertLoad([0], args.experts, window=1) for i in impls}
    blocks = {i: make_block(args, i, loads[i]) for i in impls}
    machine = machine_info()
    tokens = list(dict.fromkeys(args.tokens))
    xs, used, errs = {}, {}, {}
    tol = 1e-4 if args.dtype == "float32" else 3e-2
    for T in tokens:
        x = torch.randn(T, args.hidden, generator=torch.Generator().manual_seed(args.seed + T))
        xs[T] = x.to(blocks["routed"].w13.dtype)
        with torch.no_grad():  # the same function first: a fast wrong answer is not a result
            a, b = blocks["routed"](xs[T]), blocks["dense"](xs[T])
        errs[T] = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))
        if errs[T] > tol:
            print(f"routed and dense disagree at T={T}: max relative error {errs[T]:.2e}", file=sys.stderr)
            return 1
        used[T] = int((loads["routed"].current[0] > 0).sum())  # experts hit by this step's tokens
        for i in impls:
            loads[i].end_step()
            time_once(blocks[i], xs[T], loads[i])  # warm-up
    # Every round times every (tokens, impl) once, in a rotating order, so load from other processes on a
    # shared machine falls on all settings alike.
    times = {(T, i): [] for T in tokens for i in impls}
    cells = [(T, i) for T in tokens for i in impls]
    for r in range(args.repeats):
        k = r % len(cells)
        for T, i in (cells[k:] + cells[:k])[::(-1 if r % 2 else 1)]:
            times[T, i].append(time_once(blocks[i], xs[T], loads[i]))
    rows = []
    for T in tokens:
        ratio = statistics.median(d / r for d, r in zip(times[T, "dense"], times[T, "routed"]))
        for i in impls:
            t = times[T, i]
            rows.append({
                "bench": "moe_routed_vs_dense", "impl": i, "tokens": T, "hidden": args.hidden,
                "experts": args.experts, "top_k": args.top_k, "expert_size": args.expert_size,
                "shared_size": args.shared_size, "dtype": args.dtype, "backend": "reference", "device": "cpu",
                "repeats": args.repeats, "seed": args.seed, "experts_hit": used[T],
                "ms_median": 1e3 * statistics.median(t), "ms_min": 1e3 * min(t), "ms_all": [1e3 * v for v in t],
                "dense_over_routed": ratio, "max_rel_diff": errs[T], **machine,
            })
    if args.out:
        append_jsonl(args.out, rows)
    print(format_rows(rows))
    return 0


def format_rows(rows: list) -> str:
    """Markdown table from the rows: one line per (threads, token count)."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["torch_threads"], r["tokens"]), {})[r["impl"]] = r
    r0 = rows[0]
    head = (f"MoEBlock d={r0['hidden']}, E={r0['experts']}, top-{r0['top_k']}, F={r0['expert_size']}, "
            f"shared={r0['shared_size']}, {r0['dtype']}, reference backend, CPU, median of {r0['repeats']}\n\n")
    lines = ["| threads | tokens/step | experts hit | routed ms | dense ms | dense / routed |",
             "|---:|---:|---:|---:|---:|---:|"]
    for (th, T), d in by.items():
        lines.append(f"| {th} | {T} | {d['routed']['experts_hit']} | {d['routed']['ms_median']:.2f} | "
                     f"{d['dense']['ms_median']:.2f} | **{d['routed']['dense_over_routed']:.2f}x** |")
    return head + "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
