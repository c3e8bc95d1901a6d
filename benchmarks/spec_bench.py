"""Speculative decoding: output tokens/s and tokens per verified row with the n-gram drafter at several k,
against no speculation, on one workload in one run (rounds interleaved so machine noise hits every setting).

    python benchmarks/spec_bench.py --threads 1 --out spec_cpu.jsonl                 # the demo model, CPU
    python benchmarks/spec_bench.py --device cuda --settings none ngram:4 dspark:4 --out $OUT/spec.jsonl  # GPU

Workload: greedy continuations of code prompts that repeat themselves (a function and the start of its copy
with one name changed, as an editing assistant sees), ``--batch`` prompts at once, ``--max-tokens`` each.
Rows: one per (setting, round); the table gives the median tokens/s, the ratio to the first setting (no
speculation by default), the acceptance rate and the measured tokens per verified row. Greedy output is
checked to equal the first setting's for every setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SNIPPETS = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n\n"
    "def mean_of_squares(values):\n    total = 0\n    for v in values:\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n"
    "        return f\"Point({self.x}, {self.y})\"\n\n\nclass Vector:\n    def __init__(self, x, y):\n",
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.read().splitlines()\n\n\n"
    "def read_words(path):\n    with open(path) as f:\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n    else:\n        print(i, 'odd')\n"
    "for j in range(10):\n    if j % 3 == 0:\n",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", nargs="+", default=["none", "ngram:2", "ngram:4"],
                    help="none, or METHOD:K (ngram, dspark, or a plugin's draft stage); the first is the baseline")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="spec_bench.jsonl")
    args = ap.parse_args()
    from deepinfer import LLM, SamplingParams

    prompts = [SNIPPETS[i % len(SNIPPETS)] for i in range(args.batch)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llms = {}
    for setting in args.settings:
        spec = None
        if setting != "none":
            method, k = setting.split(":")
            spec = {"method": method, "num_speculative_tokens": int(k)}
            if method == "ngram":
                spec["prompt_lookup_max"] = 4
        llms[setting] = LLM(device=args.device, threads=args.threads, speculative_config=spec)
        llms[setting].generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    rows, ref = [], None
    for r in range(args.rounds):
        for k, llm in llms.items():
            before = llm.spec_stats() if k != "none" else {}
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            toks = [o.outputs[0].token_ids for o in outs]
            if k == args.settings[0]:
                ref = toks
            after = llm.spec_stats()
            row = {"bench": "spec", "device": args.device, "setting": k, "round": r, "batch": args.batch,
                   "output_tokens": sum(map(len, toks)), "seconds": round(dt, 4),
                   "tokens_per_s": round(sum(map(len, toks)) / dt, 2), "same_as_k0": toks == ref}
            if k != "none":
                d = {key: after[key] - before[key] for key in ("verified_rows", "draft_tokens", "accepted_tokens")}
                row.update(d, acceptance_rate=round(d["accepted_tokens"] / max(1, d["draft_tokens"]), 4),
                           tokens_per_verified_row=round(1 + d["accepted_tokens"] / max(1, d["verified_rows"]), 3))
            rows.append(row)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    base = statistics.median(r["tokens_per_s"] for r in rows if r["setting"] == args.settings[0])
    print(f"{'setting':>9} {'tok/s':>9} {'ratio':>6} {'accept':>7} {'tok/verified row':>17} same")
    for k in args.settings:
        mine = [r for r in rows if r["setting"] == k]
        tps = statistics.median(r["tokens_per_s"] for r in mine)
        acc = statistics.median(r.get("acceptance_rate", 0) for r in mine)
        tpr = statistics.median(r.get("tokens_per_verified_row", 1) for r in mine)
        print(f"{k:>9} {tps:9.1f} {tps / base:6.2f} {acc:7.3f} {tpr:17.3f} {all(r['same_as_k0'] for r in mine)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
