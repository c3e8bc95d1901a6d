"""Online calibration of predicted draft survival (core/survival_calibration.py): identity with no history,
converges to the observed survival per position, stays a survival (in [0, 1], never rising)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.core.survival_calibration import SurvivalCalibration


def test_no_history_leaves_the_prediction_as_is():
    assert SurvivalCalibration().apply([0.9, 0.5, 0.2]) == [0.9, 0.5, 0.2]


def test_an_underconfident_drafter_is_scaled_up_to_what_stands():
    cal, rng = SurvivalCalibration(), random.Random(0)
    true = [0.8, 0.6, 0.45]  # drafts 1..i all stand with these probabilities
    for _ in range(3000):
        u = rng.random()
        accepted = sum(1 for s in true if u < s)  # one draw: draft i stands iff u < S_i (nested events)
        cal.record([s / 2 for s in true], accepted)  # the drafter claims half
    got = cal.apply([s / 2 for s in true])
    assert all(abs(g - s) < 0.06 for g, s in zip(got, true)), got


def test_an_overconfident_drafter_is_scaled_down():
    cal = SurvivalCalibration()
    for _ in range(2000):
        cal.record([0.9, 0.8], 0)  # never stands
    got = cal.apply([0.9, 0.8])
    assert got[0] <= 0.9 * 0.25 + 1e-9 and got[1] <= got[0]  # down to the floor factor


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.lists(st.floats(0, 1), min_size=1, max_size=5), st.integers(0, 5)), max_size=40),
       st.lists(st.floats(0, 1), min_size=1, max_size=6))
def test_calibrated_survival_is_a_survival(history, survival):
    cal = SurvivalCalibration()
    for s, a in history:
        cal.record(sorted(s, reverse=True), min(a, len(s)))
    got = cal.apply(sorted(survival, reverse=True))
    assert len(got) == len(survival) and all(0 <= g <= 1 for g in got)
    assert all(a >= b for a, b in zip(got, got[1:]))
