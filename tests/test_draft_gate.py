"""Dynamic speculation's step gate (core/draft_gate.py: draft at all this step, or decode plainly) and the
speculative accounting named as vLLM's (llm.spec_stats(), RequestOutput.metrics)."""

from __future__ import annotations

import time
import types

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.core import draft_gate as dg
from deepinfer.core import engine as engine_module
from deepinfer.core.draft_gate import DraftGate

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def fed(gate: DraftGate, t_draft, t_plain, gain: float, rows=(4, 64), each: int = 8) -> DraftGate:
    """A gate that has seen ``each`` steps of each kind at each of ``rows``, timed exactly by t_draft / t_plain."""
    for r in rows:
        for _ in range(each):
            gate.record_step(True, r, t_draft(r))
            gate.record_step(False, r, t_plain(r))
    gate.record_accepted(10, round(gain * 10))
    return gate


def test_the_first_steps_draft_then_plain_steps_are_measured():
    gate = DraftGate()
    assert all(gate.open(8) for _ in range(dg.WARM))  # nothing measured: draft (and measure drafting)
    for _ in range(dg.WARM):
        gate.record_step(True, 8, 0.01)
    gate.record_accepted(8, 8)
    choices = [gate.open(8) for _ in range(4 * dg.EXPLORE_FIRST)]  # decisions WARM + 1 ...
    # a run of PLAIN_RUN plain steps starting once in EXPLORE_FIRST decisions until WARM_PLAIN plain steps are in
    starts = [i for i in range(len(choices)) if (dg.WARM + 1 + i) % dg.EXPLORE_FIRST == 0]
    assert [i for i, c in enumerate(choices) if not c] == \
        [i + j for i in starts for j in range(dg.PLAIN_RUN) if i + j < len(choices)]


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.floats(1e-4, 1e-2), st.floats(0, 1e-4), st.floats(1e-4, 1e-2), st.floats(0, 1e-4),
       st.floats(0, 4), st.integers(1, 256))
def test_the_choice_is_the_better_tokens_per_second(ad, bd, ap, bp, gain, rows):
    gate = fed(DraftGate(), lambda r: ad + bd * r, lambda r: ap + bp * r, gain)
    g = round(gain * 10) / 10
    at = next((r for r in (4, 64) if abs(r - rows) <= dg.NEAR * rows), rows)  # a fed row count near: its times
    drafting = rows * (1 + g) / (ad + bd * at)
    plain = rows / (ap + bp * at)
    if abs(drafting - plain) > 1e-6 * max(drafting, plain):  # (a tie is either way)
        assert gate.worth(rows) == (drafting > plain)


def explorations(gate: DraftGate, rows: int, n: int, open_: bool) -> list:
    """The steps among the next ``n`` where the gate took the kind it does not favour."""
    return [i for i in range(n) if gate.open(rows) != open_]


@pytest.mark.parametrize("t_draft,t_plain,gain", [(0.010, 0.004, 1.0), (0.010, 0.004, 3.0), (0.034, 0.010, 1.4),
                                                  (0.006, 0.002, 1.2), (0.002, 0.0016, 0.3)])
def test_the_losing_kind_costs_explore_loss_of_the_tokens(t_draft, t_plain, gain):
    """Once both kinds are measured, the gate takes the losing kind once in N steps, N such that those steps
    lose EXPLORE_LOSS (open; EXPLORE_LOSS_CLOSED closed) of the tokens the N steps emit at the measured rates
    (within the EXPLORE_MIN..MAX clamp)."""
    gate = fed(DraftGate(), lambda r: t_draft, lambda r: t_plain, gain)
    R = 64
    r = (1 + gate.gain) * t_plain / t_draft
    assert gate.ratio(R) == pytest.approx(r, rel=1e-9)
    picks = explorations(gate, R, 4 * dg.EXPLORE_MAX, r > 1)
    run = dg.PLAIN_RUN if r > 1 else 1  # an open gate explores with a run of plain steps, a closed one drafts once
    starts = [i for i in picks if i - 1 not in picks]
    assert len(starts) >= 2 and all(i + j in picks for i in starts[:-1] for j in range(run))
    assert len(picks) == run * (len(starts) - 1) + (picks[-1] - starts[-1] + 1)
    n = starts[1] - starts[0]
    assert n == pytest.approx(gate.explore_after(R), abs=1)
    if dg.EXPLORE_MIN < n < dg.EXPLORE_MAX:  # the tokens lost over n steps, ``run`` of them the losing kind
        rate_d, rate_p = R * (1 + gate.gain) / t_draft, R / t_plain
        best = max(rate_d, rate_p)
        losing_t = t_plain if r > 1 else t_draft
        winning_t = t_draft if r > 1 else t_plain
        time = (n - run) * winning_t + run * losing_t
        emitted = (n - run) * winning_t * best + run * losing_t * min(rate_d, rate_p)
        budget = dg.EXPLORE_LOSS if r > 1 else dg.EXPLORE_LOSS_CLOSED
        assert 1 - emitted / (time * best) == pytest.approx(budget, rel=0.1)


