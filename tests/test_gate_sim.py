"""benchmarks/gate_sim.py: the gate simulated against fixed lengths and plain decoding, without a model."""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gate_sim  # noqa: E402

from deepinfer.core.draft_gate import DraftGate  # noqa: E402


class Always(DraftGate):
    def __init__(self, choice: bool):
        super().__init__()
        self.choice = choice

    def open(self, rows: int) -> bool:
        return self.choice


def test_a_gate_that_never_drafts_is_plain_decoding_and_one_that_always_does_is_fixed():
    # plain: rows tokens per unit step time, the time jittered by at most 3%
    dyn, fixed, plain = gate_sim.simulate(Always(False), 16, 2.0, [(10**9, 0.6)], 400, random.Random(1))
    assert plain == 16 and abs(dyn / plain - 1) <= 0.03
    # drafting every step: fixed lengths' rate, over the same acceptance (independent draws)
    dyn, fixed, plain = gate_sim.simulate(Always(True), 64, 2.0, [(10**9, 0.6)], 400, random.Random(2))
    assert abs(dyn / fixed - 1) <= 0.05
    p = 0.6
    expected = (64 * (1 + sum(p ** i for i in range(1, gate_sim.K + 1)))) / 2.0  # tokens per unit time
    assert abs(fixed / expected - 1) <= 0.03


def test_the_gate_beats_the_losing_kind_where_the_margin_is_wide(capsys):
    # padded demo at 128 rows: drafting costs 4.8 plain steps for ~2.3 tokens a row; the gate decodes plainly
    ratios = []
    for seed in range(4):
        rng, gate = random.Random(seed), DraftGate()
        gate_sim.simulate(gate, 128, 4.8, [(10**9, 0.68)], 64, rng)
        dyn, fixed, plain = gate_sim.simulate(gate, 128, 4.8, [(10**9, 0.68)], 320, rng)
        ratios.append((dyn / plain, dyn / fixed))
    assert all(p > 0.95 and f > 1.5 for p, f in ratios)
    assert gate_sim.main(["--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in gate_sim.SCENARIOS)
