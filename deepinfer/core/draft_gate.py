"""Whether a dynamic speculative step drafts at all.

The per-row choice (core/speculative.py: choose_lengths) is made after the drafter has run, when its forward is
spent: it weighs verifying against decoding plainly with the drafts already paid for. At high concurrency, or
with a drafter whose drafts are rarely accepted, a step that drafts and verifies can emit fewer tokens per second
than a step that does neither, and only a choice made before drafting can take the plain step. The gate makes it
per step, from what the engine measured: the wall time of its recent drafting steps and of its recent plain steps
against their rows (each a line T(R) = a + b R, StepLine, robust to a stray slow step; the median of the steps
measured at about R rows where there are enough of them; their ratio from steps of the two kinds that ran one
after the other where there are enough such pairs, which a drifting machine moves less), and the drafts accepted
per row over the drafting steps' rows, each step's weight halving every GAIN_HALF_LIFE steps. It drafts iff
R (1 + g + Z se) / T_draft(R) > R / T_plain(R), se the standard error of g (``gain_se``): it shuts only on
evidence, which at 64 rows a step comes at once and at one request, a row a step, takes many steps. When the
step then verifies in a padded CUDA graph (every row padded to k + 1 tokens, whatever its drafts), the gate's
choice is the step's: every draft is verified, as cutting one saves no device time, and a second all-or-nothing
choice from the fitted T(n, R) only second-guessed the measured one after the drafter had run (core/engine.py,
_propose_drafts).

Both kinds keep being measured: the first WARM steps draft, then a run of PLAIN_RUN plain steps starts once in
EXPLORE_FIRST steps until WARM_PLAIN plain steps are timed; at a row count where fewer than LOCAL steps of a kind were
measured (within NEAR), the step is of that kind (a line through other row counts guessed wrong: on the H200 one fitted at one request priced
a plain step of 16 rows as one of 1, and shut the gate where drafting ran 1.18x plain); from then on the gate
takes the other kind once in N steps (plain steps in runs of PLAIN_RUN), N set so that the tokens those steps
lose by the measured rates are EXPLORE_LOSS (open) or EXPLORE_LOSS_CLOSED (closed) of what the N steps emit
(``explore_after``): near a tie the losing step costs almost nothing and
is taken often (every EXPLORE_MIN steps), so a gate shut by a run of bad drafts reopens within a few steps; far
from one it is rare (at most EXPLORE_MAX apart). What an exploration loses counts the engine calls that switch
kinds beyond their steps' times (``record_switch``, ``switch_cost``): the first plain step after a synchronous
drafting step starts on an idle device. A fixed period (one in 16 / r steps closed, 64 r open) did
neither: on the H200 a gate that closed on the demo's first prompts (g ~ 1, a tie) stayed shut while drafting
ran 1.28x plain (0.75x fixed lengths), and one rightly closed at 64 rows of a memory-bound model drafted one step
in 20 at 3.4x a plain step's time (-4.6%). A seeded request drafts whatever the gate says (the engine's choices
never depend on timing for it).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Optional

WARM = 8
# plain steps in a row when the gate explores them (or measures them first): under overlap scheduling only a plain
# step launched by a call that collected one is timed, by the call that collects it and launches the next plain
# one (core/engine.py, Engine.step: the first of a run, launched on an idle device, and the last, collected by a
# drafting step, cost other than a plain step among plain ones), so a run of 3 gives one measurement
PLAIN_RUN = 3
# plain steps timed before the gate weighs the kinds, a run of PLAIN_RUN starting once in EXPLORE_FIRST steps
# meanwhile (half the warm-up's steps plain: at 3 in 4 with 8 timed, the warm-up outlasted the H200 sweep's 32
# warm-up steps at one request, and 6 of its first 32 timed steps decoded plainly where drafting ran 1.8x)
WARM_PLAIN = 4
EXPLORE_FIRST = 2 * PLAIN_RUN
# the share of the tokens an exploration may lose, by the measured rates (explore_after): an open gate's plain
# steps lose against fixed lengths too, a closed gate's drafting steps only against plain decoding (fixed lengths
# draft every step), and a gate shut on a bad stretch must reopen soon: at one request each exploring step brings
# one row (a simulated stretch of bad drafts then good ones at one request, 144 steps: 0.90x fixed lengths at
# 0.5% closed, 0.96x at 2%)
EXPLORE_LOSS, EXPLORE_LOSS_CLOSED = 0.003, 0.02
EXPLORE_MIN, EXPLORE_MAX = 4, 512  # steps between them at a tie / far from one
# g: accepted drafts per row, a drafting step's rows weighing 2^(-age / GAIN_HALF_LIFE), age in steps. By steps,
# not rows: a gate closed at one request learns g from its exploring steps' rows alone, and a window of the last
# 128 rows then spanned thousands of steps (H200: shut on the demo's first prompts, it never saw that later
# ones drafted well); an open gate at one request still averages ~46 rows (a few bad drafts do not shut it)
GAIN_HALF_LIFE = 32
_DECAY = 0.5 ** (1 / GAIN_HALF_LIFE)
# The gate shuts only when drafting loses even with g raised by Z standard errors of its estimate (gain_se): at
# one request each step brings one row (accepted drafts spread ~1.3 per row at the demo's acceptance), and a
# gate that shut on the estimate alone after a few unlucky rows drafted again only when exploring, one row at a
# time: in the simulated host-bound demo at one request (drafting 1.10x plain) it stayed shut 139 steps of 144
# in the worst of 40 seeds, 0.81x fixed lengths. At 64 rows a step the bound is within a few % of g at once.
Z = 2.0
WINDOW = 32
LOCAL, NEAR = 4, 0.25  # this many steps within this fraction of the rows asked for: their median, not the line
PAIRS = 32  # recent pairs of adjacent steps of the two kinds, for their time ratio (DraftGate.paired)
# recent switch calls per direction, whose median time beyond their steps' is what a switch costs (switch_cost)
SWITCHES = 16


def _near(items, rows: int) -> list:
    """The values of (rows, value) items whose rows are within NEAR of ``rows``."""
    lo, hi = rows - NEAR * rows, rows + NEAR * rows
    return [v for r, v in items if lo <= r <= hi]


class _Near:
    """``_near`` of a changing sequence, kept per row count until the sequence changes (``clear``): the gate asks
    it at the same rows every step, and scanning 32 items per question was most of a choice's ~19 us."""

    def __init__(self, items):
        self.items, self._at = items, {}  # items: () -> the sequence

    def __call__(self, rows: int) -> list:
        got = self._at.get(rows)
        if got is None:
            got = self._at[rows] = _near(self.items(), rows)
        return got

    def clear(self) -> None:
        self._at.clear()