@pytest.mark.parametrize("t_draft,t_plain,gain", [(0.0057, 0.00355, 1.02), (0.010, 0.004, 3.0), (0.034, 0.010, 1.4),
                                                  (0.010, 0.00478, 1.1), (0.002, 0.0016, 0.3)])
@pytest.mark.parametrize("switch", [0.5, 1.0, 3.0])
def test_an_exploration_is_priced_with_what_its_switches_cost(t_draft, t_plain, gain, switch):
    """Calls that switch kinds cost more than their steps (record_switch; on the H200 the first plain step after
    a drafting step launched on an idle device): with a round trip costing O beyond its steps, an exploration's
    steps and O together lose the exploration budget of the tokens, whichever kind wins."""
    gate = fed(DraftGate(), lambda r: t_draft, lambda r: t_plain, gain)
    R, O = 64, switch * t_plain
    for _ in range(5):
        gate.record_switch(True, 0.8 * O)  # launched the run's first plain step: nothing collected, nothing run
        gate.record_switch(False, t_plain + t_draft + 0.2 * O, plain_rows=R, draft_rows=R)  # and its way out
    assert gate.switch_cost() == pytest.approx(O, rel=1e-9)
    g = gate.gain
    r = (1 + g) * t_plain / t_draft
    n = gate.explore_after(R)
    if dg.EXPLORE_MIN < n < dg.EXPLORE_MAX:
        if r > 1:  # PLAIN_RUN plain steps and O, in n drafting steps' time
            spent = dg.PLAIN_RUN * t_plain + O
            lost = spent * (1 + g) / t_draft - dg.PLAIN_RUN
            assert lost / (n * (1 + g)) == pytest.approx(dg.EXPLORE_LOSS, rel=1e-6)
        else:  # a drafting step and O
            lost = (t_draft + O) / t_plain - (1 + g)
            assert lost / n == pytest.approx(dg.EXPLORE_LOSS_CLOSED, rel=1e-6)
    free = fed(DraftGate(), lambda r: t_draft, lambda r: t_plain, gain)
    assert n >= free.explore_after(R)  # a costly switch makes explorations rarer, never more frequent


def test_switches_need_both_directions_and_a_stray_one_is_outvoted():
    gate = fed(DraftGate(), lambda r: 0.006, lambda r: 0.004, 1.0)
    for _ in range(4):
        gate.record_switch(True, 0.002)
    assert gate.switch_cost() == 0.0  # no way out of plain decoding seen yet
    for _ in range(4):
        gate.record_switch(False, 0.010 + 0.001, plain_rows=64, draft_rows=64)
    assert gate.switch_cost() == pytest.approx(0.003, rel=1e-9)
    gate.record_switch(True, 5.0)  # a page fault inside one switch
    assert gate.switch_cost() == pytest.approx(0.003, rel=1e-9)
    cold = DraftGate()
    cold.record_switch(True, 0.002)  # before any step was measured: nothing to weigh it against
    assert cold.switch_cost() == 0.0 and not cold._switches[True]


def test_near_a_tie_the_other_kind_is_taken_often_far_from_one_seldom():
    tie = fed(DraftGate(), lambda r: 0.010, lambda r: 0.00478, 1.1)  # r = 1.004
    assert explorations(tie, 64, 64, True) == [i + j for i in range(dg.EXPLORE_MIN - 1, 64, dg.EXPLORE_MIN)
                                               for j in range(dg.PLAIN_RUN) if i + j < 64]
    far = fed(DraftGate(), lambda r: 0.010, lambda r: 0.0005, 0.5)  # r = 0.075: a drafting step costs 20 plain ones
    assert explorations(far, 64, 2 * dg.EXPLORE_MAX, False) == [dg.EXPLORE_MAX - 1, 2 * dg.EXPLORE_MAX - 1]
    never = fed(DraftGate(explore_loss=0, explore_loss_closed=0), lambda r: 0.010, lambda r: 0.00478, 1.1)
    assert never.explore_after(64) == float("inf")


