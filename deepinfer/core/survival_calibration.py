"""Online calibration of a drafter's predicted survival (dynamic speculation's S_i, the probability that drafts
1..i all stand).

Dynamic lengths (core/speculative.py: choose_lengths) admit a draft slot when its S_i, priced by the step-time
curve, raises tokens per second; a confidence head that is under- or over-confident cuts drafts that would
have stood, or verifies drafts that will not. The calibration compares, per draft position, the survival the
drafter predicted for verified rows with what happened (draft i stood or not) and scales later predictions by
the ratio: S'_i = min(1, S_i * f_i), f_i = (stood_i + PRIOR) / (predicted_i + PRIOR) over an exponentially
decayed history, kept non-increasing in i as a survival must be. With no history f_i = 1 (the drafter as is).
Only steps that verified every draft are recorded: one dynamic drafting step in CALIBRATE_EVERY, which the engine
runs at full lengths (on padded verify graphs every step verifies every draft, and one in CALIBRATE_EVERY is
recorded: the per-row bookkeeping on every step took ~0.1 ms at 16 rows, of the order of 1% of a step). The
rows a length choice kept are those the drafter rated highest, and their outcomes say nothing of the slots it
cut.
"""

from __future__ import annotations

PRIOR = 4.0  # pseudo-rows at ratio 1: a few verified rows cannot swing the factor far
DECAY = 0.995  # per recorded row: the history is the last few hundred rows
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0
CALIBRATE_EVERY = 8  # one dynamic drafting step in this many verifies every draft and is recorded (unbiased)


class SurvivalCalibration:
    def __init__(self):
        self.predicted: list = []  # per position, decayed sum of predicted S_i over verified rows
        self.stood: list = []  # per position, decayed count of rows whose draft i stood

    def record(self, survival: list, accepted: int) -> None:
        """A verified row: the survival predicted for its len(survival) drafts, and how many stood."""
        grow = len(survival) - len(self.predicted)
        if grow > 0:
            self.predicted.extend([0.0] * grow)
            self.stood.extend([0.0] * grow)
        for i, s in enumerate(survival):
            self.predicted[i] = self.predicted[i] * DECAY + float(s)
            self.stood[i] = self.stood[i] * DECAY + (1.0 if accepted > i else 0.0)

    def factor(self, i: int) -> float:
        if i >= len(self.predicted):
            return 1.0
        f = (self.stood[i] + PRIOR) / (self.predicted[i] + PRIOR)
        return min(max(f, MIN_FACTOR), MAX_FACTOR)

    def apply(self, survival: list) -> list:
        """The calibrated survival: each S_i scaled by its position's factor, at most 1, never rising."""
        out, last = [], 1.0
        for i, s in enumerate(survival):
            last = min(last, float(s) * self.factor(i), 1.0)
            out.append(last)
        return out
