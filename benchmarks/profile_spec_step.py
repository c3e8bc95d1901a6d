"""Where a speculative decode step's wall time goes, beside a plain decode step of the same engine target.

    python benchmarks/profile_spec_step.py --out $OUT/spec_profile.jsonl          # the H200 (~1 min)
    python benchmarks/profile_spec_step.py --device cpu --concurrency 1 --steps 8  # CPU smoke

For each setting (``none``, ``dspark:4`` ...) of the demo target (or ``--targets``, as benchmarks/spec_sweep.py
builds them) at each concurrency: steady decode as in spec_sweep.py, then ``--steps`` steps with the engine's
phases timed by wrapping its methods: ``propose`` (the drafter, drafts to the host), ``launch`` (schedule,
inputs, the forward and acceptance queued; without propose), ``wait`` (the step's event: the device's share
left once the host is done), ``collect`` (acceptance folded, host stages; without wait). Then the same number
of steps under torch.profiler for the device's busy time (kernel time summed), and under cProfile for the
host functions with the most own time. One JSONL row per setting and concurrency, and a table.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402
import spec_sweep  # noqa: E402  (its targets' builder)
from deepinfer import bench_sweep  # noqa: E402


class PhaseTimer:
    """Wraps engine methods (on the instance) and torch.cuda.Event.synchronize, summing wall time per phase."""

    def __init__(self, eng):
        self.eng, self.totals, self._saved = eng, defaultdict(float), []

    def _wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.totals[phase] += time.perf_counter() - t0

        self._saved.append((obj, name, fn, name in vars(obj)))
        setattr(obj, name, timed)

    def __enter__(self):
        self._wrap(self.eng, "_propose_drafts", "propose")
        self._wrap(self.eng, "_launch", "launch+propose")
        self._wrap(self.eng, "_collect_step", "collect+wait")
        if torch.cuda.is_available():
            self._wrap(torch.cuda.Event, "synchronize", "wait")
        return self

    def __exit__(self, *exc):
        for obj, name, fn, own in reversed(self._saved):
            if own or isinstance(obj, type):
                setattr(obj, name, fn)
            else:
                delattr(obj, name)  # the instance attribute shadowed the class's method

    def per_step(self, steps: int) -> dict:
        t = self.totals
        return {"propose_ms": 1e3 * t["propose"] / steps,
                "launch_ms": 1e3 * (t["launch+propose"] - t["propose"]) / steps,
                "wait_ms": 1e3 * t["wait"] / steps,
                "collect_ms": 1e3 * (t["collect+wait"] - t["wait"]) / steps}


def device_busy_ms(eng, steps: int) -> float | None:
    """Kernel time per step under torch.profiler (None on the CPU)."""
    if eng.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e3 / steps


def host_top(eng, steps: int, n: int) -> list:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    pr.disable()
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [{"fn": f"{Path(f).name}:{line}:{name}", "calls_per_step": round(cc / steps, 1),
             "own_ms_per_step": round(1e3 * tt / steps, 4), "cum_ms_per_step": round(1e3 * ct / steps, 4)}
            for (f, line, name), (cc, nc, tt, ct, _) in rows]


def profile_one(llm, vocab: int, C: int, args) -> dict:
    run = bench_sweep.Run(llm, vocab, C, args, args.seed)
    eng = run.eng
    try:
        gpu_bench.sync(eng.device)
        t0 = time.perf_counter()
        with PhaseTimer(eng) as timer:
            for _ in range(args.steps):
                eng.step()
            gpu_bench.sync(eng.device)
        step_ms = 1e3 * (time.perf_counter() - t0) / args.steps
        row = {"concurrency": C, "steps": args.steps, "step_ms": round(step_ms, 4),
               **{k: round(v, 4) for k, v in timer.per_step(args.steps).items()},
               "device_busy_ms": device_busy_ms(eng, args.steps),
               "host_top": host_top(eng, args.steps, args.top)}
    finally:
        run.stop()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", default=["demo"], choices=sorted(spec_sweep.DEFAULT_SETTINGS))
    ap.add_argument("--settings", nargs="+", default=["none", "dspark:4"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="spec_profile.jsonl")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--model", default=None, help="the checkpoint of target 'path' (as in spec_sweep.py)")
    ap.add_argument("--text-prompts", action="store_true", help="prompts from the model's heldout text")
    args = ap.parse_args(argv)
    if "path" in args.targets and not args.model:
        ap.error("target 'path' needs --model DIR")
    # what bench_sweep.Run and spec_sweep.build read
    args.input_len, args.motif, args.warmup_steps, args.rounds, args.sync_steps = 256, 24, 32, 4, 0
    args.seed = 0
    args.text = bench_sweep.load_text(args.model) if args.text_prompts else None
    rows = []
    for target in args.targets:
        for setting in args.settings:
            spec = bench_sweep.parse_setting(setting)
            with tempfile.TemporaryDirectory() as d:
                llm, vocab = spec_sweep.build(target, spec, args, Path(d))
            vocab = vocab or llm.engine.model.vocab_size
            for C in args.concurrency:
                row = {"bench": "benchmarks/profile_spec_step.py", "target": target, "setting": setting,
                       "device": args.device, "commit": args.commit, **profile_one(llm, vocab, C, args)}
                rows.append(row)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            del llm
            gpu_bench.free_memory(args.device)
    print(f"{'target':>8} {'setting':>16} {'C':>4} {'step':>8} {'propose':>8} {'launch':>8} {'wait':>8} "
          f"{'collect':>8} {'busy':>8}  (ms per step)")
    for r in rows:
        busy = "" if r["device_busy_ms"] is None else f"{r['device_busy_ms']:.3f}"
        print(f"{r['target']:>8} {r['setting']:>16} {r['concurrency']:4d} {r['step_ms']:8.3f} {r['propose_ms']:8.3f} "
              f"{r['launch_ms']:8.3f} {r['wait_ms']:8.3f} {r['collect_ms']:8.3f} {busy:>8}")
    for r in rows:
        print(f"-- {r['target']} {r['setting']} C={r['concurrency']}: host functions by own time (ms/step)")
        for h in r["host_top"][:12]:
            print(f"   {h['own_ms_per_step']:8.4f} {h['calls_per_step']:7.1f}x  {h['fn']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