def test_a_stray_slow_step_does_not_shut_the_gate():
    gate = fed(DraftGate(), lambda r: 0.010 + 1e-4 * r, lambda r: 0.004 + 1e-4 * r, 1.5)
    assert gate.worth(16)  # 2.5 / 11.6 ms > 1 / 5.6 ms
    for _ in range(3):
        gate.record_step(True, 16, 0.5)  # a page fault, another process: 40x slower
    assert gate.worth(16) and gate.drafting(16) == pytest.approx(0.0116, rel=1e-6)


class ConfidentDrafter:
    def propose(self, seq, k: int) -> list:
        seq.draft_survival = [0.9 ** (i + 1) for i in range(k)]
        return [seq.token_ids[-1]] * k


class Gate(DraftGate):
    def __init__(self, decision: bool):
        super().__init__()
        self.decision, self.asked = decision, 0

    def open(self, rows: int) -> bool:
        self.asked += 1
        return self.decision


def test_a_closed_gate_drafts_only_for_seeded_requests_and_keeps_their_output(spec_llama):
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 13, 17, 21], [40, 41, 42, 43, 40, 41, 42]]
    runs = {}
    for decision in (True, False):
        llm = LLM(spec_llama, num_kv_blocks=128, block_size=4, seed=0, speculative_config=NGRAM)
        eng = llm.engine
        eng.drafter, eng.draft_gate = ConfidentDrafter(), Gate(decision)
        eng.spec = attrs.evolve(eng.spec, dynamic=True)
        runs[decision] = (llm.generate(prompts, [seeded, other], use_tqdm=False), eng.draft_gate.asked)
    (open_out, asked), (closed_out, _) = runs[True], runs[False]
    assert asked > 0
    assert open_out[0].outputs[0].token_ids == closed_out[0].outputs[0].token_ids  # seeded: the same tokens
    assert closed_out[0].metrics["num_drafts"] > 0 and closed_out[1].metrics["num_drafts"] == 0
    assert open_out[1].metrics["num_drafts"] > 0
    assert open_out[1].outputs[0].token_ids == closed_out[1].outputs[0].token_ids  # greedy: exact either way


class ScriptDrafter:
    """Drafts the reference continuation (every draft right) or its successor token (every draft wrong)."""

    def __init__(self, reference: dict, right: bool, vocab: int):
        self.reference, self.right, self.vocab = reference, right, vocab

    def propose(self, seq, k: int) -> list:
        ref = self.reference[tuple(seq.prompt_token_ids)]
        nxt = ref[len(seq.output_token_ids):len(seq.output_token_ids) + k]
        return nxt if self.right else [(t + 1) % self.vocab for t in nxt]


@pytest.mark.parametrize("right", [True, False])
def test_accounting_named_as_vllm_per_request_and_engine_wide(spec_llama, right):
    sp = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    prompts = [[5, 9, 13, 17, 21], [40, 41, 42, 43, 40, 41, 42], [7, 8, 9]]
    plain = LLM(spec_llama, num_kv_blocks=128, block_size=4).generate(prompts, sp, use_tqdm=False)
    reference = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}
    llm = LLM(spec_llama, num_kv_blocks=128, block_size=4, speculative_config=NGRAM)
    llm.engine.drafter = ScriptDrafter(reference, right, llm.engine.model.vocab_size)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for o in outs:
        m = o.metrics
        assert m["num_drafts"] > 0 and sum(m["num_accepted_tokens_per_pos"]) == m["num_accepted_tokens"]
        if right:  # every draft stands; the tokens emitted are the verify steps' bonus plus the accepted
            assert m["num_accepted_tokens"] == m["num_draft_tokens"]
            assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_draft_tokens"] / m["num_drafts"])
            assert m["num_accepted_tokens_per_pos"][0] == m["num_drafts"]
        else:
            assert m["num_accepted_tokens"] == 0 and m["mean_acceptance_length"] == 1.0
            assert m["num_accepted_tokens_per_pos"] == [0] * len(m["num_accepted_tokens_per_pos"])
        per_pos = m["num_accepted_tokens_per_pos"]
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # a position stands only after the one before
        for k in total:
            total[k] += m[k]
    stats = llm.spec_stats()
    assert {k: stats[k] for k in total} == total
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]


