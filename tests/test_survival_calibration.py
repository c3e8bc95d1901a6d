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


def test_the_engine_calibrates_only_on_steps_that_verify_every_draft(spec_llama):
    """With a step-time curve that makes every draft too dear, the length choice cuts all of them; one ragged
    step in CALIBRATE_EVERY still verifies every draft, and only those steps reach the calibration."""
    import attrs

    from deepinfer import LLM, SamplingParams
    from deepinfer.core.draft_gate import DraftGate
    from deepinfer.core.survival_calibration import CALIBRATE_EVERY

    class Confident:
        def propose(self, seq, k):
            seq.draft_survival = [0.5 ** (i + 1) for i in range(k)]
            return [seq.token_ids[-1]] * k

    class Dear:  # a step's time in proportion to its tokens: a draft (S <= 1) never raises tokens per second
        def record(self, *a, **k):
            pass

        def __call__(self, tokens, rows=None):
            return max(float(tokens), 1e-3)

    class Open(DraftGate):
        def open(self, rows):
            return True

    # eager: ragged verification, where lengths are cut per row (a padded verify graph verifies all or none)
    llm = LLM(spec_llama, num_kv_blocks=128, block_size=4, enforce_eager=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    eng = llm.engine
    eng.drafter, eng.step_time, eng.draft_gate = Confident(), Dear(), Open()
    eng.survival_cal = SurvivalCalibration()
    eng.spec = attrs.evolve(eng.spec, dynamic=True)
    seen = []
    inner = eng.survival_cal.record
    eng.survival_cal.record = lambda s, a: (seen.append(len(s)), inner(s, a))
    llm.generate([[5, 9, 13, 17, 21]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.spec_stats()
    assert seen and set(seen) == {3}  # full lengths only
    assert stats["num_drafts"] == len(seen)  # every verified row was an exploration step's
    assert len(seen) <= 40 // CALIBRATE_EVERY + 1
