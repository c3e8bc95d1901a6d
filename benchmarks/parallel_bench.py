"""Parallel serving on the CPU: what 2 and 4 gloo ranks cost against one process (issue 18's communication overhead).

    python benchmarks/parallel_bench.py                          # dense Llama (TP) and Qwen3-MoE (EP), 1/2/4 ranks
    python benchmarks/parallel_bench.py --archs llama --worlds 1 2 --repeats 5 --out rows.jsonl
    python benchmarks/parallel_bench.py --archs qwen3-moe --dp       # data-parallel attention + EP experts

For each ``--archs`` model (a random-weight checkpoint built with transformers, float32, reference backend:
Llama d=256, 8 heads / 4 KV heads, 4 layers, F=1024, tensor-parallel; Qwen3-MoE the same attention with 16
experts top-4 of F=256 in every layer, tensor-parallel attention and expert-parallel experts by all-to-all),
the one-process engine and, in turn, one engine per world size in ``--worlds`` (one torch thread per rank, so 4 ranks on a
2-core machine share cores: the figure is the overhead of the protocol and the collectives on this machine, not
a speed-up anyone would buy). Each round runs the same batch (``--prompts`` random prompts of ``--input-len``
tokens, ``--output-len`` greedy tokens, EOS ignored) on the one-process engine, then on the parallel one;
``--repeats`` rounds, after one warm-up. A row: output tokens/s (median over rounds), the ratio to the one-process engine of the same round
(median of the per-round ratios), rank 0's time inside collectives and its share of the wall time, and whether
the greedy tokens equal the one-process engine's.

Writes JSONL rows with every setting and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.bench import append_jsonl, machine_info
from deepinfer.testing.models import build_tiny_hf_model

SHAPES = {
    "llama": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, tie_word_embeddings=False),
    "qwen3-moe": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=256, mlp_only_layers=[], norm_topk_prob=True),
}


def comm_seconds(llm) -> float:
    model = llm.engine.model
    return model.runtime.comm.stats["seconds"] if hasattr(model, "runtime") else 0.0


def one_round(llm, prompts, sp) -> tuple:
    c0, t0 = comm_seconds(llm), time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, comm_seconds(llm) - c0, [o.outputs[0].token_ids for o in outs]


def bench_arch(arch: str, args, root: Path) -> list:
    path = root / arch
    build_tiny_hf_model(path, arch, seed=0, **SHAPES[arch])
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, 500, (args.input_len,), generator=g).tolist() for _ in range(args.prompts)]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # Data-parallel attention needs prefix caching off; the baseline then runs without it too.
    cache = {"enable_prefix_caching": False} if args.dp else {}
    base = LLM(str(path), threads=args.threads, num_kv_blocks=256, max_num_seqs=args.prompts, **cache)
    one_round(base, prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    n_out = args.prompts * args.output_len
    rows = []
    # One parallel engine per process (one process group): each world size in turn, its rounds alternating
    # with the one-process engine's.
    for w in [w for w in args.worlds if w > 1]:
        layout = dict(data_parallel_size=w) if args.dp else dict(tensor_parallel_size=w)
        llm = LLM(str(path), threads=args.threads, num_kv_blocks=256, max_num_seqs=args.prompts, **cache, **layout,
                  enable_expert_parallel=arch != "llama")
        one_round(llm, prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))
        walls, base_walls, comms = [], [], []
        for _ in range(args.repeats):
            b_wall, _, b_tokens = one_round(base, prompts, sp)
            wall, comm, tokens = one_round(llm, prompts, sp)
            walls.append(wall), base_walls.append(b_wall), comms.append(comm)
        llm.shutdown()
        common = dict(bench="parallel", arch=arch, shape=SHAPES[arch], backend=llm.backend_name,
                      device=str(llm.engine.device), dtype="float32", threads_per_rank=args.threads,
                      num_prompts=args.prompts, input_len=args.input_len, output_len=args.output_len,
                      repeats=args.repeats, enable_prefix_caching=not args.dp, **machine_info())
        if not rows:
            rows.append({**common, "world_size": 1, "tensor_parallel_size": 1, "expert_parallel": False,
                         "expert_parallel_comm": None, "transport": None,
                         "tokens_per_s": n_out / statistics.median(base_walls), "ratio_vs_1": 1.0,
                         "wall_s": base_walls, "comm_s": 0.0, "comm_share": 0.0, "greedy_equal_to_1": True})
        rows.append({**common, "world_size": w, "tensor_parallel_size": 1 if args.dp else w,
                     "data_parallel_size": w if args.dp else 1, "expert_parallel": arch != "llama",
                     "expert_parallel_comm": llm.config.expert_parallel_comm if arch != "llama" else None,
                     "transport": "gloo", "tokens_per_s": n_out / statistics.median(walls),
                     "ratio_vs_1": statistics.median(b / t for b, t in zip(base_walls, walls)),
                     "wall_s": walls, "comm_s": statistics.median(comms),
                     "comm_share": statistics.median(c / t for c, t in zip(comms, walls)),
                     "greedy_equal_to_1": tokens == b_tokens})
    return rows


def table(rows: list) -> str:
    head = f"{'arch':<10} {'layout':>6} {'ranks':>5} {'tok/s':>8} {'vs 1':>6} {'comm s':>7} {'comm %':>7} {'same tokens':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        kind = "dp" if r.get("data_parallel_size", 1) > 1 else "tp/ep" if r["world_size"] > 1 else "-"
        lines.append(f"{r['arch']:<10} {kind:>6} {r['world_size']:>5} {r['tokens_per_s']:>8.1f} {r['ratio_vs_1']:>6.2f} "
                     f"{r['comm_s']:>7.3f} {100 * r['comm_share']:>6.1f}% {str(r['greedy_equal_to_1']):>11}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp", action="store_true", help="data-parallel attention (data_parallel_size) instead of "
                                                     "tensor parallelism; prefix caching off in both engines")
    p.add_argument("--out", default=None, metavar="FILE", help="JSONL file to append the rows to")
    args = p.parse_args(argv)
    if 1 not in args.worlds:
        p.error("--worlds must include 1 (the baseline)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs:
            rows += bench_arch(arch, args, Path(tmp))
    print(table(rows))
    if args.out:
        append_jsonl(args.out, rows)
    return 0 if all(r["greedy_equal_to_1"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