SLOW_S = 1000.0  # a launch made this much slower on the engine's clock (no real wait): far above any real step


class Scripted(DraftGate):
    """Opens on a repeating pattern of steps, so drafting and plain steps follow each other both ways."""

    def __init__(self, pattern):
        super().__init__()
        self.pattern, self.asked = pattern, 0

    def open(self, rows: int) -> bool:
        self.asked += 1
        return self.pattern[(self.asked - 1) % len(self.pattern)]


@pytest.mark.parametrize("pattern", [(False,), (True, False), (True, False, False, True, True, False),
                                     (False, False, False, True)])
def test_plain_steps_of_a_dynamic_engine_overlap_and_change_nothing(pattern, monkeypatch):
    """Under overlap scheduling a step the gate keeps plain stays in flight while the next one launches (as
    plain decoding does), a drafting step first collects it, and the drafter's context is the collected
    step's own: tokens and every acceptance count equal those of the same engine without overlap."""
    prompts = [[5, 9, 13, 17, 21, 5, 9, 13], [40, 41, 42, 43, 40, 41, 42], list(range(60, 90))]
    lengths = (9, 14, 20)  # rows leave at different steps: a later launch has fewer rows than the one collected
    sp = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    spec = {"method": "dspark", "num_speculative_tokens": 4, "dynamic": True}
    runs = {}
    for overlap in (False, True):
        llm = LLM(speculative_config=spec, overlap_scheduling=overlap, num_kv_blocks=64, block_size=16)
        eng = llm.engine
        assert eng._overlap_plain is overlap
        eng.draft_gate = Scripted(pattern)
        timed, record = [], eng.draft_gate.record_step
        eng.draft_gate.record_step = lambda d, r, t, timed=timed, record=record: (timed.append(d), record(d, r, t))
        in_flight, step = [], eng.step
        if pattern == (False, False, False, True):  # the first plain launch of a run (nothing in flight) is slow
            launch, ahead = eng._launch, [0.0]
            monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(
                perf_counter=lambda ahead=ahead: time.perf_counter() + ahead[0]))

            def slow(touched, prev=None, launch=launch, eng=eng, ahead=ahead):
                if prev is None and not eng._drafts_asked:
                    ahead[0] += SLOW_S  # the engine's clock jumps inside this launch
                return launch(touched, prev)
            eng._launch = slow

        def counting(step=step, eng=eng, in_flight=in_flight):
            out = step()
            in_flight.append(eng._inflight is not None)
            return out

        eng.step = counting
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert all(o.error is None for o in outs)
        runs[overlap] = ([o.outputs[0].token_ids for o in outs], [o.metrics for o in outs], sum(in_flight),
                         len(eng.draft_gate.plain), llm.spec_stats())
        if overlap and pattern == (False, False, False, True):  # per run of 3 plain steps, one is launched by
            # a call that collected a plain step and collected by one that launches a plain step: 1 timed (the 1st
            # started on an idle device, the 3rd is collected by the drafting step)
            runs_of_3 = eng.draft_gate.asked // 4
            assert runs_of_3 - 1 <= timed.count(False) <= runs_of_3 + 1
            # ... as the wall time of the call that collected it and launched the next: never holding the
            # first step's launch (the engine's clock jumped inside it)
            assert max(t for _, t in eng.draft_gate.plain.samples) < 0.8 * SLOW_S
    (tok0, met0, flight0, plain0, st0), (tok1, met1, flight1, plain1, st1) = runs[False], runs[True]
    assert tok1 == tok0 and [len(t) for t in tok0] == list(lengths)
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    assert [{k: m[k] for k in keys} for m in met1] == [{k: m[k] for k in keys} for m in met0]
    assert st1["num_accepted_tokens"] == st0["num_accepted_tokens"]
    assert flight0 == 0 and flight1 > 0  # plain steps stayed in flight only with overlap
    # Plain steps were timed for the gate both ways; with overlap, only one among plain steps (launched by a
    # call that collected a plain step, collected by one that launches a plain step): none in runs under 3
    n = len(pattern)
    streams = any(not any(pattern[(i + j) % n] for j in range(3)) for i in range(n))
    assert plain0 > 0 and (plain1 > 0 if streams else plain1 == 0)
    if True in pattern:
        assert st0["num_accepted_tokens"] > 0  # the drafter's context mattered: drafts stood


