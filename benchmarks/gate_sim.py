"""The dynamic speculation gate (core/draft_gate.py) against fixed lengths and plain decoding, simulated.

    python benchmarks/gate_sim.py                       # every scenario, 40 seeds each (~10 s)
    python benchmarks/gate_sim.py --closed-loss 0.005   # the gate with another exploration budget when closed
    python benchmarks/gate_sim.py --switch 0.6          # a switch into plain decoding costing 0.6 T_plain more

No model: each step the gate chooses, a drafting step takes T_draft and a row's drafts stand one after the
other with probability p each (k = 4), a plain step takes T_plain and emits a token per row; times vary by
+-3%. Fixed lengths draft every step, their drafts standing as the gate's would at that step (the same
draws: the ratio measures the gate, not two samples' luck); plain decoding never drafts. The scenarios are
the H200's measured cases (T_draft / T_plain and p set to the figures of docs/benchmarks.md): the host-bound
demo at one and 16 requests (a stretch of bad drafts, then good ones: the demo's first prompts), the
memory-bound padded demo at 1 to 128. What a gate setting costs, without a device: the median and the 10th
percentile over seeds of dynamic / fixed and dynamic / plain tokens per second, after a 64-step warm-up.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deepinfer.core.draft_gate import DraftGate  # noqa: E402

K = 4
# name: (rows, T_draft / T_plain, [(until step, p)], timed steps)
SCENARIOS = {
    "demo C=1, bad then good": (1, 2.13, [(40, 0.5), (10**9, 0.66)], 144),
    "demo C=1, good": (1, 2.13, [(10**9, 0.62)], 144),
    "demo C=1, bad": (1, 2.13, [(10**9, 0.4)], 144),
    "demo C=16": (16, 2.45, [(10**9, 0.68)], 144),
    "padded C=1": (1, 1.47, [(10**9, 0.45)], 320),
    "padded C=16": (16, 2.15, [(10**9, 0.7)], 320),
    "padded C=64": (64, 3.4, [(10**9, 0.6)], 320),
    "padded C=128": (128, 4.8, [(10**9, 0.68)], 320),
}


def accepted(rng: random.Random, rows: int, p: float) -> int:
    total = 0
    for _ in range(rows):
        a = 0
        while a < K and rng.random() < p:
            a += 1
        total += a
    return total


def simulate(gate: DraftGate, rows: int, t_draft: float, regions: list, steps: int, rng: random.Random,
             switch: float = 0.0) -> tuple:
    """Tokens per second of the gate, of fixed lengths and of plain decoding over ``steps`` steps; the first plain
    step after a drafting step costs ``switch`` T_plain more (the engine's call that launches it, reported to the
    gate as record_switch does)."""
    tok = t = fixed_tok = fixed_t = 0.0
    last = None
    for i in range(steps):
        p = next(q for end, q in regions if i < end)
        jitter = 1 + 0.03 * rng.uniform(-1, 1)
        a = accepted(rng, rows, p)  # the step's drafts stand alike for both (common random numbers)
        if gate.open(rows):
            gate.record_step(True, rows, t_draft * jitter)
            gate.record_accepted(rows, a)
            tok, t = tok + rows + a, t + t_draft * jitter
            if last is False and switch:
                gate.record_switch(False, (1 + t_draft) * jitter, plain_rows=rows, draft_rows=rows)
            last = True
        else:
            gate.record_step(False, rows, jitter)
            tok, t = tok + rows, t + jitter
            if last is True and switch:
                t += switch * jitter
                gate.record_switch(True, switch * jitter)
            last = False
        fixed_tok, fixed_t = fixed_tok + rows + a, fixed_t + t_draft
    return tok / t, fixed_tok / fixed_t, float(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--open-loss", type=float, default=None, help="DraftGate explore_loss (default: the gate's)")
    ap.add_argument("--closed-loss", type=float, default=None, help="DraftGate explore_loss_closed")
    ap.add_argument("--z", type=float, default=None, help="DraftGate z (default: the gate's)")
    ap.add_argument("--switch", type=float, default=0.0,
                    help="what the first plain step after a drafting step costs beyond T_plain, in T_plain (H200, "
                         "padded demo, one request: ~0.6)")
    args = ap.parse_args(argv)
    kw = {k: v for k, v in (("explore_loss", args.open_loss), ("explore_loss_closed", args.closed_loss),
                            ("z", args.z)) if v is not None}
    print(f"{'scenario':>26} {'fixed/plain':>11} {'dyn/fixed':>9} {'p10':>6} {'dyn/plain':>9} {'p10':>6}")
    for name, (rows, t_draft, regions, steps) in SCENARIOS.items():
        vs_fixed, vs_plain, fixed_plain = [], [], []
        for seed in range(args.seeds):
            rng, gate = random.Random(seed), DraftGate(**kw)
            simulate(gate, rows, t_draft, [(64, regions[0][1])], 64, rng, args.switch)  # warm-up, first stretch
            dyn, fixed, plain = simulate(gate, rows, t_draft, regions, steps, rng, args.switch)
            vs_fixed.append(dyn / fixed)
            vs_plain.append(dyn / plain)
            fixed_plain.append(fixed / plain)
        p10 = max(0, len(vs_fixed) // 10 - 1)
        print(f"{name:>26} {statistics.median(fixed_plain):11.3f} {statistics.median(vs_fixed):9.3f} "
              f"{sorted(vs_fixed)[p10]:6.3f} {statistics.median(vs_plain):9.3f} {sorted(vs_plain)[p10]:6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