class StepLine:
    """T(R) = a + b R over the last WINDOW steps of one kind, least squares with the steps far off the first
    fit dropped (a step that a page fault or another process made 5x slower must not shut the gate for
    good); the median time while R has not varied."""

    def __init__(self):
        self.samples: deque = deque(maxlen=WINDOW)
        self._fit = None
        self.near = _Near(lambda: self.samples)

    def record(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))
        self._fit = None
        self.near.clear()

    def __len__(self) -> int:
        return len(self.samples)

    @staticmethod
    def _line(pts) -> Optional[tuple]:
        n = len(pts)
        mr = sum(r for r, _ in pts) / n
        mt = sum(t for _, t in pts) / n
        srr = sum((r - mr) ** 2 for r, _ in pts)
        if srr <= 1e-9 * max(1.0, mr * mr):
            return None
        b = max(sum((r - mr) * (t - mt) for r, t in pts) / srr, 0.0)
        return mt - b * mr, b

    def coefficients(self) -> tuple:
        if self._fit is None:
            pts = list(self.samples)
            line = self._line(pts)
            if line is None:
                self._fit = (statistics.median(t for _, t in pts), 0.0)
            else:
                res = [abs(t - (line[0] + line[1] * r)) for r, t in pts]
                cut = 3 * statistics.median(res) + 1e-12
                kept = [p for p, e in zip(pts, res) if e <= cut]
                line = self._line(kept) if len(kept) >= 2 else None
                self._fit = line if line is not None else (statistics.median(t for _, t in kept or pts), 0.0)
        return self._fit

    def knows(self, rows: int) -> bool:
        """Whether LOCAL steps at about ``rows`` rows are in the window (then ``self(rows)`` is their median)."""
        return len(self.near(rows)) >= LOCAL

    def __call__(self, rows: int) -> float:
        """The median of the steps at about ``rows`` rows (within NEAR) when LOCAL of them are in the window, else
        the line's value. A step's time need not be linear in its rows (a drafting step at 128 rows cost 2.4x
        one at 64 on the H200), and a line fitted mostly at other row counts then misprices this one: worse,
        its outlier cut dropped the few steps measured here."""
        near = self.near(rows)
        if len(near) >= LOCAL:
            return max(statistics.median(near), 1e-9)
        a, b = self.coefficients()
        return max(a + b * rows, 1e-9)