@pytest.mark.parametrize("overlap", [False, True])
def test_the_gate_s_bookkeeping_waits_for_a_collection_and_loses_nothing(overlap):
    """A dynamic engine records its steps in the gate at the next collection (before it waits for the device), or
    once the engine is idle; every accepted draft and every drafting step reaches the gate, in order."""
    llm = LLM(speculative_config={"method": "dspark", "num_speculative_tokens": 4, "dynamic": True},
              overlap_scheduling=overlap, num_kv_blocks=64, block_size=16)
    eng = llm.engine
    gate, where, collect = eng.draft_gate, [], eng._collect_step
    inside = [False]

    def collecting(launched, touched, collect=collect, inside=inside):
        inside[0] = True
        try:
            return collect(launched, touched)
        finally:
            inside[0] = False
    eng._collect_step = collecting
    accepted, record = [], gate.record_accepted
    gate.record_accepted = lambda rows, a: (accepted.append(a), where.append(inside[0]), record(rows, a))
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[5, 9, 13, 17, 21, 5, 9, 13], list(range(60, 80)), [7] * 12], sp, use_tqdm=False)
    assert all(o.error is None for o in outs) and not eng._gate_todo
    stats = llm.spec_stats()
    assert len(accepted) > 0 and sum(accepted) == stats["num_accepted_tokens"]
    assert where.count(True) >= len(where) - 1  # all but the idle engine's last one inside a collection


@pytest.mark.parametrize("overlap", [False, True])
def test_the_calls_that_switch_kinds_are_priced_for_the_gate(overlap, monkeypatch):
    """Under overlap scheduling the call that launches a run's first plain step (after a drafting step) and the one
    that collects its last and drafts are the gate's switches, each timed whole: the engine's clock jumping in
    the first plain launch of each run lands in the switches into plain decoding and in no step's time. Without
    overlap no call switches (every step is collected by its own call) and nothing is recorded."""
    llm = LLM(speculative_config={"method": "dspark", "num_speculative_tokens": 4, "dynamic": True},
              overlap_scheduling=overlap, num_kv_blocks=64, block_size=16)
    eng = llm.engine
    eng.draft_gate = gate = Scripted((True, True, False, False, False))
    ahead, launch = [0.0], eng._launch
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(
        perf_counter=lambda ahead=ahead: time.perf_counter() + ahead[0]))

    def slow(touched, prev=None, launch=launch, eng=eng, ahead=ahead):
        if prev is None and not eng._drafts_asked and eng._gate_kind == "draft":
            ahead[0] += SLOW_S  # the first plain launch after a drafting step
        return launch(touched, prev)
    eng._launch = slow
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[5, 9, 13, 17, 21, 5, 9, 13], list(range(60, 80))], sp, use_tqdm=False)
    assert all(o.error is None for o in outs)
    into, out = gate._switches[True], gate._switches[False]
    if not overlap:
        assert not into and not out
        return
    assert len(into) >= 3 and all(SLOW_S <= t < 1.5 * SLOW_S for t in into)
    assert len(out) >= 3 and all(abs(t) < 0.5 * SLOW_S for t in out)
    assert gate.switch_cost() >= SLOW_S * 0.9
    times = [t for line in (gate.plain, gate.drafting) for _, t in line.samples]
    assert times and max(times) < 0.5 * SLOW_S  # no step's time holds a switch's


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("pattern", [(False,), (True,), (True, True, False, False, False)])
def test_a_step_is_timed_for_the_gate_through_its_call_s_outputs(pattern, overlap, monkeypatch):
    """Building the call's outputs (detokenizing, the requests' outputs) is part of what a step costs, of
    either kind: every time the gate records spans the call's _collect, and no more than one call's."""
    llm = LLM(speculative_config={"method": "dspark", "num_speculative_tokens": 4, "dynamic": True},
              overlap_scheduling=overlap, num_kv_blocks=64, block_size=16)
    eng = llm.engine
    eng.draft_gate = Scripted(pattern)
    ahead, collect = [0.0], eng._collect
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(
        perf_counter=lambda ahead=ahead: time.perf_counter() + ahead[0]))

    def slow_outputs(touched, collect=collect, ahead=ahead):
        ahead[0] += SLOW_S  # the engine's clock jumps while the call builds its outputs
        return collect(touched)
    eng._collect = slow_outputs
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[5, 9, 13, 17, 21, 5, 9, 13], list(range(60, 80))], sp, use_tqdm=False)
    assert all(o.error is None for o in outs)
    times = [t for line in (eng.draft_gate.plain, eng.draft_gate.drafting) for _, t in line.samples]
    assert times and all(SLOW_S <= t < 1.5 * SLOW_S for t in times)
    assert len(eng.draft_gate.drafting) > 0 if True in pattern else len(eng.draft_gate.drafting) == 0
    assert len(eng.draft_gate.plain) > 0 if False in pattern else len(eng.draft_gate.plain) == 0


