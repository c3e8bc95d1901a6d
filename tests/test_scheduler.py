"""The scheduler driven directly: Sequence records, a fake model, hypothesis-generated workloads.

The fake model runs no forward: after each schedule() the driver calls update(batch), appends a
token to every row that samples (a fixed function of the sequence and position, so a preempted and
recomputed sequence must still end with exactly the tokens it would have had) and finishes the
sequences whose output reached their target length. Every step is checked against the scheduler's
contract (core/scheduler.py's docstring):

- order: a sequence is admitted past a waiting one with a smaller (priority, arrival) key only if its
  chunk needs strictly fewer blocks than the waiting one's known tokens would (the waiting one did not
  fit), and a waiting sequence is passed over so in at most ``aging_steps`` steps (no starvation);
- watermark: after a step that admits while something runs, at least ``watermark_blocks`` are free; and
  a step whose running rows need no more blocks than are free never preempts. Together: in the step after
  an admission, running rows may grow by up to the watermark without preempting anyone;
- preemption: victims have a larger key than every running sequence the step left idle, lose their KV
  and keep their tokens;
- blocks: disjoint tables, free + used == total, waiting sequences hold none.

A stateful machine adds aborts at random points; the end-to-end tests at the bottom run a tiny real model
with a pool small enough to force preemption, and with priorities.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deepinfer.core.config import EngineConfig
from deepinfer.core.kv_cache import BlockPool, blocks_needed
from deepinfer.core.params import SamplingParams
from deepinfer.core.scheduler import MAX_SKIPPED, Scheduler
from deepinfer.core.state import Sequence, SeqStatus

PARAMS = SamplingParams(max_tokens=64, temperature=0.0)


def fake_token(seq: Sequence, position: int) -> int:
    return (seq.seq_id * 7919 + position * 31) % 50_000


def key(seq: Sequence) -> tuple:
    return (seq.priority, seq.arrival)


@attrs.frozen
class Req:
    prompt_len: int
    output_len: int
    arrival_step: int
    priority: int = 0


@attrs.frozen
class Workload:
    reqs: tuple
    block_size: int
    num_blocks: int
    max_num_seqs: int
    budget: int
    watermark: float = 0.0
    aging: int = 32


@st.composite
def workloads(draw, max_reqs: int = 10):
    reqs = draw(st.lists(st.builds(Req, st.integers(1, 40), st.integers(1, 16), st.integers(0, 25), st.integers(0, 2)),
                         min_size=1, max_size=max_reqs))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    longest = max(r.prompt_len + r.output_len for r in reqs)
    # Always room for one sequence of maximal length (the last sampled token never needs a KV slot).
    num_blocks = blocks_needed(longest, block_size) + draw(st.integers(0, 24))
    return Workload(tuple(reqs), block_size, num_blocks, draw(st.integers(1, 8)), draw(st.integers(1, 64)),
                    draw(st.sampled_from([0.0, 0.01, 0.2])), draw(st.integers(0, 4)))


@attrs.define
class Trace:
    steps: int = 0
    preemptions: int = 0
    max_running: int = 0
    admitted_at: dict = attrs.field(factory=dict)  # seq_id -> step of its first admission
    max_passed_over: int = 0


def check_blocks(sched: Scheduler) -> None:
    """Disjoint tables, no leak, waiting sequences hold none, state slots unique."""
    tables = [b for s in sched.running for b in s.block_table]
    assert len(tables) == len(set(tables)), "two running sequences share a block"
    assert len(tables) == sched.pool.num_blocks - sched.pool.num_free, "blocks leaked"
    assert all(sched.pool.ref_count(b) == 1 for b in tables)
    assert all(s.block_table == [] and s.state_slot == -1 for s in sched.waiting)
    slots = [s.state_slot for s in sched.running]
    assert len(set(slots)) == len(slots) and all(0 <= x < sched.max_num_seqs for x in slots)
    assert not any(s in sched.waiting for s in sched.running)


def run_fake_model(sched: Scheduler, batch, target: dict) -> None:
    """update(batch), append the fake token to every sampling row, finish those at their target length."""
    sched.update(batch)
    for s, n, start, smp in zip(batch.seqs, batch.num_tokens, batch.start, batch.samples):
        assert s.num_computed_tokens == start + n
        if smp:
            s.token_ids.append(fake_token(s, len(s.token_ids)))
            if len(s.output_token_ids) == target[s.seq_id]:
                sched.finish(s)
                assert s.status is SeqStatus.FINISHED and s.block_table == []


def run_workload(w: Workload, max_steps: int | None = None) -> tuple:
    """Drive the scheduler to completion, checking every step. Returns (trace, seqs, scheduler)."""
    pool = BlockPool(w.num_blocks)
    sched = Scheduler(pool, w.block_size, w.max_num_seqs, w.budget, watermark=w.watermark, aging_steps=w.aging)
    order = sorted(range(len(w.reqs)), key=lambda i: w.reqs[i].arrival_step)  # stable: ties keep list order
    seqs, target = {}, {}
    for arrival, i in enumerate(order):
        r = w.reqs[i]
        prompt = [(i * 131 + p) % 50_000 for p in range(r.prompt_len)]
        seqs[i] = Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=prompt, num_prompt_tokens=r.prompt_len,
                           params=PARAMS, arrival=arrival, priority=r.priority)
        target[i] = r.output_len
    pending = list(order)
    trace = Trace()
    passed: dict = {}  # waiting seq -> steps in which a later-keyed one was admitted past it (this stay)
    total_tokens = sum(r.prompt_len + r.output_len for r in w.reqs)
    last_arrival = max(r.arrival_step for r in w.reqs)
    # Generous: every step computes at least one token, and preemption costs at most a recompute per sequence.
    max_steps = max_steps or last_arrival + 1 + total_tokens * (len(w.reqs) + 1)
    step = 0
    while pending or sched.has_unfinished():
        assert step < max_steps, f"workload did not finish in {max_steps} steps: starvation or livelock"
        while pending and w.reqs[pending[0]].arrival_step <= step:
            sched.add(seqs[pending.pop(0)])
        had_work = sched.has_unfinished()
        waiting_before = list(sched.waiting)
        running_before = list(sched.running)
        tokens_before = {id(s): list(s.token_ids) for s in running_before}
        preempt_before = {id(s): s.num_preemptions for s in running_before}
        computed_before = {id(s): s.num_computed_tokens for s in waiting_before + running_before}
        free_before = pool.num_free
        # The most blocks the running rows can ask for this step (each computes at most its known tokens).
        demand = sum(max(0, blocks_needed(s.num_tokens, w.block_size) - len(s.block_table)) for s in running_before)
        n_preempt = sched.num_preemptions

        batch = sched.schedule()
        step += 1
        if not had_work:
            assert batch is None
            continue
        assert batch is not None, "the scheduler idled while requests were waiting or running"
        ids = [id(s) for s in batch.seqs]
        assert len(set(ids)) == len(ids), "a sequence was scheduled twice in one step"
        n_of = dict(zip(ids, batch.num_tokens))

        # Budget and seats.
        assert batch.total_tokens <= w.budget
        assert all(n >= 1 for n in batch.num_tokens)
        assert len(sched.running) <= w.max_num_seqs
        trace.max_running = max(trace.max_running, len(sched.running))

        # Rows: what they compute and whether they sample.
        for s, n, start, smp in zip(batch.seqs, batch.num_tokens, batch.start, batch.samples):
            assert s.status is SeqStatus.RUNNING and s in sched.running
            assert start == s.num_computed_tokens
            assert start + n <= s.num_tokens, "scheduled past the known tokens"
            assert smp == (start + n == s.num_tokens)
            assert len(s.block_table) >= blocks_needed(start + n, w.block_size), "KV slots missing for the step"

        # Preemption: only when the running rows outgrow the free blocks; the victims outrank every running
        # sequence the step left idle; they go back to the queue, recomputed from scratch, tokens kept.
        preempted = [s for s in running_before if s.status is SeqStatus.WAITING]
        assert sched.num_preemptions - n_preempt == len(preempted)
        trace.preemptions += len(preempted)
        if demand <= free_before:
            assert not preempted, f"preempted with {free_before} free blocks for a demand of {demand}"
        idle = [s for s in sched.running if id(s) not in ids]
        for s in preempted:
            assert s.num_computed_tokens == 0 and s.block_table == [] and s in sched.waiting
            assert s.num_preemptions == preempt_before[id(s)] + 1
            assert s.token_ids == tokens_before[id(s)], "preemption lost or changed tokens"
            assert id(s) not in ids
            assert all(key(s) > key(r) for r in idle), "the victim was not the lowest-priority, latest one"

        # Admission: in key order, except past a waiting sequence too large to fit; a bounded number of times.
        newly = [s for s in waiting_before if s.status is SeqStatus.RUNNING]
        assert not (newly and preempted), "admitted in a step that preempted"
        still = [s for s in waiting_before if s.status is SeqStatus.WAITING]
        for x in newly:
            assert computed_before[id(x)] == 0 and id(x) in ids
            trace.admitted_at.setdefault(x.seq_id, step - 1)
            passed.pop(x, None)
            for y in still:
                if key(y) < key(x):
                    assert blocks_needed(y.num_tokens, w.block_size) > blocks_needed(n_of[id(x)], w.block_size), \
                        "admitted past a waiting sequence that needed no more blocks"
        for y in still:
            if any(key(x) > key(y) for x in newly):
                passed[y] = passed.get(y, 0) + 1
                assert passed[y] <= w.aging, f"passed over in {passed[y]} steps, aging bound {w.aging}"
                trace.max_passed_over = max(trace.max_passed_over, passed[y])
        # Watermark: an admission next to running sequences leaves their growth room.
        if newly and (running_before or len(newly) > 1):
            assert pool.num_free >= sched.watermark_blocks, "admission dipped into the watermark"

        # Work conserving: a running sequence sits out a step only when the token budget is spent.
        if idle:
            assert batch.total_tokens == w.budget, f"{len(idle)} running sequence(s) skipped with budget left"
        check_blocks(sched)
        run_fake_model(sched, batch, target)
    trace.steps = step

    # Everyone admitted finished with exactly the tokens the fake model gives, and the pool is whole again.
    assert len(trace.admitted_at) == len(w.reqs)
    for i, s in seqs.items():
        assert s.status is SeqStatus.FINISHED
        assert s.output_token_ids == [fake_token(s, p) for p in range(s.num_prompt_tokens, s.num_tokens)]
        assert len(s.output_token_ids) == w.reqs[i].output_len
    assert sched.pool.num_free == sched.pool.num_blocks
    assert all(sched.pool.ref_count(b) == 0 for b in range(w.num_blocks))
    assert not sched.waiting and not sched.running
    return trace, seqs, sched


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_fairly(w):
    trace, _, _ = run_workload(w)
    event("preempted" if trace.preemptions else "no preemption")
    event("chunked prefill" if any(r.prompt_len > w.budget for r in w.reqs) else "whole prompts")
    event("skipped ahead" if trace.max_passed_over else "in key order")
    event("reserved (aging bound reached)" if trace.max_passed_over == w.aging > 0 else "never aged out")


def test_tight_pool_preempts_and_recomputes():
    # Four sequences of 6 + 10 tokens, blocks of 2, a pool for one and a half of them: preemption is forced.
    w = Workload(reqs=tuple(Req(6, 10, 0) for _ in range(4)), block_size=2, num_blocks=12, max_num_seqs=4, budget=32)
    trace, seqs, sched = run_workload(w)
    assert trace.preemptions > 0 and sched.num_preemptions == trace.preemptions
    assert sum(s.num_preemptions for s in seqs.values()) == trace.preemptions
    assert trace.max_running >= 2  # batching happened


def test_preempted_sequence_restarts_from_zero():
    pool = BlockPool(4)
    sched = Scheduler(pool, block_size=2, max_num_seqs=2, max_num_batched_tokens=16, watermark=0.0)
    a = Sequence(0, "a", 0, [1, 2, 3, 4], 4, PARAMS, arrival=0)
    b = Sequence(1, "b", 0, [5, 6, 7, 8], 4, PARAMS, arrival=1)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_tokens == [4, 4] and batch.samples == [True, True]
    assert pool.num_free == 0
    sched.update(batch)
    a.token_ids.append(9)
    b.token_ids.append(10)
    # Both now need a third block for position 4; only the older one (a) gets it, b is preempted.
    batch = sched.schedule()
    assert batch.seqs == [a] and batch.start == [4] and batch.num_tokens == [1] and batch.samples == [True]
    assert b.status is SeqStatus.WAITING and list(sched.waiting) == [b] and list(sched.running) == [a]
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.num_preemptions == 1
    assert b.token_ids == [5, 6, 7, 8, 10], "the sampled token survives preemption"
    assert sched.num_preemptions == 1
    sched.update(batch)
    sched.finish(a)
    # b comes back and recomputes all five known tokens, then samples.
    batch = sched.schedule()
    assert batch.seqs == [b] and batch.start == [0] and batch.num_tokens == [5] and batch.samples == [True]
    assert len(b.block_table) == 3
    sched.update(batch)
    sched.finish(b)
    assert pool.num_free == 4


def _running(sched, seq_id, tokens, computed, arrival, priority=0):
    """Put a sequence straight into the running set with the blocks its computed tokens use."""
    s = Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens), PARAMS, arrival=arrival, priority=priority)
    s.status = SeqStatus.RUNNING
    s.num_computed_tokens = computed
    s.block_table = sched.pool.allocate(blocks_needed(computed, sched.block_size))
    s.state_slot = sched._free_slots.pop()
    sched.running[s] = None
    return s


def test_victim_is_the_latest_arrived_row_not_yet_scheduled():
    """A decode scheduled first (the youngest) must not make the oldest prefill preempt itself while a
    younger unscheduled row can give its blocks back."""
    sched = Scheduler(BlockPool(7), block_size=2, max_num_seqs=4, max_num_batched_tokens=64)
    a = _running(sched, 0, range(8), computed=4, arrival=0)  # prefill chunk left: needs 2 more blocks
    b = _running(sched, 1, range(8), computed=4, arrival=1)  # the same
    c = _running(sched, 2, range(5), computed=4, arrival=2)  # decode: needs 1 more block
    assert sched.pool.num_free == 1
    batch = sched.schedule()
    assert batch.seqs == [c, a] and batch.num_tokens == [1, 4]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and list(sched.waiting) == [b]
    assert a.status is SeqStatus.RUNNING and a.num_preemptions == 0


def test_chunked_prefill_respects_budget():
    pool = BlockPool(16)
    sched = Scheduler(pool, block_size=4, max_num_seqs=4, max_num_batched_tokens=5)
    s = Sequence(0, "a", 0, list(range(12)), 12, PARAMS, arrival=0)
    sched.add(s)
    chunks = []
    while True:
        batch = sched.schedule()
        chunks.append((batch.start[0], batch.num_tokens[0], batch.samples[0]))
        sched.update(batch)
        if batch.samples[0]:
            break
    assert chunks == [(0, 5, False), (5, 5, False), (10, 2, True)]


def test_finish_of_waiting_sequence_releases_it():
    pool = BlockPool(2)
    sched = Scheduler(pool, block_size=4, max_num_seqs=1, max_num_batched_tokens=8)
    a = Sequence(0, "a", 0, [1, 2], 2, PARAMS, arrival=0)
    b = Sequence(1, "b", 0, [3], 1, PARAMS, arrival=1)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a]  # max_num_seqs=1 keeps b waiting
    sched.finish(b)  # an abort while waiting
    assert b.status is SeqStatus.FINISHED and not sched.waiting
    sched.update(batch)
    sched.finish(a)
    assert not sched.has_unfinished() and pool.num_free == 2


def _waiting(sched, seq_id, prompt_len, arrival, priority=0):
    s = Sequence(seq_id, f"r{seq_id}", 0, [seq_id] * prompt_len, prompt_len, PARAMS, arrival=arrival,
                 priority=priority)
    sched.add(s)
    return s


def test_priority_orders_admission_ties_by_arrival():
    sched = Scheduler(BlockPool(64), block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    seqs = [_waiting(sched, i, 3, arrival=i, priority=p) for i, p in enumerate([2, 0, 1, 0, 2])]
    served = []
    while sched.has_unfinished():
        batch = sched.schedule()
        (s,) = batch.seqs
        served.append(s.seq_id)
        sched.update(batch)
        sched.finish(s)
    assert served == [1, 3, 2, 0, 4]
    assert [s.seq_id for s in seqs] == [0, 1, 2, 3, 4]


def test_victim_is_the_lowest_priority_then_latest_arrived():
    """b arrived first but has the lowest priority: it gives its blocks back, not the younger c."""
    sched = Scheduler(BlockPool(5), block_size=2, max_num_seqs=4, max_num_batched_tokens=64)
    a = _running(sched, 0, range(5), computed=4, arrival=0)  # decode: needs a third block
    b = _running(sched, 1, range(5), computed=4, arrival=1, priority=1)  # the same
    c = _running(sched, 2, range(3), computed=2, arrival=2)  # decode: needs a second block
    assert sched.pool.num_free == 0
    batch = sched.schedule()
    assert b.status is SeqStatus.WAITING and c.status is SeqStatus.RUNNING
    assert batch.seqs == [a, c]
    assert sched.num_preemptions == 1


def test_preempted_sequence_resumes_first_among_equals():
    """The victim goes back with its original key: ahead of a later arrival of its priority, behind a
    higher-priority one."""
    sched = Scheduler(BlockPool(4), block_size=2, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0)
    a = _running(sched, 0, range(5), computed=4, arrival=0)  # decode: needs a third block
    b = _running(sched, 1, range(4), computed=4, arrival=1)
    later = _waiting(sched, 2, 2, arrival=5)
    urgent = _waiting(sched, 3, 2, arrival=6, priority=-1)
    batch = sched.schedule()
    assert batch.seqs == [a] and b.status is SeqStatus.WAITING
    assert list(sched.waiting) == [urgent, b, later]


def test_watermark_holds_admission_back_only_next_to_running_sequences():
    # 10 blocks of 4, a watermark of 2 blocks: a 24-token prompt (6 blocks) next to a running one holding 3.
    sched = Scheduler(BlockPool(10), block_size=4, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.2)
    assert sched.watermark_blocks == 2
    a = _running(sched, 0, range(12), computed=11, arrival=0)
    b = _waiting(sched, 1, 24, arrival=1)
    batch = sched.schedule()
    assert batch.seqs == [a] and b.status is SeqStatus.WAITING  # 6 + 2 > 10 - 3
    sched.update(batch)
    sched.finish(a)
    # Nothing running, nothing to protect: a prompt that needs the whole pool is admitted.
    c = _waiting(sched, 2, 40, arrival=0)
    batch = sched.schedule()
    assert batch.seqs == [c] and sched.pool.num_free == 0 and b.status is SeqStatus.WAITING
    # At least one block always, however small the fraction; 0 turns it off.
    assert Scheduler(BlockPool(10), 4, 4, 64, watermark=0.001).watermark_blocks == 1
    assert Scheduler(BlockPool(10), 4, 4, 64, watermark=0.0).watermark_blocks == 0


def test_a_large_request_is_passed_over_then_reserves():
    """aging_steps=2: a small request is admitted past the large head twice, then the head reserves and the
    next small one waits behind it."""
    sched = Scheduler(BlockPool(8), block_size=4, max_num_seqs=8, max_num_batched_tokens=64, watermark=0.0,
                      aging_steps=2)
    run = _running(sched, 0, range(20), computed=19, arrival=0)  # holds 5 blocks, decodes forever
    big = _waiting(sched, 1, 16, arrival=1)  # needs 4 blocks, 3 are free
    admitted = []
    for step in range(3):
        small = _waiting(sched, 10 + step, 2, arrival=10 + step)
        batch = sched.schedule()
        admitted.append(small.status is SeqStatus.RUNNING)
        sched.update(batch)
        run.token_ids.append(0)
        if small.status is SeqStatus.RUNNING:
            sched.finish(small)
        assert big.status is SeqStatus.WAITING
    assert admitted == [True, True, False]


def stream_workload(aging: int, per_step: int, stream_steps: int) -> Workload:
    """A 40-token prompt (10 blocks of 16, plus the watermark's one) arriving at step 3 into a stream of small
    requests (4 + 4 tokens, 2 blocks each) that keeps enough of the pool busy that it never fits on its own.
    The large request is seq_id 0."""
    small = [Req(4, 4, t, 0) for t in range(stream_steps) for _ in range(per_step)]
    return Workload((Req(40, 2, 3, 0), *small), block_size=4, num_blocks=16, max_num_seqs=8, budget=64,
                    watermark=0.01, aging=aging)


@settings(max_examples=12, deadline=None)
@given(aging=st.integers(0, 24), per_step=st.integers(1, 3))
def test_a_large_request_is_not_starved_by_a_stream_of_small_ones(aging, per_step):
    w = stream_workload(aging, per_step, stream_steps=120)
    trace, _, _ = run_workload(w)
    lifetime = 8  # steps a small request runs: at most its 4 + 4 tokens
    # Passed over in at most `aging` steps, and between two pass-overs the running ones drain.
    assert trace.admitted_at[0] - 3 <= (aging + 1) * (lifetime + 1)
    assert trace.max_passed_over <= aging


def test_without_aging_the_stream_starves_the_large_request():
    """The contrast that makes the test above meaningful: with no aging bound the large request waits
    until the stream dries up."""
    trace, _, _ = run_workload(stream_workload(10**9, per_step=2, stream_steps=120))
    assert trace.admitted_at[0] >= 120


def test_admission_work_does_not_grow_with_idle_waiting_requests():
    """schedule() inspects at most MAX_SKIPPED waiting sequences that do not fit, however many wait."""

    def inspected(n_idle: int) -> int:
        sched = Scheduler(BlockPool(8), block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
        run = _running(sched, 0, range(9), computed=8, arrival=0)
        for i in range(n_idle):
            _waiting(sched, i + 1, 30, arrival=i + 1)  # 8 blocks each: never fits next to run
        calls = 0
        pop = sched.waiting.pop

        def counting_pop():
            nonlocal calls
            calls += 1
            return pop()

        sched.waiting.pop = counting_pop
        for _ in range(5):
            batch = sched.schedule()
            assert batch.seqs == [run]
            sched.update(batch)
            run.token_ids.append(0)
        assert len(sched.waiting) == n_idle
        return calls

    few, many = inspected(10), inspected(10_000)
    assert many == few <= 5 * MAX_SKIPPED


class SchedulerMachine(RuleBasedStateMachine):
    """Adds, steps and aborts (waiting or running) in any order; blocks and slots stay accounted for."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), extra=st.integers(0, 8), max_num_seqs=st.integers(1, 4),
                budget=st.integers(1, 32), watermark=st.sampled_from([0.0, 0.1]), aging=st.integers(0, 3))
    def setup(self, block_size, extra, max_num_seqs, budget, watermark, aging):
        pool = BlockPool(blocks_needed(24, block_size) + extra)  # prompts <= 16 and outputs <= 8 tokens
        self.sched = Scheduler(pool, block_size, max_num_seqs, budget, watermark=watermark, aging_steps=aging)
        self.seqs, self.target = [], {}

    @rule(prompt_len=st.integers(1, 16), output_len=st.integers(1, 8), priority=st.integers(0, 2))
    def add(self, prompt_len, output_len, priority):
        i = len(self.seqs)
        self.seqs.append(_waiting(self.sched, i, prompt_len, arrival=i, priority=priority))
        self.target[i] = output_len

    @rule()
    def step(self):
        batch = self.sched.schedule()
        assert (batch is None) == (not self.sched.has_unfinished())
        if batch is not None:
            run_fake_model(self.sched, batch, self.target)

    @precondition(lambda self: any(not s.finished for s in self.seqs))
    @rule(data=st.data())
    def abort(self, data):
        s = data.draw(st.sampled_from([s for s in self.seqs if not s.finished]))
        self.sched.finish(s)
        assert s.finished and s.block_table == [] and s.state_slot == -1
        assert s not in self.sched.waiting and s not in self.sched.running

    @invariant()
    def accounted(self):
        check_blocks(self.sched)
        assert len(self.sched.waiting) == sum(s.status is SeqStatus.WAITING for s in self.seqs)
        assert len(self.sched.running) == sum(s.status is SeqStatus.RUNNING for s in self.seqs)

    def teardown(self):
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished()
        assert self.sched.pool.num_free == self.sched.pool.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase


