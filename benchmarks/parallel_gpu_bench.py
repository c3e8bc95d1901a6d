"""Expert parallelism on GPUs (issue 18's H200 measurement): the Qwen3-30B-A3B shape over 2 GPUs against 1.

    python benchmarks/parallel_gpu_bench.py --out ep_gpu.jsonl                         # 2 H200s (NCCL)
    python benchmarks/parallel_gpu_bench.py --shape qwen3-moe-tiny --device cpu --dtype float32 \\
        --batches 4 --prefill 64 --decode-steps 4                                      # a CPU smoke run (gloo)

Random weights (``load_format="dummy"``; config and tokenizer only, gpu_bench.py's shapes). Two engines in one
process: one GPU (``tensor_parallel_size=1``) and ``--world`` GPUs (``--layout ep``: attention tensor-parallel;
``--layout dp``: attention data-parallel, prefix caching off in both engines; experts expert-parallel by
all-to-all in both: ``enable_expert_parallel=True``), both eager (the parallel engine does not
capture CUDA graphs yet, so neither does the baseline) with the same KV budget per GPU. Measured in rounds that
alternate the two engines (``--repeats``): decode at each ``--batches`` (gpu_bench.measure_decode: B prompts of
``--input-len`` tokens, steady decode tokens/s over ``--decode-steps`` steps) and one ``--prefill``-token prompt
(prefill tokens/s). Rows give the medians and the ratio to one GPU (median of per-round ratios).

Then EPLB on the real expert-parallel engine: the ``--world``-rank engine rebuilt with ``enable_eplb=True`` and
``--redundant`` redundant slots, its router skewed on every rank (eplb_bench.skew_router: a fixed selection bias
of ``--bias`` on ``--hot`` experts per layer); decode tokens/s at the largest batch under the start placement,
one rebalance (the policy on rank 0, expert weights moved between the GPUs by all-to-all) from one decode's
load; then ``--repeats`` rounds that move the weights back to the start placement, decode, move them to the new
one, decode. Reported: balancedness before/after on the window it rebalanced from and on the rounds' (held-out)
load, the slots moved, the rebalance's seconds (policy and move), and the tokens/s won back (after / before,
median of per-round ratios).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eplb_bench  # noqa: E402
import gpu_bench  # noqa: E402

from deepinfer import LLM  # noqa: E402
from deepinfer.bench import append_jsonl, machine_info  # noqa: E402


def engine(path, args, world: int, **kw):
    par = {}
    if world > 1:
        par = dict(data_parallel_size=world, enable_prefix_caching=False) if args.layout == "dp" else dict(
            tensor_parallel_size=world)
        par["enable_expert_parallel"] = True
    elif args.layout == "dp":
        kw.setdefault("enable_prefix_caching", False)  # as the data-parallel engine must
    return LLM(str(path), load_format="dummy", dtype=args.dtype, device=args.device, enforce_eager=True,
               kv_cache_memory_gb=args.kv_gb, max_num_seqs=max(args.batches), threads=args.threads,
               max_num_batched_tokens=max(args.prefill, args.input_len * max(args.batches)),
               max_model_len=max(args.prefill, args.input_len + args.decode_steps + 8) + 16, **par, **kw)


def decode(llm, B, args, vocab, seed):
    r = gpu_bench.measure_decode(llm, B, args.input_len, args.decode_steps, float("inf"), seed, vocab)
    return r.get("decode_tok_s", float("nan"))


def prefill(llm, args, vocab, seed):
    return args.prefill / gpu_bench.measure_prefill(llm, 1, args.prefill, seed, vocab)["seconds"]


def eplb_row(path, args, vocab, common: dict) -> dict:
    """EPLB on the expert-parallel engine with a skewed router: the module docstring's last paragraph."""
    B = max(args.batches)
    llm = engine(path, args, args.world, enable_eplb=True,
                 eplb_config={"num_redundant_experts": args.redundant, "window_size": 10**6, "step_interval": 10**9})
    try:
        eplb_bench.skew_router(llm, args.hot, args.bias, 0)
        gpu_bench.measure_decode(llm, 2, 16, 4, float("inf"), 0, vocab)  # warm-up
        model, eplb = llm.engine.model, llm.engine.model.eplb
        model.expert_load.set_window(10**6)
        decode(llm, B, args, vocab, 99)  # the load the rebalance reads
        t0 = time.perf_counter()
        rec = eplb.rebalance()
        rebalance_s = time.perf_counter() - t0
        placed = eplb.current()
        model.expert_load.set_window(10**6)  # held out: the rounds' load
        before, after = [], []
        for r in range(args.repeats):  # alternate the placements (weights moved back and forth)
            model.move_experts(eplb.initial)
            before.append(decode(llm, B, args, vocab, 100 + r))
            model.move_experts(placed)
            after.append(decode(llm, B, args, vocab, 100 + r))
        stats = llm.eplb_stats()
    finally:
        llm.shutdown()
    return {**common, "phase": "eplb_skewed", "batch": B, "world_size": args.world, "simulated": False,
            "hot": args.hot, "bias": args.bias, "num_redundant_experts": args.redundant,
            "balancedness_before": rec["before"], "balancedness_after": rec["after"],
            "balancedness_held_out": stats["balancedness"],
            "balancedness_held_out_default": stats["balancedness_default"],
            "moved_slots": rec["moved_slots"], "rebalance_s": rebalance_s, "tok_s_before": statistics.median(before),
            "tok_s_after": statistics.median(after),
            "won_back": statistics.median(a / b for a, b in zip(after, before)), "samples_before": before,
            "samples_after": after}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(gpu_bench.SHAPES))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layout", choices=("ep", "dp"), default="ep",
                   help="ep: attention tensor-parallel; dp: attention data-parallel (each GPU its own sequences); "
                        "experts expert-parallel in both")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--prefill", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-gb", type=float, default=12.0, help="KV cache per GPU (GiB)")
    p.add_argument("--hot", type=int, default=8)
    p.add_argument("--bias", type=float, default=0.5)
    p.add_argument("--redundant", type=int, default=16, help="EPLB's redundant expert slots")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = gpu_bench.SHAPES[args.shape]
    vocab = min(cfg["vocab_size"], 512)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / args.shape
        path.mkdir()
        gpu_bench.write_model_dir(path, cfg)
        one, many = engine(path, args, 1), engine(path, args, args.world)
        for llm in (one, many):  # warm-up
            gpu_bench.measure_decode(llm, 2, 16, 4, float("inf"), 0, vocab)
        work = [("decode", B) for B in args.batches] + [("prefill", args.prefill)]
        res = {(w, k): [] for w in (1, args.world) for k in work}
        for rep in range(args.repeats):
            for kind, n in work:
                for w, llm in ((1, one), (args.world, many)):
                    f = decode(llm, n, args, vocab, rep) if kind == "decode" else prefill(llm, args, vocab, rep)
                    res[(w, (kind, n))].append(f)
        comm = many.engine.model.runtime.comm.stats
        many.shutdown()
        common = dict(bench="parallel_gpu", shape=args.shape, layout=args.layout, dtype=args.dtype, device=args.device,
                      input_len=args.input_len, decode_steps=args.decode_steps, repeats=args.repeats,
                      enforce_eager=True, kv_cache_memory_gb=args.kv_gb, **machine_info())
        for kind, n in work:
            base = res[(1, (kind, n))]
            for w in (1, args.world):
                xs = res[(w, (kind, n))]
                rows.append({**common, "phase": kind, ("batch" if kind == "decode" else "prompt_len"): n,
                             "world_size": w, "expert_parallel": w > 1, "tokens_per_s": statistics.median(xs),
                             "ratio_vs_1": statistics.median(x / b for b, x in zip(base, xs))
                             if w > 1 else 1.0, "samples": xs})
        rows[-1]["collectives_rank0"] = dict(comm)
        del one
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        rows.append(eplb_row(path, args, vocab, common))
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k in (
            "phase", "batch", "prompt_len", "world_size", "tokens_per_s", "ratio_vs_1", "balancedness_before",
            "balancedness_after", "balancedness_held_out", "balancedness_held_out_default", "moved_slots",
            "rebalance_s", "tok_s_before", "tok_s_after", "won_back")}))
    if args.out:
        append_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = True
    sys.exit(main())