def test_steps_measured_at_the_rows_asked_for_price_them_not_the_line():
    """Drafting steps that cost a line up to 64 rows and 2.4x the 64-row step at 128 (as on the H200): once
    LOCAL steps at 128 are in, T_draft(128) is their median and the gate closes there while drafting still
    pays at 64; before, the line (which dropped the 128-row steps as outliers) kept it open."""
    gate = fed(DraftGate(), lambda r: 0.003 + 4e-5 * r, lambda r: 0.001 + 2.2e-5 * r, gain=2.0, rows=(1, 16, 64),
               each=8)
    gate.drafting.samples = dg.deque(list(gate.drafting.samples)[-(dg.WINDOW - dg.LOCAL):], maxlen=dg.WINDOW)
    assert gate.worth(64) and gate.worth(128)  # by the line: 3 tokens for 2.2x the time at 128
    for _ in range(dg.LOCAL):
        gate.record_step(True, 128, 2.4 * (0.003 + 4e-5 * 64))
    assert gate.drafting(128) == pytest.approx(2.4 * (0.003 + 4e-5 * 64), rel=1e-9)
    assert gate.worth(64) and not gate.worth(128)
    assert gate.drafting(110) == pytest.approx(gate.drafting(128))  # within NEAR of 110: the same steps
    assert gate.drafting(16) == pytest.approx(0.003 + 4e-5 * 16, rel=1e-6)  # elsewhere: the line


@settings(max_examples=50, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 128), st.integers(0, 4), st.integers(0, 40)), min_size=1, max_size=40))
def test_the_gain_weighs_each_drafting_step_by_its_rows_and_age(steps):
    """g = sum w a / sum w R over the drafting steps (R rows, a accepted drafts), w = 2^(-age / GAIN_HALF_LIFE),
    age counted in gate decisions: the oracle is the direct sum over the whole history."""
    gate = DraftGate()
    history, now = [], 0
    for rows, per_row, idle in steps:
        for _ in range(idle):  # decisions between drafting steps (plain ones, say)
            gate.open(rows or 1)
            now += 1
        accepted = min(per_row * rows, 4 * rows)
        gate.record_accepted(rows, accepted)
        history.append((now, rows, accepted))
    weights = [(2 ** (-(now - t) / dg.GAIN_HALF_LIFE), r, a) for t, r, a in history if r]
    if not weights:
        assert gate.gain is None
        return
    want = sum(w * a for w, _, a in weights) / sum(w * r for w, r, _ in weights)
    assert gate.gain == pytest.approx(want, rel=1e-9, abs=1e-12)


@settings(max_examples=50, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 128), st.floats(0, 4), st.integers(0, 20)), min_size=1, max_size=40))
def test_the_gain_s_standard_error_is_that_of_the_weighted_mean(steps):
    """gain_se over the whole history, summed directly: each step's mean m = a / R spreads sigma^2 / R about g,
    sigma^2 = sum w R (m - g)^2 / sum w, var g = sigma^2 sum w^2 R / (sum w R)^2."""
    gate = DraftGate()
    history, now = [], 0
    for rows, per_row, idle in steps:
        for _ in range(idle):
            gate.open(rows)
            now += 1
        accepted = round(per_row * rows)
        gate.record_accepted(rows, accepted)
        history.append((now, rows, accepted))
    w = [(2 ** (-(now - t) / dg.GAIN_HALF_LIFE), r, a) for t, r, a in history]
    W = sum(x * r for x, r, _ in w)
    g = sum(x * a for x, _, a in w) / W
    if len(w) < 2:
        assert gate.gain_se() == 0.0
        return
    sigma2 = sum(x * r * (a / r - g) ** 2 for x, r, a in w) / sum(x for x, _, _ in w)
    want = (sigma2 * sum(x * x * r for x, r, _ in w)) ** 0.5 / W
    assert gate.gain_se() == pytest.approx(want, rel=1e-6, abs=1e-6 * max(1.0, g))  # (sums that cancel)