@pytest.mark.parametrize("field,value", [("watermark", 1.0), ("watermark", -0.01), ("watermark", True),
                                         ("scheduling_aging_steps", -1), ("scheduling_aging_steps", 2.5)])
def test_config_rejects_bad_scheduling_values(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}="):
        EngineConfig(**{field: value})


# End to end: a tiny real model, greedy, with a KV pool small enough to force preemption.

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from deepinfer.testing.models import build_tiny_hf_model

    path = tmp_path_factory.mktemp("tiny-llama-sched")
    build_tiny_hf_model(path, "llama")
    return path


def test_tiny_pool_preemption_keeps_greedy_outputs(tiny_llama):
    from deepinfer import LLM

    prompts = ["The quick brown fox", "def add(a, b):", "Once upon a time there was", "Hello!", "x = 1"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    big = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4)
    ref = big.generate(prompts, params, use_tqdm=False)
    longest = max(len(o.prompt_token_ids) for o in ref) + 20
    # Room for one longest sequence and a little more; a small token budget also chunks the recomputes.
    small = LLM(str(tiny_llama), num_kv_blocks=blocks_needed(longest, 4) + 2, block_size=4,
                max_num_batched_tokens=8)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics["num_preemptions"] for o in outs) == small.engine.scheduler.num_preemptions
    assert big.engine.scheduler.num_preemptions == 0
    for o, r in zip(outs, ref):
        assert len(o.outputs[0].token_ids) == 20
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    assert small.engine.pool.num_free == small.engine.pool.num_blocks


def test_generate_priority_serves_lower_values_first(tiny_llama):
    from deepinfer import LLM

    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4, max_num_seqs=1)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = ["one", "two", "three", "four"]
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1, 0])
    served = sorted(range(len(prompts)), key=lambda i: outs[i].metrics["first_token_time"])
    assert served == [1, 3, 2, 0]
    for bad in ([0], [0, 0, 0, "1"], 3):
        with pytest.raises(ValueError, match="priority"):
            llm.generate(prompts, params, use_tqdm=False, priority=bad)
