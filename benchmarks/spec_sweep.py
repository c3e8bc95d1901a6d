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
``--warmup-steps`` more (untimed), then ``--steps`` steps timed (with ``--rounds R`` > 1, every setting's engine
stays alive and each is timed in R blocks of ``--steps``, alternating, so machine drift weighs on all alike;
``--fresh-rounds`` starts new requests on new prompts each round, the same for every setting, so each round
compares the settings on the same text). A row gives the measured step rate, the output
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
import statistics
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
    """'none' -> None; 'METHOD:K[:dynamic]' -> speculative_config. A suffix '#LABEL' names a second engine of the
    same setting (e.g. dspark:4#b beside dspark:4: what two identical engines differ by, the control for a ratio)."""
    text = text.split("#", 1)[0]
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

    # room for every timed step of every round (at most k + 1 <= 6 tokens a step): a request that reached
    # max_model_len would finish inside a timed block (an H200 run's third rounds ran 2-4x slower so)
    max_len = args.input_len + args.warmup_steps * 8 + (args.steps * args.rounds + args.sync_steps + 4) * 6 + 64
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


class Run:
    """C requests decoding steadily in one engine: started and warmed, then timed in blocks of steps."""

    def __init__(self, llm, vocab: int, C: int, args, seed: int):
        from deepinfer import SamplingParams

        self.llm, self.eng, self.C, self.args = llm, llm.engine, C, args
        rng = random.Random(seed * 1009 + C)
        sp = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
        self.rids = [f"s{seed}-{C}-{i}" for i in range(C)]
        self.reqs = [self.eng.add_request(r, {"prompt_token_ids": p}, sp)
                     for r, p in zip(self.rids, text_prompts(rng, args.text, C, args.input_len) if args.text is not None
                                     else prompts(rng, vocab, C, args.input_len, args.motif))]
        self.seconds, self.steps, self.tokens, self.rates, self.block_tok_s = 0.0, 0, 0, [], []
        self.block_plain = []  # a dynamic engine's steps its gate kept plain, per block
        # each timed call's wall and its start to the next call's start, by the kind of step it launched
        # ("plain" / "draft"): what the gate's timing rule sees, beside what a step costs in the stream
        self.calls = {"plain": [], "draft": []}
        self.periods = {"plain": [], "draft": []}
        self.stopped = False
        self.spec = {k: 0 for k in spec_counts(llm)}
        while not all(r.first_token_time for r in self.reqs):
            self.eng.step()
        for _ in range(args.warmup_steps):
            self.eng.step()
        errors = [r.error for r in self.reqs if r.error]
        if errors:
            raise RuntimeError(f"{len(errors)} request(s) failed, first: {errors[0]}")

    def _emitted(self) -> int:
        return sum(len(s.output_token_ids) for r in self.reqs for s in r.seqs)

    def block(self, steps: int) -> None:
        """``steps`` timed steps, added to the totals."""
        tokens0, spec0 = self._emitted(), spec_counts(self.llm)
        gate = self.eng.draft_gate
        closed0 = gate.closed if gate is not None else 0
        gpu_bench.sync(self.eng.device)
        t0 = time.perf_counter()
        drafts, starts, walls, kinds = self.eng.drafter is not None, [], [], []
        for _ in range(steps):
            c0 = gate.closed if gate is not None else 0
            t = time.perf_counter()
            self.eng.step()
            starts.append(t)
            walls.append(time.perf_counter() - t)
            kinds.append("draft" if drafts and (gate is None or gate.closed == c0) else "plain")
        gpu_bench.sync(self.eng.device)
        dt = time.perf_counter() - t0
        for i, kind in enumerate(kinds[:-1]):
            self.calls[kind].append(walls[i])
            self.periods[kind].append(starts[i + 1] - starts[i])
        self.seconds, self.steps, self.tokens = self.seconds + dt, self.steps + steps, self.tokens + self._emitted() - tokens0
        self.spec = {k: v + spec_counts(self.llm)[k] - spec0[k] for k, v in self.spec.items()}
        self.rates.append(round(steps / dt, 2))
        self.block_tok_s.append(round((self._emitted() - tokens0) / dt, 2))
        if gate is not None:
            self.block_plain.append(gate.closed - closed0)

    def stop(self) -> None:
        """Abort the requests and step until the engine has nothing left."""
        self.stopped = True
        for r in self.rids:
            self.eng.abort(r)
        while self.eng.has_unfinished():
            self.eng.step()

    def absorb(self, other: "Run") -> None:
        """Add another (stopped) run's timed blocks, same engine and C, to this one's totals."""
        self.seconds, self.steps, self.tokens = self.seconds + other.seconds, self.steps + other.steps, \
            self.tokens + other.tokens
        self.spec = {k: v + other.spec[k] for k, v in self.spec.items()}
        self.rates += other.rates
        self.block_tok_s += other.block_tok_s
        self.block_plain += other.block_plain
        for k in self.calls:
            self.calls[k] += other.calls[k]
            self.periods[k] += other.periods[k]

    def finish(self) -> dict:
        syncs = None if self.stopped else count_syncs(self.eng, self.args.sync_steps)  # (fresh rounds: none left)
        self.stop()
        d, dt, C = self.spec, self.seconds, self.C
        row = {"concurrency": C, "steps": self.steps, "seconds": round(dt, 4), "step_rate": round(self.steps / dt, 2),
               "block_step_rates": self.rates, "block_output_tok_s": self.block_tok_s,
               "output_tokens": self.tokens, "output_tok_s": round(self.tokens / dt, 1),
               "tokens_per_seq_step": round(self.tokens / (self.steps * C), 4), "syncs_per_step": syncs, **d}
        if d["verified_rows"]:
            row["acceptance_rate"] = round(d["accepted_tokens"] / max(1, d["draft_tokens"]), 4)
            row["tokens_per_verified_row"] = round(1 + d["accepted_tokens"] / d["verified_rows"], 4)
        row["verify_graph_replays"] = getattr(self.eng.decode_graphs, "num_verify_replays", None)
        row["call_ms"] = {k: round(1e3 * statistics.median(v), 4) for k, v in self.calls.items() if v}
        row["period_ms"] = {k: round(1e3 * statistics.median(v), 4) for k, v in self.periods.items() if v}
        gate = self.eng.draft_gate
        if gate is not None and gate.gain is not None and len(gate.plain) and len(gate.drafting):
            # what the gate saw at this C when the run ended: why it drafted or not
            row["gate"] = {"block_plain_steps": self.block_plain, "gain": round(gate.gain, 4),
                           "time_ratio": round(gate.time_ratio(C), 4), "paired": gate.paired(C),
                           "ratio": round(gate.ratio(C), 4), "explore_after": round(gate.explore_after(C), 1),
                           "t_plain_ms": round(1e3 * gate.plain(C), 4), "t_draft_ms": round(1e3 * gate.drafting(C), 4),
                           "gain_se": round(gate.gain_se(), 4), "switch_ms": round(1e3 * gate.switch_cost(), 4),
                           "closed_steps": gate.closed, "decisions": gate.decisions}
        return row


