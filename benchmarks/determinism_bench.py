"""What batch invariance costs: the deterministic recipe against the throughput recipe, output tokens/s.

    python benchmarks/determinism_bench.py --out $OUT/determinism_bench.jsonl          # H200: Llama-3.1-8B shape
                                                                                     # and the CED bench config
    python benchmarks/determinism_bench.py --shapes demo --batches 1 16 64 --out rows.jsonl   # CPU: the demo model

Per shape (random weights, ``load_format="dummy"``, as benchmarks/gpu_bench.py builds them; ``demo`` is the
bundled CED demo model with its trained weights) and per recipe, one engine with the same overrides for both
(max_num_seqs = the largest batch, CUDA graphs for exactly the measured batch sizes, the same KV size), warmed
up, then for each batch size B: B random prompts of --in-len tokens submitted at once, greedy, --out-len tokens
each (ignore_eos), stepped to the end (gpu_bench.measure_decode). ``output_tok_s`` is every output token over
the whole wall time (prefill included); ``decode_tok_s`` the steady decode after every sequence has its first
token. Both engines stay alive and are measured in alternating pairs (``--pairs``: 1 on the GPU, 3 on a shared
CPU, the order flipped every pair); the row ``ratio`` is the median of the pairs' deterministic / throughput
and ``cost`` = 1 - ratio (the goal: cost <= 20%; SGLang published 34% and 61% for its first batch-invariant
kernels). On a shared CPU, ``decode_per_cpu_s_ratio`` (the same ratio of decode tokens per second of this
process's CPU time, gpu_bench's decode_tok_per_cpu_s) is the figure other load disturbs least. Every row
carries its settings; a table is printed at the end.

``--baseline kernels-off`` measures against the deterministic recipe itself with ``batch_invariant=False``
(the same stages, no speculation, torch's own kernels and attention) instead of ``throughput``: what the
batch-invariant kernels alone cost. On the demo model ``throughput`` also speculates (DSpark drafts, which the
deterministic recipe turns off), so its ratio holds both effects.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402  (model shapes, the dummy-weight builder, the decode measurement)

from deepinfer.bench import append_jsonl, machine_info  # noqa: E402

BASELINES = ("throughput", "kernels-off")  # what "deterministic" is measured against (see the docstring)


def shape_config(shape: str, max_len: int):
    """(hf config dict or None for the demo, a name)."""
    if shape == "demo":
        return None, "ced-demo"
    if shape.startswith("ced-"):
        return gpu_bench.ced_config(shape[4:], max_len), shape
    return dict(gpu_bench.SHAPES[shape]), shape


def build(shape: str, cfg, recipe: str, args, model_dir):
    from deepinfer import LLM

    B = max(args.batches)
    invariant = recipe != "kernels-off"  # kernels-off: the deterministic recipe on torch's own kernels
    recipe = recipe if invariant else "deterministic"
    kw = dict(recipe=recipe, max_num_seqs=B, dtype=args.dtype, max_model_len=args.in_len + args.out_len + 16)
    if args.device == "cuda":
        kw["cuda_graph_sizes"] = sorted(set(args.batches))
        kw["kv_cache_memory_gb"] = args.kv_gb
    else:
        kw["num_kv_blocks"] = math.ceil(B * (args.in_len + args.out_len + 16) / 16) + B + 16
        kw["threads"] = args.threads
    if not invariant:
        kw["batch_invariant"] = False
    if cfg is None:
        return LLM(None, device=args.device, **kw)
    if args.device == "cuda":
        kw.pop("dtype")  # build_llm passes the Namespace's
        llm, _ = gpu_bench.build_llm(model_dir, argparse.Namespace(dtype=args.dtype, device=args.device,
                                                                    backend=None, build_in_dtype="auto"), cfg, **kw)
        return llm
    return LLM(str(model_dir), load_format="dummy", device=args.device, **kw)


def free(llm) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args) -> list:
    rows = []
    recipes = (args.baseline, "deterministic")
    base = {"bench": "determinism", "baseline": args.baseline, "commit": args.commit, "device": args.device,
            "dtype": args.dtype, "input_len": args.in_len, "output_len": args.out_len, "pairs": args.pairs,
            **machine_info()}
    for shape in args.shapes:
        cfg, name = shape_config(shape, args.in_len + args.out_len + 16)
        with tempfile.TemporaryDirectory(prefix="deepinfer-det-bench-") as d:
            if cfg is not None:
                gpu_bench.write_model_dir(Path(d), cfg)
            llms, settings = {}, {}
            for recipe in recipes:  # both engines alive, so their measurements interleave
                t0 = time.perf_counter()
                llm = llms[recipe] = build(shape, cfg, recipe, args, Path(d))
                build_s = time.perf_counter() - t0
                gpu_bench.warm(llm, llm.engine.model.vocab_size, B=2, in_len=16, out_len=4)
                settings[recipe] = {"shape": name, "recipe": recipe, "backend": llm.backend_name, "build_s": build_s,
                                    "batch_invariant": llm.config.batch_invariant,
                                    "cuda_graphs": llm.engine.decode_graphs is not None,
                                    "overlap": llm.engine.overlap, "prefix_caching": llm.config.enable_prefix_caching,
                                    "threads": torch.get_num_threads()}
            vocab = llms[args.baseline].engine.model.vocab_size
            for B in args.batches:
                got = {r: [] for r in recipes}
                for recipe in recipes:  # this B's prefill and decode shapes compiled (Triton) before timing
                    gpu_bench.warm(llms[recipe], vocab, B=B, in_len=args.in_len, out_len=4)
                for pair in range(args.pairs):  # alternating order, so drift in the machine's load cancels
                    for recipe in (recipes if pair % 2 == 0 else recipes[::-1]):
                        r = gpu_bench.measure_decode(llms[recipe], B, args.in_len, args.out_len,
                                                     time.perf_counter() + 1e9, seed=1 + pair, vocab=vocab)
                        row = {**base, **settings[recipe], "pair": pair, **r}
                        rows.append(row)
                        got[recipe].append(row)
                        if args.out:
                            append_jsonl(args.out, [row])
                        print(f"  {name:>14} {recipe:>13} B={B:<3} pair {pair}: {r['output_tok_s']:9.1f} output tok/s"
                              f"  {r.get('decode_tok_s', float('nan')):9.1f} decode tok/s", flush=True)
                t, dt = got[args.baseline], got["deterministic"]
                ratios = [x["output_tok_s"] / y["output_tok_s"] for x, y in zip(dt, t)]
                dec = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(dt, t)
                       if x.get("decode_tok_s") and y.get("decode_tok_s")]
                per_cpu = [x["decode_tok_per_cpu_s"] / y["decode_tok_per_cpu_s"] for x, y in zip(dt, t)
                           if x.get("decode_tok_per_cpu_s") and y.get("decode_tok_per_cpu_s")]
                row = {**base, "shape": name, "batch": B, "kind": "ratio",
                       "decode_per_cpu_s_ratio": statistics.median(per_cpu) if per_cpu else None,
                       "throughput_output_tok_s": statistics.median(y["output_tok_s"] for y in t),
                       "deterministic_output_tok_s": statistics.median(x["output_tok_s"] for x in dt),
                       "ratio": statistics.median(ratios), "ratios": ratios, "cost": 1 - statistics.median(ratios),
                       "decode_ratio": statistics.median(dec) if dec else None}
                rows.append(row)
                if args.out:
                    append_jsonl(args.out, [row])
            for recipe in list(llms):
                free(llms.pop(recipe))
    return rows


def table(rows: list) -> str:
    lines = ["| shape | batch | baseline | baseline tok/s | deterministic tok/s | ratio | cost | decode ratio "
             "| decode per CPU-s ratio |", "|---|---|---|---|---|---|---|---|---|"]

    def f(v):
        return f"{v:.3f}" if v is not None else "-"

    for r in rows:
        if r.get("kind") == "ratio":
            lines.append(f"| {r['shape']} | {r['batch']} | {r.get('baseline', 'throughput')} | "
                         f"{r['throughput_output_tok_s']:.1f} | "
                         f"{r['deterministic_output_tok_s']:.1f} | {r['ratio']:.3f} | {100 * r['cost']:.1f}% | "
                         f"{f(r.get('decode_ratio'))} | {f(r.get('decode_per_cpu_s_ratio'))} |")
    return "\n".join(lines)


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "ced-bench"] if cuda else ["demo"],
                    help="llama-3.1-8b, llama-tiny, ced-bench, ced-toy, ... or demo (the bundled model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--in-len", type=int, default=128 if cuda else 32)
    ap.add_argument("--out-len", type=int, default=128 if cuda else 16)
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (the CPU run)")
    ap.add_argument("--pairs", type=int, default=1 if cuda else 3,
                    help="measurements of each recipe per batch, alternating; the ratio is the median of the pairs'")
    ap.add_argument("--baseline", choices=BASELINES, default="throughput",
                    help="throughput, or kernels-off: the deterministic recipe with batch_invariant=False")
    ap.add_argument("--kv-gb", type=float, default=12.0, help="CUDA: KV cache of each engine (both stay alive)")
    ap.add_argument("--out", default="determinism_bench.jsonl", help="JSONL file to append rows to ('' = none)")
    ap.add_argument("--commit", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.commit is None:
        import subprocess

        res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        args.commit = res.stdout.strip() or "?"
    rows = run(args)
    print(table(rows))
    if args.out:
        print(f"rows: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