def test_the_gate_shuts_on_evidence_not_on_a_few_unlucky_rows():
    """The same estimate of g below break-even shuts the gate when it stands on many rows (64 a step) and not on
    a few (one a step, spread as drafts are): drafting is taken while g + Z se clears break-even."""
    def gate_after(rows_per_step: int, per_row: list) -> DraftGate:
        gate = fed(DraftGate(), lambda r: 0.010, lambda r: 0.004, 0.0, rows=(rows_per_step,))
        gate._gain_rows = gate._gain_sq = gate._gain_steps = gate._gain_w2 = 0.0
        gate.gain = None
        for a in per_row:
            gate.record_accepted(rows_per_step, a * rows_per_step)
        return gate

    pattern = [0, 3, 0, 1, 4, 0, 2, 0] * 3  # g = 1.25 per row; break-even 1.5 (T_draft / T_plain = 2.5)
    one, many = gate_after(1, pattern), gate_after(64, [1.25] * len(pattern))
    assert one.gain == pytest.approx(1.25) and many.gain == pytest.approx(1.25)
    assert not one.worth(1) and not many.worth(64)  # the estimates alone say plain decoding
    assert one.gain + dg.Z * one.gain_se() > 1.5 and many.gain_se() == 0.0
    assert one.open(1) and not many.open(64)
    no_doubt = DraftGate(z=0)
    no_doubt.__dict__.update({k: v for k, v in one.__dict__.items() if k not in ("z", "_est")})
    assert not no_doubt.open(1)  # z = 0: the estimate alone


@settings(max_examples=60, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([16, 16, 16, 64]), st.floats(1e-3, 1e-2), st.integers(0, 4), st.booleans(),
                          st.sampled_from([None, 16, 64]), st.floats(0, 4e-3)), min_size=40, max_size=160))
def test_a_prepared_estimate_chooses_as_a_fresh_one(steps):
    """The engine has the gate prepare its estimate while the device runs a step; whatever was recorded since, and
    at whatever rows it was prepared, the choices equal those of a gate that weighs everything afresh."""
    kept, fresh = DraftGate(), DraftGate()
    for rows, t, per_row, switch, prep_rows, extra in steps:
        if prep_rows is not None:
            kept.prepare(prep_rows)
        fresh._est = None
        got, want = kept.open(rows), fresh.open(rows)
        assert got == want
        for gate in (kept, fresh):
            gate.record_step(got, rows, t if got else 0.6 * t)
            if got and per_row != 2:
                gate.record_accepted(rows, per_row * rows)
            if switch:
                gate.record_switch(not got, extra, plain_rows=rows if got else 0, draft_rows=rows if got else 0)
    assert kept.closed == fresh.closed


def test_a_closed_gate_at_one_request_learns_the_gain_from_its_exploring_steps():
    """A gate shut on bad drafts (g ~ 0) at one request drafts now and then; once the drafts are good, the rows of
    a few such steps, not the hundreds of old ones, set g, and the gate opens (a last-128-rows window kept the old
    rows for ~128 explorations: on the H200 it never reopened)."""
    gate = DraftGate()
    for _ in range(200):
        gate.record_step(True, 1, 0.002)
        gate.record_accepted(1, 0)
        gate.open(1)
        gate.record_step(False, 1, 0.001)
    assert not gate.worth(1)  # 1 token in 2 ms against 1 in 1 ms
    drafted = []
    for i in range(400):
        d = gate.open(1)
        gate.record_step(d, 1, 0.002 if d else 0.001)
        if d:
            gate.record_accepted(1, 4)  # every draft stands now: 5 tokens in 2 ms
            drafted.append(i)
    opened = next(i for i in drafted if all(j in drafted for j in range(i, i + 16)))  # drafting for good
    assert opened < dg.EXPLORE_MAX and gate.worth(1)
    assert sum(1 for i in drafted if i >= opened) >= 0.95 * (400 - opened)