class DraftGate:
    def __init__(self, explore_loss: float = EXPLORE_LOSS, explore_loss_closed: float = EXPLORE_LOSS_CLOSED,
                 z: float = Z):
        # 0: never take the losing kind once both are measured
        self.explore_loss, self.explore_loss_closed = explore_loss, explore_loss_closed
        self.z = z
        self.drafting, self.plain = StepLine(), StepLine()  # seconds against rows
        self.gain: Optional[float] = None  # accepted drafts per row of the drafting steps' rows, decayed by age
        self._gain_rows = 0.0  # the rows behind it, decayed alike
        # for its standard error: sum w a^2 / R over the steps (a accepted of R rows), sum w, sum w^2 R
        self._gain_sq = self._gain_steps = self._gain_w2 = 0.0
        self._prev: Optional[tuple] = None  # the last step recorded: (drafted, rows, seconds)
        self._pairs: deque = deque(maxlen=PAIRS)  # (rows, T_plain / T_draft) of adjacent steps of the two kinds
        self._near_pairs = _Near(lambda: self._pairs)
        self.decisions = 0
        self._since = 0  # choices since the gate last took the other kind
        self.closed = 0  # steps the gate sent to plain decoding
        self._plain_left = 0  # plain steps still owed to the run of PLAIN_RUN the last one started
        self._switches = {True: deque(maxlen=SWITCHES), False: deque(maxlen=SWITCHES)}  # into / out of plain
        self._est = None  # (rows, prepare(rows)) until the next record

    def record_step(self, drafted: bool, rows: int, seconds: float) -> None:
        """A decode-only step of ``rows`` rows took ``seconds``, with the drafter run (whatever lengths were then
        verified) or plainly."""
        (self.drafting if drafted else self.plain).record(rows, seconds)
        self._est = None
        prev = self._prev
        if prev is not None and prev[0] != drafted and abs(prev[1] - rows) <= NEAR * max(rows, prev[1]):
            plain, draft = (prev[2], seconds) if drafted else (seconds, prev[2])
            self._pairs.append(((rows + prev[1]) / 2, plain / max(draft, 1e-12)))
            self._near_pairs.clear()
        self._prev = (drafted, rows, seconds)

    def record_switch(self, into_plain: bool, seconds: float, plain_rows: int = 0, draft_rows: int = 0) -> None:
        """An engine call that switched kinds took ``seconds``: into plain decoding (it launched the first plain step
        of a run and collected none) or out of it (it collected the run's last plain step, of ``plain_rows``
        rows, and ran a drafting step of ``draft_rows``). Its time beyond those steps' measured times is what
        the switch cost: on the H200 the first plain step after a synchronous drafting step is launched on an
        idle device, and a dynamic engine's plain steps in explorations came to 4.25 ms each against 3.55 in a
        stream (padded demo, one request), twice the loss the steps' own times priced."""
        if not len(self.plain) or not len(self.drafting):
            return
        steps = (self.plain(plain_rows) if plain_rows else 0.0) + (self.drafting(draft_rows) if draft_rows else 0.0)
        self._switches[into_plain].append(seconds - steps)
        self._est = None

    def switch_cost(self) -> float:
        """Seconds a round trip between the kinds costs beyond its steps' times: the median of the recent calls
        into plain decoding plus that of those out of it; 0 until both were seen."""
        into, out = self._switches[True], self._switches[False]
        if not into or not out:
            return 0.0
        return max(statistics.median(into) + statistics.median(out), 0.0)

    def paired(self, rows: int) -> Optional[float]:
        """T_plain / T_draft at about ``rows`` rows from steps of the two kinds that ran one after the other (each
        switch between kinds is a pair), the median of the recent pairs; None with fewer than LOCAL of them. A
        machine whose speed drifts moves both steps of a pair alike, while the per-kind medians compare a kind's
        rare steps with the other's from other moments (on the 2-core CPU one setting's blocks ranged 11-22
        steps/s, and the gate closed at 64 rows where drafting ran 1.4x plain)."""
        near = self._near_pairs(rows)
        return statistics.median(near) if len(near) >= LOCAL else None

    def record_accepted(self, rows: int, accepted: int) -> None:
        """A drafting step's rows and the drafts accepted over them."""
        if rows:
            self._est = None
            w = self._gain_rows
            self.gain = ((self.gain or 0.0) * w + accepted) / (w + rows)
            self._gain_rows = w + rows
            self._gain_sq += accepted * accepted / rows
            self._gain_steps += 1.0
            self._gain_w2 += rows

    def gain_se(self) -> float:
        """The standard error of ``gain``: each step's mean over its R rows taken to spread sigma^2 / R about g,
        sigma^2 estimated from the steps (sum w R (m - g)^2 / sum w), the weights' own spread counted
        (var g = sigma^2 sum w^2 R / (sum w R)^2); 0 with fewer than two steps."""
        W, g = self._gain_rows, self.gain or 0.0
        if self._gain_steps < 1.5 or W <= 0:
            return 0.0
        sigma2 = max(self._gain_sq - g * g * W, 0.0) / self._gain_steps
        return (sigma2 * self._gain_w2) ** 0.5 / W

    def time_ratio(self, rows: int) -> float:
        """T_plain / T_draft at ``rows`` rows: from adjacent steps where there are enough (``paired``), else the
        per-kind estimates."""
        pair = self.paired(rows)
        return pair if pair is not None else self.plain(rows) / self.drafting(rows)

    def ratio(self, rows: int) -> float:
        """Drafting's tokens per second over plain decoding's at ``rows`` rows, by the measured steps:
        (1 + g) T_plain(R) / T_draft(R)."""
        return (1 + (self.gain or 0.0)) * self.time_ratio(rows)

    def explore_after(self, rows: int) -> float:
        """Steps between two explorations of the losing kind: N with loss / N = explore_loss (explore_loss_closed
        when the gate is closed), loss being the share of N steps' tokens an exploration loses, by
        r = ratio(rows), rho = T_plain / T_draft and the round trip's own cost O (switch_cost, o_d = O / T_draft,
        o_p = O / T_plain). An open gate's exploration takes PLAIN_RUN T_plain + O, in which drafting emits
        PLAIN_RUN r + o_d (1 + g) tokens a row and plain decoding PLAIN_RUN: (PLAIN_RUN (r - 1) + o_d (1 + g))
        / (1 + g) of a drafting step's tokens (with O = 0, PLAIN_RUN (1 - 1 / r) rho). A closed gate's takes
        T_draft + O, in which plain decoding emits 1 / rho + o_p and drafting 1 + g = r / rho:
        (1 - r) / rho + o_p of a plain step's."""
        rho = self.time_ratio(rows)
        return self._period((1 + (self.gain or 0.0)) * rho, rho, rows)

    def _period(self, r: float, rho: float, rows: int) -> float:
        budget = self.explore_loss if r > 1 else self.explore_loss_closed
        if budget <= 0:
            return float("inf")
        rho = max(rho, 1e-9)
        o = self.switch_cost()
        if r > 1:
            g1 = r / rho  # 1 + g
            loss = (PLAIN_RUN * (r - 1) + (o / self.drafting(rows) if o else 0.0) * g1) / g1
        else:
            loss = (1 - r) / rho + (o / self.plain(rows) if o else 0.0)
        return min(max(loss / budget, EXPLORE_MIN), EXPLORE_MAX)

    def worth(self, rows: int) -> bool:
        """Whether drafting pays at ``rows`` rows by the measured steps (no exploration)."""
        return self.ratio(rows) > 1

    def prepare(self, rows: int) -> tuple:
        """What ``open`` weighs at ``rows`` rows: (plain steps known there, drafting steps known there, the drafting
        / plain rate ratio with g raised by Z se, the steps between explorations), kept until the next record.
        The engine asks for it while the device runs a step, so that the choice at the next step's start is a
        lookup (core/engine.py, _gate_chores)."""
        if self._est is not None and self._est[0] == rows:
            return self._est[1]
        plain_known, draft_known = self.plain.knows(rows), self.drafting.knows(rows)
        r = period = None
        if plain_known and draft_known:
            rho = self.time_ratio(rows)
            r = (1 + (self.gain or 0.0) + self.z * self.gain_se()) * rho  # shut only on evidence (Z)
            period = self._period(r, rho, rows)
        self._est = (rows, (plain_known, draft_known, r, period))
        return self._est[1]

    def open(self, rows: int) -> bool:
        """This step's choice for ``rows`` decoding rows: draft (True) or decode plainly."""
        self.decisions += 1
        self._gain_rows *= _DECAY  # one step older
        self._gain_sq *= _DECAY
        self._gain_steps *= _DECAY
        self._gain_w2 *= _DECAY * _DECAY
        if self._plain_left:
            self._plain_left -= 1
            self._since += 1
            choice = False
        elif len(self.drafting) < WARM or self.gain is None:
            choice = True
        elif len(self.plain) < WARM_PLAIN:
            choice = self.decisions % EXPLORE_FIRST != 0
            self._plain_left = 0 if choice else PLAIN_RUN - 1
        else:
            plain_known, draft_known, r, period = self.prepare(rows)
            if not plain_known:  # a row count not yet measured (both ways): measure it, not guess it
                self.closed += 1
                return False
            if not draft_known:
                return True
            choice = r > 1
            self._since += 1
            if self._since >= period:  # the other kind now and then: both stay measured
                self._since = 0
                choice = not choice
                self._plain_left = 0 if choice else PLAIN_RUN - 1
        self.closed += not choice
        return choice