def measure(llm, vocab: int, C: int, args, seed: int) -> dict:
    """Steady decode of C requests (see the module docstring)."""
    run = Run(llm, vocab, C, args, seed)
    try:
        run.block(args.steps)
    finally:
        row = run.finish()
    return row


def header(target: str, setting: str, spec, args, llm, build_s: float) -> dict:
    return {"bench": "benchmarks/spec_sweep.py", "target": target, "setting": setting,
            "method": spec["method"] if spec else None, "k": spec["num_speculative_tokens"] if spec else 0,
            "dynamic": bool(spec and spec["dynamic"]), "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "input_len": args.input_len, "motif": None if args.text is not None else args.motif,
            "prompts": "heldout_text" if args.text is not None else "motif", "model": args.model,
            "commit": args.commit, "rounds": args.rounds, "fresh_rounds": bool(getattr(args, "fresh_rounds", False)),
            "build_s": round(build_s, 2), "cuda_graphs": llm.engine.decode_graphs is not None,
            "overlap": llm.engine.overlap}


def emit(rows: list, row: dict, args) -> None:
    if row.get("method") and row.get("verified_rows") and not row["dynamic"] \
            and row["draft_tokens"] == row["k"] * row["verified_rows"]:
        row["tau_formula"] = round(1 + row["k"] * row["acceptance_rate"], 4)  # fixed length: it holds
    rows.append(row)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    print(f"{row['target']} {row['setting']} C={row['concurrency']}: {row['step_rate']} steps/s, "
          f"{row['output_tok_s']} tok/s, {row['tokens_per_seq_step']} tok/seq-step, syncs/step {row['syncs_per_step']}",
          flush=True)


