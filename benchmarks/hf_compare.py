"""DeepInfer vs Hugging Face transformers ``generate``: same checkpoint, same prompts, one process.

    python benchmarks/hf_compare.py                       # 32 prompts, 64 in, 64 out, tiny random Llama
    python benchmarks/hf_compare.py --model DIR --repeats 5 --out hf_compare.jsonl

HF runs batched (all prompts in one ``generate`` call, left padding, greedy,
``min_new_tokens = max_new_tokens = output_len``); DeepInfer runs the same
token ids through ``deepinfer.bench.run`` (greedy, min_tokens = max_tokens =
output_len, so EOS is masked exactly as HF's min_new_tokens masks it). Both
are warmed up once, then run ``--repeats`` times in alternating order so
neither pays for a cold start or for a noisy moment alone. The figures of
each engine are from its median run; the ratio is the median of the
per-repeat ratios (each repeat runs both engines back to back). Each run's
CPU time (this thread's: both engines run in it, other processes' load
does not count) is recorded too, with the ratio of CPU times: steadier
than wall time on a shared machine. Greedy
outputs are compared per prompt (padding and batch shape can change float
rounding, so agreement is reported, not asserted).

Writes one JSONL row per engine (settings + measurements + the ratio) and
prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from deepinfer.bench import (ModelTimer, append_jsonl, as_token_ids, format_table, machine_info, random_prompts,
                             read_prompts_file, engine_settings, run, warmup)


class _StepClock:
    """A logits processor that only records when HF produced each step's logits (TTFT = the first)."""

    def __init__(self):
        self.times: list = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def left_pad(prompts: list, pad_id: int) -> tuple:
    """Token id lists -> (input_ids [B, L], attention_mask [B, L]) padded on the left."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, L - len(p):] = 1
    return ids, mask


class HFRunner:
    def __init__(self, path: str, pad_id: int, eos_id):
        import transformers
        from transformers import LogitsProcessorList

        transformers.logging.set_verbosity_error()
        self.transformers_version = transformers.__version__
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.attn = getattr(self.model.config, "_attn_implementation", None)
        self.pad_id, self.eos_id = pad_id, eos_id
        self._plist = LogitsProcessorList

    def generate(self, prompts: list, output_len: int) -> dict:
        ids, mask = left_pad(prompts, self.pad_id)
        clock = _StepClock()
        with torch.inference_mode(), ModelTimer(self.model, methods=("forward",)) as timer, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                                      min_new_tokens=output_len, pad_token_id=self.pad_id, eos_token_id=self.eos_id,
                                      logits_processor=self._plist([clock]), temperature=None, top_p=None, top_k=None)
            wall = time.perf_counter() - t0
        new = out[:, ids.shape[1]:].tolist()
        in_tok = sum(len(p) for p in prompts)
        out_tok = sum(len(t) for t in new)
        steps = len(clock.times)
        ttft = clock.times[0] - t0 if clock.times else float("nan")
        return {
            "wall_s": wall, "steps": steps, "input_tokens": in_tok, "output_tokens": out_tok,
            "output_tok_s": out_tok / wall, "total_tok_s": (in_tok + out_tok) / wall,
            # One batch: every prompt gets its first token at the same moment.
            "ttft_mean_s": ttft, "ttft_p50_s": ttft, "ttft_max_s": ttft,
            "model_ms_per_step": 1000.0 * timer.seconds / max(steps, 1),
            "overhead_ms_per_step": 1000.0 * (wall - timer.seconds) / max(steps, 1),
            "token_ids": new,
        }


def agreement(a: list, b: list) -> dict:
    """Per-prompt greedy agreement: exact matches, and the mean fraction of tokens before the first divergence."""
    exact, prefix = 0, []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        exact += x == y
        prefix.append(n / max(len(x), len(y), 1))
    return {"exact_match_pct": 100.0 * exact / len(a), "common_prefix_pct": 100.0 * statistics.fmean(prefix)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: `deepinfer init-model` tiny in a temp dir)")
    ap.add_argument("--arch", default="llama", help="init-model --arch when --model is not given")
    ap.add_argument("--size", default="tiny", help="init-model --size when --model is not given")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-file", default=None, help="prompt texts, one per line (else random token ids)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the random checkpoint")
    ap.add_argument("--recipe", default="throughput")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each engine, alternating order")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default="hf_compare.jsonl", help="JSONL file to append the rows to ('' = none)")
    args = ap.parse_args(argv)

    from deepinfer import LLM
    from deepinfer.init_model import create_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = None
    path = args.model
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="deepinfer-hf-compare-")
        path = tmp.name
        create_checkpoint(path, arch=args.arch, size=args.size, seed=args.seed)
        print(f"random {args.arch}/{args.size} checkpoint in {path} (seed {args.seed})", file=sys.stderr)

    kw = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    llm = LLM(model=path, recipe=args.recipe, max_model_len=None if args.prompts_file else
              args.input_len + args.output_len, **kw)
    tok = llm.tokenizer
    if args.prompts_file:
        prompts = as_token_ids(tok, read_prompts_file(args.prompts_file, args.num_prompts))
    else:
        prompts = random_prompts(tok, args.num_prompts, args.input_len, args.seed)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_ids[0]
    hf = HFRunner(path, pad_id, list(tok.eos_token_ids) or None)

    # Warm both up once (first-call allocations, lazy imports), then alternate.
    warmup(llm, prompts, 4)
    hf.generate(prompts[:4], 4)
    runs = {"hf": [], "deepinfer": []}
    for r in range(args.repeats):
        order = ("hf", "deepinfer") if r % 2 == 0 else ("deepinfer", "hf")
        for eng in order:
            cpu0 = time.thread_time()
            if eng == "hf":
                runs["hf"].append(hf.generate(prompts, args.output_len))
            else:
                runs["deepinfer"].append(run(llm, prompts, args.output_len, ban_eos=True))
            last = runs[eng][-1]
            last["cpu_s"] = time.thread_time() - cpu0
            print(f"  repeat {r}: {eng:<9} {last['output_tok_s']:8.1f} out tok/s  ({last['wall_s']:.2f} s, "
                  f"{last['cpu_s']:.2f} s CPU)", file=sys.stderr)

    def median_run(rs):
        return sorted(rs, key=lambda x: x["wall_s"])[len(rs) // 2]

    med = {k: median_run(v) for k, v in runs.items()}
    ratios = [d["output_tok_s"] / h["output_tok_s"] for d, h in zip(runs["deepinfer"], runs["hf"])]
    ratio = statistics.median(ratios)
    cpu_ratio = statistics.median(h["cpu_s"] / d["cpu_s"] for d, h in zip(runs["deepinfer"], runs["hf"]))
    agree = agreement(med["deepinfer"]["token_ids"], med["hf"]["token_ids"])

    workload = {
        "bench": "benchmarks/hf_compare.py", "num_prompts": len(prompts),
        "input_len": None if args.prompts_file else args.input_len, "output_len": args.output_len,
        "prompts_file": str(Path(args.prompts_file).resolve()) if args.prompts_file else None,
        "seed": args.seed, "checkpoint": "given" if args.model else f"init-model --arch {args.arch} --size {args.size} "
                                                                    f"--seed {args.seed}",
        "greedy": True, "eos": "masked until output_len (HF min_new_tokens; DeepInfer min_tokens)",
        "repeats": args.repeats, "warmups": 1,
        "deepinfer_over_hf_output_tok_s": ratio, "ratios_per_repeat": ratios,
        "deepinfer_over_hf_by_cpu_time": cpu_ratio, **agree,
    }
    settings = engine_settings(llm)
    common = {k: settings[k] for k in ("model", "arch", "device", "dtype")}
    machine = machine_info()
    rows = []
    for eng in ("hf", "deepinfer"):
        m = {k: v for k, v in med[eng].items() if k != "token_ids"}
        if eng == "hf":
            extra = {**common, "backend": f"transformers {hf.transformers_version} ({hf.attn})",
                     "batching": f"one generate() call, batch {len(prompts)}, left padding"}
        else:
            extra = settings
        rows.append({**workload, "engine": eng, **extra, **m,
                     "runs_output_tok_s": [x["output_tok_s"] for x in runs[eng]], **machine})
    print(format_table(rows))
    print(f"\nDeepInfer / HF output tokens/s: {ratio:.2f}x  (per repeat: {', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"DeepInfer / HF by CPU time (HF's CPU s / DeepInfer's): {cpu_ratio:.2f}x")
    print(f"greedy agreement: {agree['exact_match_pct']:.1f}% of prompts identical, "
          f"{agree['common_prefix_pct']:.1f}% of tokens before the first divergence")
    print(f"engine overhead per step: DeepInfer {med['deepinfer']['overhead_ms_per_step']:.2f} ms, "
          f"HF {med['hf']['overhead_ms_per_step']:.2f} ms  (threads: {machine['torch_threads']})")
    if args.out:
        append_jsonl(args.out, rows)
        print(f"wrote {len(rows)} rows to {args.out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
