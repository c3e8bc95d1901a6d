"""Issue 16's end-to-end check: one prompt run N times among random traffic; how many distinct outputs?

    python benchmarks/determinism_check.py --shape llama-3.1-8b --runs 1000 --out $OUT/determinism_check.jsonl
    python benchmarks/determinism_check.py --shape demo --runs 40 --out rows.jsonl        # CPU smoke

Per recipe (deterministic, then throughput), one engine (random weights as benchmarks/gpu_bench.py builds the
shape; ``demo``: the bundled model). Two targets, each with a fixed prompt: greedy and seeded sampling
(temperature 1, top-p 0.9, seed 42), both asking for logprobs. Rounds until each target has run --runs times:
a round queues ``per-round`` copies of each target and twice as many random requests
(deepinfer.testing.determinism.random_traffic: prompts up to --max-prompt tokens, mixed sampling) in a random
order, and adds them a few at a time while the engine steps, so every copy meets another batch: other
neighbours, another position, prefill chunks beside decodes, prefix-cache hits (every other round starts with
the cache reset, so the first copy of that round is cold). A target's output is its tokens and per-step logprobs
(testing.determinism.Output); the row counts the distinct ones and the size of the largest class. With the
deterministic recipe the guarantee is 1 distinct output per target; the throughput row shows what it gives.
A recipe that runs out of --budget-s stops early and says how many runs it did.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import determinism_bench  # noqa: E402  (the same shapes and builder)

from deepinfer.bench import append_jsonl, machine_info  # noqa: E402
from deepinfer.core.params import SamplingParams  # noqa: E402
from deepinfer.testing.determinism import output_of, random_traffic  # noqa: E402

TARGETS = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, top_p=0.9, seed=42)}


def collect(outs, kinds: dict, seen: dict) -> None:
    for out in outs:
        if out.finished and out.request_id in kinds:
            if out.outputs[0].finish_reason == "error":
                raise RuntimeError(f"a target request failed: {out.outputs[0]}")
            seen[kinds[out.request_id]][output_of(out).key()] += 1


def one_recipe(llm, args, recipe: str, rng: random.Random, vocab: int) -> dict:
    eng = llm.engine
    prompt = [random.Random(args.seed).randrange(vocab) for _ in range(args.target_len)]
    params = {k: SamplingParams(max_tokens=args.target_tokens, logprobs=1, ignore_eos=True, **kw)
              for k, kw in TARGETS.items()}
    seen = {k: collections.Counter() for k in TARGETS}
    t0, rounds, n = time.perf_counter(), 0, 0
    while min(sum(c.values()) for c in seen.values()) < args.runs:
        if time.perf_counter() - t0 > args.budget_s:
            break
        if rounds % 2 == 0:
            llm.reset_prefix_cache()
        want = min(args.per_round, args.runs - min(sum(c.values()) for c in seen.values()))
        prompts, sps = random_traffic(rng, 2 * want, vocab, args.max_prompt, args.max_tokens, lo_token=0)
        queue = [(f"x{rounds}-{i}", None, p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
        queue += [(f"t{rounds}-{k}-{i}", k, prompt, params[k]) for k in TARGETS for i in range(want)]
        rng.shuffle(queue)
        kinds = {rid: k for rid, k, _, _ in queue if k is not None}
        while queue or eng.has_unfinished():
            for _ in range(min(len(queue), rng.randint(0, args.arrivals))):
                rid, _, p, sp = queue.pop()
                eng.add_request(rid, {"prompt_token_ids": p}, sp)
            if eng.has_unfinished():
                collect(eng.step(), kinds, seen)
        collect(eng.sync(), kinds, seen)  # a step still in flight (overlap scheduling)
        rounds += 1
        n = min(sum(c.values()) for c in seen.values())
        print(f"    {recipe}: round {rounds}, {n} runs of each target, distinct "
              f"{ {k: len(c) for k, c in seen.items()} }", flush=True)
    return {"rounds": rounds, "seconds": time.perf_counter() - t0, "seen": seen}


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b" if cuda else "demo")
    ap.add_argument("--recipes", nargs="+", default=["deterministic", "throughput"])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=100, help="copies of each target per round")
    ap.add_argument("--arrivals", type=int, default=24, help="most requests added between two steps")
    ap.add_argument("--target-len", type=int, default=100)
    ap.add_argument("--target-tokens", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256 if cuda else 60)
    ap.add_argument("--max-tokens", type=int, default=48 if cuda else 12)
    ap.add_argument("--max-num-seqs", type=int, default=256 if cuda else 64)
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-gb", type=float, default=30.0, help="CUDA: the engine's KV cache (one engine at a time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=150.0, help="per recipe")
    ap.add_argument("--out", default="determinism_check.jsonl")
    ap.add_argument("--commit", default="?")
    args = ap.parse_args(argv)
    # The builder's knobs: the largest batch sets max_num_seqs; lengths bound max_model_len and the CPU's KV.
    sizes = [b for b in (1, 8, 32, 64, 128) if b < args.max_num_seqs] + [args.max_num_seqs]  # graph sizes
    bargs = argparse.Namespace(batches=sizes, in_len=max(args.max_prompt, args.target_len),
                               out_len=max(args.max_tokens, args.target_tokens), device=args.device,
                               dtype=args.dtype, threads=args.threads, kv_gb=args.kv_gb)
    cfg, name = determinism_bench.shape_config(args.shape, bargs.in_len + bargs.out_len + 16)
    rows = []
    with tempfile.TemporaryDirectory(prefix="deepinfer-det-check-") as d:
        if cfg is not None:
            determinism_bench.gpu_bench.write_model_dir(Path(d), cfg)
        for recipe in args.recipes:
            llm = determinism_bench.build(args.shape, cfg, recipe, bargs, Path(d))
            vocab = llm.engine.model.vocab_size
            res = one_recipe(llm, args, recipe, random.Random(args.seed + 1), vocab)
            for kind, counts in res["seen"].items():
                row = {"bench": "determinism_check", "commit": args.commit, "shape": name, "recipe": recipe,
                       "backend": llm.backend_name, "device": args.device, "dtype": args.dtype, "target": kind,
                       "runs": sum(counts.values()), "distinct": len(counts),
                       "largest_class": max(counts.values()) if counts else 0, "rounds": res["rounds"],
                       "seconds": res["seconds"], "target_len": args.target_len,
                       "target_tokens": args.target_tokens, "per_round": args.per_round,
                       "max_num_seqs": args.max_num_seqs, "max_prompt": args.max_prompt,
                       "batch_invariant": llm.config.batch_invariant,
                       "cuda_graphs": llm.engine.decode_graphs is not None, "overlap": llm.engine.overlap,
                       **machine_info()}
                rows.append(row)
                if args.out:
                    append_jsonl(args.out, [row])
            determinism_bench.free(llm)
    print("| shape | recipe | target | runs | distinct outputs | largest class |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = (r["shape"], r["recipe"], r["target"], r["runs"], r["distinct"], r["largest_class"])
        print("| " + " | ".join(map(str, cells)) + " |")
    bad = [r for r in rows if r["recipe"] == "deterministic" and r["distinct"] != 1]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