def run_interleaved(args, target: str, settings: list, rows: list, t_start: float) -> None:
    """Every setting's engine alive at once; at each C, ``--rounds`` rounds of ``--steps`` timed steps in each
    engine in turn (the order rotating), so that a machine whose speed drifts during the run (other work on the
    host, clocks) weighs on every setting alike; totals over the rounds, and each block's rate."""
    built = []
    for setting in settings:
        spec = parse_setting(setting)
        with tempfile.TemporaryDirectory() as d:
            t_build = time.perf_counter()
            llm, vocab = build(target, spec, args, args.concurrency, Path(d))
            built.append((setting, spec, llm, vocab or llm.engine.model.vocab_size, time.perf_counter() - t_build))
    for C in args.concurrency:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget spent: {target} C={C} skipped", flush=True)
            continue
        if args.fresh_rounds:  # each round new requests on new prompts, the same for every setting
            runs = [None] * len(built)
            for r in range(args.rounds):
                for i in range(len(built)):
                    j = (i + r) % len(built)
                    _, _, llm, vocab, _ = built[j]
                    run = Run(llm, vocab, C, args, args.seed + r)
                    run.block(args.steps)
                    run.stop()  # (its requests would run beside the next round's)
                    if runs[j] is None:
                        runs[j] = run
                    else:
                        runs[j].absorb(run)
        else:
            runs = [Run(llm, vocab, C, args, args.seed) for _, _, llm, vocab, _ in built]
            for r in range(args.rounds):
                for i in range(len(runs)):
                    runs[(i + r) % len(runs)].block(args.steps)
        for (setting, spec, llm, _, build_s), run in zip(built, runs):
            emit(rows, {**header(target, setting, spec, args, llm, build_s), **run.finish()}, args)
    del built
    gpu_bench.free_memory(args.device)


def run(args) -> list:
    rows = []
    t_start = time.perf_counter()
    for target in args.targets:
        settings = args.settings or DEFAULT_SETTINGS[target]
        if args.rounds > 1:
            run_interleaved(args, target, settings, rows, t_start)
            continue
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
                emit(rows, {**header(target, setting, spec, args, llm, build_s),
                            **measure(llm, vocab, C, args, args.seed)}, args)
            del llm
            gpu_bench.free_memory(args.device)
    return rows


def paired(rows: list) -> list:
    """For interleaved runs (--rounds > 1): each setting against every earlier one at the same target and C, as the
    median over rounds of the ratio of their output tok/s in that round (their blocks ran back to back), which a
    machine whose speed drifts between rounds moves far less than the ratio of the totals (a 2-core CPU's blocks
    of one setting ranged 11-22 steps/s in one run). Returns (target, C, setting, against, median, ratios)."""
    import statistics

    out = []
    groups: dict = {}
    for r in rows:
        if len(r.get("block_output_tok_s") or []) > 1:
            groups.setdefault((r["target"], r["concurrency"]), []).append(r)
    for (target, C), rs in groups.items():
        for i, a in enumerate(rs):
            for b in rs[:i]:
                ratios = [x / y for x, y in zip(a["block_output_tok_s"], b["block_output_tok_s"]) if y > 0]
                if ratios:
                    out.append((target, C, a["setting"], b["setting"], statistics.median(ratios), ratios))
    return out


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
    pairs = paired(rows)
    if pairs:
        lines.append("paired, median over rounds of the per-round tok/s ratio:")
        lines += [f"{t:>13} C={C:<4d} {a} / {b}: {m:.3f}" for t, C, a, b, m, _ in pairs]
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", choices=sorted(DEFAULT_SETTINGS), default=None,
                    help="default: llama-3.1-8b demo (--smoke: llama-tiny demo)")
    ap.add_argument("--settings", nargs="+", default=None, help="none | METHOD:K[:dynamic][#LABEL]; default per target")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--motif", type=int, default=24, help="prompts repeat a random motif of this many tokens")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: every setting's engine alive at once, timed in this many alternating blocks of --steps "
                         "(settings compared under the same machine drift; needs memory for all of them)")
    ap.add_argument("--fresh-rounds", action="store_true",
                    help="with --rounds: each round starts new requests on new prompts (the same for every setting), "
                         "warmed up and timed, so a round's ratio compares the settings on the same text (otherwise "
                         "a setting that emitted fewer tokens meets later text, whose drafts stand more or less often)")
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