def test_a_row_count_not_yet_measured_both_ways_is_measured_first():
    """Past the warm-up, at rows where fewer than LOCAL steps of a kind are in, the gate takes that kind (a line
    through other row counts is a guess); then it chooses by the measured steps there."""
    gate = fed(DraftGate(explore_loss=0, explore_loss_closed=0), lambda r: 0.002 + 1e-4 * r,
               lambda r: 0.001, gain=2.0, rows=(1,), each=dg.WINDOW // 2)
    assert gate.open(1)  # 3 tokens / 2.1 ms > 1 / 1 ms
    choices = []
    for _ in range(2 * dg.LOCAL + 2):
        c = gate.open(16)
        choices.append(c)
        gate.record_step(c, 16, 0.002 + 1e-4 * 16 if c else 0.0015)
    assert choices[:dg.LOCAL] == [False] * dg.LOCAL  # plain steps of 16 rows first: none measured
    assert choices[dg.LOCAL:2 * dg.LOCAL] == [True] * dg.LOCAL  # then drafting ones (the window's are at 1 row)
    assert all(choices[2 * dg.LOCAL:])  # 3 / 3.6 ms > 1 / 1.5 ms


def test_a_drifting_machine_is_judged_by_adjacent_steps():
    """The machine slows 3x over the run. Drafting steps (most of them, recent) against plain ones (one in 16,
    spread over the run) by per-kind medians compare slow steps with fast ones and close the gate; the ratio of
    steps that ran one after the other does not drift, and drafting (2.5 tokens for 2x the time) stays open."""
    gate = DraftGate()
    n = 512
    for i in range(n):
        slow = 1 + 2 * i / n
        plain = i % 16 == 15
        gate.record_step(not plain, 32, (0.001 if plain else 0.002) * slow)
        if not plain:
            gate.record_accepted(32, 48)  # g = 1.5
    per_kind = 2.5 * gate.plain(32) / gate.drafting(32)
    assert per_kind < 1  # what the medians alone would decide: plain
    assert gate.paired(32) == pytest.approx(0.5, rel=0.01) and gate.ratio(32) == pytest.approx(1.25, rel=0.01)
    assert gate.worth(32)
    assert gate.paired(4) is None  # no pairs at 4 rows: the per-kind estimate there


@settings(max_examples=60, derandomize=True, deadline=None)
@given(st.floats(0.2, 2.0), st.floats(1e-4, 1e-2), st.floats(-0.7, 2.0), st.integers(3, 40), st.integers(1, 200))
def test_paired_ratio_follows_the_true_ratio_under_any_drift(q, t_draft, drift, every, rows):
    """Drafting steps of t_draft and plain ones of q x t_draft, one plain step in ``every``, on a machine whose
    speed changes by (1 + drift) over the run: the paired ratio is q within what the drift moves between two
    adjacent steps."""
    gate, n = DraftGate(), 400
    for i in range(n):
        slow = 1 + drift * i / n
        plain = i % every == every - 1
        gate.record_step(not plain, rows, (q if plain else 1.0) * t_draft * slow)
    step = abs(drift) / n / min(1.0, 1 + drift)  # the largest relative change between adjacent steps
    assert gate.paired(rows) == pytest.approx(q, rel=2 * step + 1e-9)


def test_overlapped_plain_steps_with_grammars_and_drafting_steps_between():
    """A constrained request beside a free one in a dynamic engine whose gate alternates: the constrain stage
    collects the plain step in flight inside the next launch (its masks need the tokens), drafting steps collect
    it first; output equals the same engine's without overlap and matches the grammar."""
    pytest.importorskip("xgrammar")
    import re

    from deepinfer import StructuredOutputsParams

    rx = r"(ab|cd){3,12}e"
    params = [SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=rx)),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]
    prompts = ["x = ", "def f():"]
    spec = {"method": "dspark", "num_speculative_tokens": 4, "dynamic": True}
    outs = {}
    for overlap in (False, True):
        llm = LLM(speculative_config=spec, overlap_scheduling=overlap, max_model_len=256, threads=1)
        llm.engine.draft_gate = Scripted((True, False, False))
        got = llm.generate(prompts, params, use_tqdm=False)
        assert all(o.error is None for o in got)
        outs[overlap] = [o.outputs[0].token_ids for o in got]
        assert re.fullmatch(rx, got[0].outputs[0].text), got[0].outputs[0].text
        assert len(got[1].outputs[0].token_ids) == 30
    assert outs[True] == outs[False]
