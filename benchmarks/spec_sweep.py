"""Speculative decoding sweep: steady decode with and without drafts, fixed vs dynamic lengths, over concurrency.

    python benchmarks/spec_sweep.py --out $OUT/spec_sweep.jsonl --commit <sha>        # the H200 run (< 8 min)
    python benchmarks/spec_sweep.py --smoke --out /tmp/spec_sweep.jsonl               # CPU: tiny model, seconds

Targets (``--targets``), each built once per setting and freed before the next:
- ``llama-3.1-8b``: the Llama-3.1-8B shape with random bf16 weights (benchmarks/gpu_bench.py builds it), decode
  memory-bound; settings ``none`` and the n-gram drafter (plugins/deepinfer-ngram) at fixed k (its drafts are
  ragged anyway: a sequence with no match drafts nothing that step).
- ``demo``: the bundled CED demo model with its DSpark drafter: ``none``, ``dspark:K`` (fixed k) and
  ``dspark:K:dynamic`` (CED.md's per-request lengths from the confidences and the step-time curve).
- ``llama-tiny``: the same Llama architecture at a few thousand parameters (``--smoke``).
- ``path``: the CED checkpoint at ``--model`` with its drafter in ``dspark/`` (for a target large enough that
  decode is memory-bound: ``scripts/train_demo.py --size bench`` then ``scripts/train_dspark.py --target``).

Workload, prompt-lookup friendly: each prompt is a random motif repeated to ``--input-len`` tokens; greedy,
ignore_eos. At each concurrency C: C requests at once, stepped until every one has its first token and then
``--warmup-steps`` more (untimed), then ``--steps`` steps timed. A row gives the measured step rate, the output
tokens actually emitted (accepted drafts plus one target token per row-step: counted, not derived), the draft
accounting of those steps (spec_stats deltas), and ``syncs_per_step``: on CUDA, the synchronizing calls
torch.cuda.set_sync_debug_mode reports over ``--sync-steps`` further steps (benchmarks/profile_decode.py's check;
the collection's event wait is not among them). ``tau_formula`` (1 + k x acceptance) is given only where every
verified row drafted exactly k (fixed length); elsewhere only the measured ``tokens_per_verified_row``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402  (the same shapes and builder)

DEFAULT_SETTINGS = {"llama-3.1-8b": ["none", "ngram:2", "ngram:4"], "llama-tiny": ["none", "ngram:2"],
                    "demo": ["none", "dspark:4", "dspark:4:dynamic"], "path": ["none", "dspark:4", "dspark:4:dynamic"]}


def parse_setting(text: str):
    """'none' -> None; 'METHOD:K[:dynamic]' -> speculative_config."""
    if text == "none":
        return None
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit() or parts[2:] not in ([], ["dynamic"]):
        raise ValueError(f"setting {text!r} is invalid: use none or METHOD:K[:dynamic] (e.g. ngram:4, dspark:4:dynamic)")
    spec = {"method": parts[0], "num_speculative_tokens": int(parts[1]), "dynamic": parts[2:] == ["dynamic"]}
    if parts[0] == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=4)
    return spec


def prompts(rng: random.Random, vocab: int, C: int, n: int, motif: int) -> list:
    out = []
    for _ in range(C):
        m = gpu_bench.random_ids(rng, vocab, motif)
        out.append((m * (n // motif + 1))[:n])
    return out


def text_prompts(rng: random.Random, ids: list, C: int, n: int) -> list:
    """C windows of n tokens at random offsets of a tokenized text (the model's held-out sample)."""
    if len(ids) < n + 1:
        raise ValueError(f"--text-prompts: the text has {len(ids)} tokens, fewer than --input-len {n}")
    return [ids[o:o + n] for o in (rng.randrange(len(ids) - n) for _ in range(C))]


def load_text(model: str) -> list:
    """The checkpoint's heldout_sample.txt (scripts/train_demo.py) through its tokenizer."""
    from tokenizers import Tokenizer

    d = Path(model)
    return Tokenizer.from_file(str(d / "tokenizer.json")).encode((d / "heldout_sample.txt").read_text()).ids


def build(target: str, spec, args, concurrencies: list, tmp: Path):
    from deepinfer import LLM

    max_len = args.input_len + args.warmup_steps * 8 + (args.steps + args.sync_steps + 4) * 6 + 64
    blocks = max(concurrencies) * (-(-max_len // 16) + 1) + 64
    kw = dict(speculative_config=spec, max_model_len=max_len, max_num_seqs=max(concurrencies),
              num_kv_blocks=blocks, block_size=16, cuda_graph_sizes=sorted(set(concurrencies)))
    if target == "demo":
        return LLM(device=args.device, **kw), None
    if target == "path":  # a CED checkpoint with its drafter in dspark/ (scripts/train_demo.py --size bench ...)
        return LLM(args.model, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32", **kw), None
    cfg = gpu_bench.SHAPES[target]
    gpu_bench.write_model_dir(tmp, cfg)
    ns = argparse.Namespace(dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device,
                            backend=None, build_in_dtype="auto")
    return gpu_bench.build_llm(tmp, ns, cfg, **kw)[0], cfg["vocab_size"]


def spec_counts(llm) -> dict:
    st = llm.spec_stats() if llm.engine.spec is not None else {}
    return {k: st.get(k, 0) for k in ("verified_rows", "draft_tokens", "accepted_tokens")}


def count_syncs(eng, steps: int) -> float | None:
    if eng.device.type != "cuda" or steps <= 0:
        return None
    from deepinfer.testing.syncs import synchronizing_calls

    return len(synchronizing_calls(eng.step, steps)) / steps


def measure(llm, vocab: int, C: int, args, seed: int) -> dict:
    """Steady decode of C requests (see the module docstring)."""
    from deepinfer import SamplingParams

    eng = llm.engine
    rng = random.Random(seed * 1009 + C)
    sp = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    rids = [f"s{seed}-{C}-{i}" for i in range(C)]
    reqs = [eng.add_request(r, {"prompt_token_ids": p}, sp)
            for r, p in zip(rids, text_prompts(rng, args.text, C, args.input_len) if args.text is not None
                            else prompts(rng, vocab, C, args.input_len, args.motif))]
    try:
        while not all(r.first_token_time for r in reqs):
            eng.step()
        for _ in range(args.warmup_steps):
            eng.step()
        errors = [r.error for r in reqs if r.error]
        if errors:
            raise RuntimeError(f"{len(errors)} request(s) failed, first: {errors[0]}")
        tokens0, spec0 = sum(len(s.output_token_ids) for r in reqs for s in r.seqs), spec_counts(llm)
        gpu_bench.sync(eng.device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        gpu_bench.sync(eng.device)
        dt = time.perf_counter() - t0
        tokens = sum(len(s.output_token_ids) for r in reqs for s in r.seqs) - tokens0
        spec1 = spec_counts(llm)
        syncs = count_syncs(eng, args.sync_steps)
    finally:
        for r in rids:
            eng.abort(r)
        while eng.has_unfinished():
            eng.step()
    d = {k: spec1[k] - spec0[k] for k in spec1}
    row = {"concurrency": C, "steps": args.steps, "seconds": round(dt, 4), "step_rate": round(args.steps / dt, 2),
           "output_tokens": tokens, "output_tok_s": round(tokens / dt, 1),
           "tokens_per_seq_step": round(tokens / (args.steps * C), 4), "syncs_per_step": syncs, **d}
    if d["verified_rows"]:
        row["acceptance_rate"] = round(d["accepted_tokens"] / max(1, d["draft_tokens"]), 4)
        row["tokens_per_verified_row"] = round(1 + d["accepted_tokens"] / d["verified_rows"], 4)
    graphs = eng.decode_graphs
    row["verify_graph_replays"] = getattr(graphs, "num_verify_replays", None)
    return row


def run(args) -> list:
    rows = []
    t_start = time.perf_counter()
    for target in args.targets:
        settings = args.settings or DEFAULT_SETTINGS[target]
        for setting in settings:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"budget spent: {target} {setting} skipped", flush=True)
                continue
            spec = parse_setting(setting)
            with tempfile.TemporaryDirectory() as d:
                t_build = time.perf_counter()
                llm, vocab = build(target, spec, args, args.concurrency, Path(d))
                build_s = time.perf_counter() - t_build
            vocab = vocab or llm.engine.model.vocab_size
            for C in args.concurrency:
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"budget spent: {target} {setting} C={C} skipped", flush=True)
                    continue
                row = {"bench": "benchmarks/spec_sweep.py", "target": target, "setting": setting,
                       "method": spec["method"] if spec else None, "k": spec["num_speculative_tokens"] if spec else 0,
                       "dynamic": bool(spec and spec["dynamic"]), "device": args.device,
                       "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "input_len": args.input_len, "motif": None if args.text is not None else args.motif,
                       "prompts": "heldout_text" if args.text is not None else "motif", "model": args.model,
                       "commit": args.commit,
                       "build_s": round(build_s, 2), "cuda_graphs": llm.engine.decode_graphs is not None,
                       "overlap": llm.engine.overlap, **measure(llm, vocab, C, args, args.seed)}
                if spec and row.get("verified_rows") and not row["dynamic"] \
                        and row["draft_tokens"] == row["k"] * row["verified_rows"]:
                    row["tau_formula"] = round(1 + row["k"] * row["acceptance_rate"], 4)  # fixed length: it holds
                rows.append(row)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                print(f"{target} {setting} C={C}: {row['step_rate']} steps/s, {row['output_tok_s']} tok/s, "
                      f"{row['tokens_per_seq_step']} tok/seq-step, syncs/step {row['syncs_per_step']}", flush=True)
            del llm
            gpu_bench.free_memory(args.device)
    return rows


def table(rows: list) -> str:
    base = {(r["target"], r["concurrency"]): r["output_tok_s"] for r in rows if r["setting"] == "none"}
    head = f"{'target':>13} {'setting':>17} {'C':>4} {'steps/s':>8} {'tok/s':>9} {'vs none':>7} {'tok/seq-step':>12} " \
           f"{'accept':>6} {'tok/verified':>12} {'syncs/step':>10}"
    lines = [head]
    for r in rows:
        b = base.get((r["target"], r["concurrency"]))
        ratio = f"{r['output_tok_s'] / b:7.2f}" if b else f"{'':>7}"
        acc = r.get("acceptance_rate")
        tpr = r.get("tokens_per_verified_row")
        sy = r["syncs_per_step"]
        lines.append(f"{r['target']:>13} {r['setting']:>17} {r['concurrency']:4d} {r['step_rate']:8.1f} "
                     f"{r['output_tok_s']:9.1f} {ratio} {r['tokens_per_seq_step']:12.3f} "
                     f"{'' if acc is None else f'{acc:.3f}':>6} {'' if tpr is None else f'{tpr:.3f}':>12} "
                     f"{'' if sy is None else f'{sy:.2f}':>10}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", choices=sorted(DEFAULT_SETTINGS), default=None,
                    help="default: llama-3.1-8b demo (--smoke: llama-tiny demo)")
    ap.add_argument("--settings", nargs="+", default=None, help="none | METHOD:K[:dynamic]; default per target")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--motif", type=int, default=24, help="prompts repeat a random motif of this many tokens")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--sync-steps", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new measurement starts after this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="spec_sweep.jsonl")
    ap.add_argument("--smoke", action="store_true", help="CPU, llama-tiny and the demo model, a few steps")
    ap.add_argument("--model", default=None, help="the checkpoint of target 'path' (default: the bundled demo)")
    ap.add_argument("--text-prompts", action="store_true",
                    help="prompts from the model's heldout_sample.txt (CED checkpoints) instead of random motifs")
    args = ap.parse_args(argv)
    if args.targets and "path" in args.targets and not args.model:
        ap.error("target 'path' needs --model DIR")
    args.text = None
    if args.text_prompts:
        from deepinfer.models.loader import resolve_model_path

        args.text = load_text(args.model or resolve_model_path(None))
    if args.smoke:
        args.device, args.targets = "cpu", args.targets or ["llama-tiny", "demo"]
        args.concurrency, args.input_len, args.motif = [1, 3], 24, 6
        args.steps, args.warmup_steps, args.sync_steps = 4, 2, 0
        DEFAULT_SETTINGS["demo"] = ["none", "dspark:2", "dspark:2:dynamic"]
    args.targets = args.targets or ["llama-3.1-8b", "demo"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(table(rows))
    if rows and not args.smoke:
        ok = [r for r in rows if r["syncs_per_step"] is not None]
        if ok:
            print(f"most synchronizing calls per step: {max(r['syncs_per_step'] for r in ok):.2f}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
