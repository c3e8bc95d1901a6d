"""`deepinfer bench sweep`: speculative decoding measured in steady decode, over concurrency and draft settings.

At each concurrency C: C requests at once (prompts that repeat a random motif, or windows of a checkpoint's
held-out text), stepped until every one has its first token and then ``warmup_steps`` more (untimed), then
``steps`` steps timed. A row gives the measured step rate, the output tokens actually emitted (one target token per
row-step plus the accepted drafts: counted, not derived), the draft accounting of those steps (spec_stats deltas)
and, on CUDA, the synchronizing calls a step makes. ``tau_formula`` (1 + k x acceptance) is given only where
every verified row drafted exactly k (fixed length); elsewhere (dynamic lengths, a drafter with nothing to propose
for some rows) only the measured ``tokens_per_verified_row``: tau holds only for fixed-length drafts
(``deepinfer bench sweep-plot`` refuses it for the others, deepinfer/sweep_plot.py). With ``rounds`` > 1 every
setting's engine stays alive and each is timed in that many alternating blocks (drift weighs on all alike;
``paired`` gives each setting against the others as the median of per-round ratios); ``fresh_rounds`` starts new
requests on new prompts each round, the same for every setting. benchmarks/spec_sweep.py runs the same
measurement on the GPU bench's model shapes.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from .bench import append_jsonl, free_memory, random_ids, sync


def parse_setting(text: str):
    """'none' -> None; 'METHOD:K[:dynamic]' -> speculative_config. A suffix '#LABEL' names a second engine of the
    same setting (e.g. dspark:4#b beside dspark:4: what two identical engines differ by, the control for a ratio)."""
    text = text.split("#", 1)[0]
    if text == "none":
        return None
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit() or parts[2:] not in ([], ["dynamic"]):
        raise ValueError(f"setting {text!r} is invalid: use none or METHOD:K[:dynamic][#LABEL] (e.g. ngram:4, "
                         "dspark:4:dynamic)")
    spec = {"method": parts[0], "num_speculative_tokens": int(parts[1]), "dynamic": parts[2:] == ["dynamic"]}
    if parts[0] == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=4)
    return spec


def prompts(rng: random.Random, vocab: int, C: int, n: int, motif: int) -> list:
    out = []
    for _ in range(C):
        m = random_ids(rng, vocab, motif)
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
        sync(self.eng.device)
        t0 = time.perf_counter()
        drafts, starts, walls, kinds = self.eng.drafter is not None, [], [], []
        for _ in range(steps):
            c0 = gate.closed if gate is not None else 0
            t = time.perf_counter()
            self.eng.step()
            starts.append(t)
            walls.append(time.perf_counter() - t)
            kinds.append("draft" if drafts and (gate is None or gate.closed == c0) else "plain")
        sync(self.eng.device)
        dt = time.perf_counter() - t0
        for i, kind in enumerate(kinds[:-1]):
            self.calls[kind].append(walls[i])
            self.periods[kind].append(starts[i + 1] - starts[i])
        self.seconds, self.steps = self.seconds + dt, self.steps + steps
        emitted, spec1 = self._emitted() - tokens0, spec_counts(self.llm)
        self.tokens += emitted
        self.spec = {k: v + spec1[k] - spec0[k] for k, v in self.spec.items()}
        self.rates.append(round(steps / dt, 2))
        self.block_tok_s.append(round(emitted / dt, 2))
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
    return {"bench": getattr(args, "bench", "deepinfer bench sweep"), "target": target, "setting": setting,
            "method": spec["method"] if spec else None, "k": spec["num_speculative_tokens"] if spec else 0,
            "dynamic": bool(spec and spec["dynamic"]), "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "input_len": args.input_len, "motif": None if args.text is not None else args.motif,
            "prompts": "heldout_text" if args.text is not None else "motif", "model": args.model,
            "commit": getattr(args, "commit", None), "rounds": args.rounds,
            "fresh_rounds": bool(getattr(args, "fresh_rounds", False)),
            "build_s": round(build_s, 2), "cuda_graphs": llm.engine.decode_graphs is not None,
            "overlap": llm.engine.overlap}


def emit(rows: list, row: dict, args) -> None:
    if row.get("method") and row.get("verified_rows") and not row["dynamic"] \
            and row["draft_tokens"] == row["k"] * row["verified_rows"]:
        row["tau_formula"] = round(1 + row["k"] * row["acceptance_rate"], 4)  # fixed length: it holds
    rows.append(row)
    if args.out:
        append_jsonl(args.out, [row])
    print(f"{row['target']} {row['setting']} C={row['concurrency']}: {row['step_rate']} steps/s, "
          f"{row['output_tok_s']} tok/s, {row['tokens_per_seq_step']} tok/seq-step, syncs/step {row['syncs_per_step']}",
          flush=True)


def _built(build: Callable, spec) -> tuple:
    t = time.perf_counter()
    llm, vocab = build(spec)
    return llm, vocab or llm.engine.model.vocab_size, time.perf_counter() - t


def sweep(args, target: str, settings: list, build: Callable, rows: list, t_start: float) -> None:
    """Every setting of ``settings`` at every ``args.concurrency`` on engines from ``build(speculative_config)``
    (-> (llm, vocab or None)); rows appended to ``rows`` (and ``args.out``). With ``args.rounds`` > 1 every
    setting's engine is alive at once and timed in alternating blocks (``_interleaved``); otherwise one engine at a
    time. No new measurement starts after ``args.budget_s``."""
    if args.rounds > 1:
        _interleaved(args, target, settings, build, rows, t_start)
        return
    for setting in settings:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget spent: {target} {setting} skipped", flush=True)
            continue
        spec = parse_setting(setting)
        llm, vocab, build_s = _built(build, spec)
        for C in args.concurrency:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"budget spent: {target} {setting} C={C} skipped", flush=True)
                continue
            emit(rows, {**header(target, setting, spec, args, llm, build_s),
                        **measure(llm, vocab, C, args, args.seed)}, args)
        del llm
        free_memory(args.device)


def _interleaved(args, target: str, settings: list, build: Callable, rows: list, t_start: float) -> None:
    """Every setting's engine alive at once; at each C, ``rounds`` rounds of ``steps`` timed steps in each
    engine in turn (the order rotating), so that a machine whose speed drifts during the run (other work on the
    host, clocks) weighs on every setting alike; totals over the rounds, and each block's rate."""
    built = []
    for setting in settings:
        spec = parse_setting(setting)
        built.append((setting, spec, *_built(build, spec)))
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
    free_memory(args.device)


def max_model_len(args) -> int:
    """Room for every timed step of every round (at most k + 1 <= 6 tokens a step): a request that reached
    max_model_len would finish inside a timed block (an H200 run's third rounds ran 2-4x slower so)."""
    return args.input_len + args.warmup_steps * 8 + (args.steps * args.rounds + args.sync_steps + 4) * 6 + 64


def engine_args(args, spec) -> dict:
    """LLM keyword arguments of a sweep engine: its batch and CUDA-graph sizes the sweep's concurrencies, KV blocks
    for all of them at max_model_len."""
    max_len = max_model_len(args)
    concurrencies = args.concurrency
    blocks = max(concurrencies) * (-(-max_len // 16) + 1) + 64
    return dict(speculative_config=spec, max_model_len=max_len, max_num_seqs=max(concurrencies),
                num_kv_blocks=blocks, block_size=16, cuda_graph_sizes=sorted(set(concurrencies)))


def paired(rows: list) -> list:
    """For interleaved runs (--rounds > 1): each setting against every earlier one at the same target and C, as the
    median over rounds of the ratio of their output tok/s in that round (their blocks ran back to back), which a
    machine whose speed drifts between rounds moves far less than the ratio of the totals (a 2-core CPU's blocks
    of one setting ranged 11-22 steps/s in one run). Returns (target, C, setting, against, median, ratios)."""
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


DEFAULT_SETTINGS = ["none", "dspark:4", "dspark:4:dynamic"]


def add_arguments(p) -> None:
    """`deepinfer bench sweep`'s options."""
    p.add_argument("--model", default=None, help="a checkpoint directory (default: the bundled demo model with its "
                                                 "DSpark drafter)")
    p.add_argument("--settings", nargs="+", default=None, metavar="SETTING",
                   help="none | METHOD:K[:dynamic][#LABEL] (default: none dspark:4 dspark:4:dynamic); #LABEL names a "
                        "second engine of the same setting (a control)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--motif", type=int, default=24, help="prompts repeat a random motif of this many tokens")
    p.add_argument("--text-prompts", action="store_true",
                   help="windows of the checkpoint's heldout_sample.txt instead of random motifs")
    p.add_argument("--steps", type=int, default=32, help="timed steps per block (default 32)")
    p.add_argument("--warmup-steps", type=int, default=32, help="untimed steps first (default 32)")
    p.add_argument("--rounds", type=int, default=1,
                   help="> 1: every setting's engine alive at once, timed in this many alternating blocks")
    p.add_argument("--fresh-rounds", action="store_true", help="with --rounds: new requests on new prompts each round")
    p.add_argument("--sync-steps", type=int, default=0, help="CUDA: steps checked for synchronizing calls (default 0)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="no new measurement starts after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, help="recorded in every row")
    p.add_argument("--out", default=None, metavar="FILE", help="JSONL file to append the rows to")


def check_args(args) -> None:
    """A bad sweep argument is a ValueError naming it, before any engine is built."""
    for name in ("input_len", "steps", "rounds", "motif"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    for name in ("warmup_steps", "sync_steps"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 0")
    bad = [c for c in args.concurrency if c < 1]
    if bad:
        raise ValueError(f"--concurrency {bad[0]} is invalid: must be >= 1")
    if args.fresh_rounds and args.rounds < 2:
        raise ValueError("--fresh-rounds needs --rounds 2 or more")
    for setting in args.settings:
        parse_setting(setting)
    if len(set(args.settings)) != len(args.settings):
        raise ValueError(f"--settings lists {args.settings} with a repeat: give a second engine of a setting a "
                         "#LABEL")


def main(args) -> list:
    """`deepinfer bench sweep`: the rows (also appended to ``args.out``), the table printed."""
    from .core.llm import LLM
    from .models.loader import resolve_model_path

    args.settings = args.settings or list(DEFAULT_SETTINGS)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_args(args)
    model = args.model
    args.model = str(resolve_model_path(model))
    args.text = load_text(args.model) if args.text_prompts else None
    kw = {} if model is None else {"dtype": "bfloat16" if args.device == "cuda" else "float32"}

    def build(spec):
        try:
            return LLM(model, device=args.device, **kw, **engine_args(args, spec)), None
        except ValueError as exc:
            if "max_model_len" not in str(exc):
                raise
            raise ValueError(f"{exc}. The sweep asks max_model_len={max_model_len(args)} so that --input-len, "
                             "--warmup-steps and --rounds x --steps (up to 6 tokens a step) fit: lower them") from None

    rows: list = []
    sweep(args, "demo" if model is None else "path", args.settings, build, rows, time.perf_counter())
    print(table(rows))
    return rows
