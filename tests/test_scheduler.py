"""The scheduler driven directly: Sequence records, a fake model, hypothesis-generated workloads.

The fake model runs no forward: after each schedule() the driver calls update(batch), appends a
token to every row that samples (a fixed function of the sequence and position, so a preempted and
recomputed sequence must still end with exactly the tokens it would have had) and finishes the
sequences whose output reached their target length. Every step is checked against the scheduler's
contract; the end-to-end test at the bottom runs a tiny real model with a pool small enough to force
preemption and compares its greedy outputs with those of a large pool.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deepinfer.core.kv_cache import BlockPool, blocks_needed
from deepinfer.core.params import SamplingParams
from deepinfer.core.scheduler import Scheduler
from deepinfer.core.state import Sequence, SeqStatus

PARAMS = SamplingParams(max_tokens=64, temperature=0.0)


def fake_token(seq: Sequence, position: int) -> int:
    return (seq.seq_id * 7919 + position * 31) % 50_000


@attrs.frozen
class Req:
    prompt_len: int
    output_len: int
    arrival_step: int


@attrs.frozen
class Workload:
    reqs: tuple
    block_size: int
    num_blocks: int
    max_num_seqs: int
    budget: int


@st.composite
def workloads(draw, max_reqs: int = 10):
    reqs = draw(st.lists(st.builds(Req, st.integers(1, 40), st.integers(1, 16), st.integers(0, 25)),
                         min_size=1, max_size=max_reqs))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    longest = max(r.prompt_len + r.output_len for r in reqs)
    # Always room for one sequence of maximal length (the last sampled token never needs a KV slot).
    num_blocks = blocks_needed(longest, block_size) + draw(st.integers(0, 24))
    return Workload(tuple(reqs), block_size, num_blocks, draw(st.integers(1, 8)), draw(st.integers(1, 64)))


@attrs.define
class Trace:
    steps: int = 0
    preemptions: int = 0
    max_running: int = 0
    admission_order: list = attrs.field(factory=list)


def run_workload(w: Workload, max_steps: int | None = None) -> tuple:
    """Drive the scheduler to completion, checking every step. Returns (trace, seqs, scheduler)."""
    pool = BlockPool(w.num_blocks)
    sched = Scheduler(pool, w.block_size, w.max_num_seqs, w.budget)
    order = sorted(range(len(w.reqs)), key=lambda i: w.reqs[i].arrival_step)  # stable: ties keep list order
    seqs, target = {}, {}
    for arrival, i in enumerate(order):
        r = w.reqs[i]
        prompt = [(i * 131 + p) % 50_000 for p in range(r.prompt_len)]
        seqs[i] = Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=prompt, num_prompt_tokens=r.prompt_len,
                           params=PARAMS, arrival=arrival)
        target[i] = r.output_len
    pending = list(order)
    trace = Trace()
    total_tokens = sum(r.prompt_len + r.output_len for r in w.reqs)
    last_arrival = max(r.arrival_step for r in w.reqs)
    # Generous: every step computes at least one token, and preemption costs at most a recompute per sequence.
    max_steps = max_steps or last_arrival + 1 + total_tokens * (len(w.reqs) + 1)
    admitted = set()
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
        n_preempt = sched.num_preemptions

        batch = sched.schedule()
        step += 1
        if not had_work:
            assert batch is None
            continue
        assert batch is not None, "the scheduler idled while requests were waiting or running"
        ids = [id(s) for s in batch.seqs]
        assert len(set(ids)) == len(ids), "a sequence was scheduled twice in one step"

        # Budget and seats.
        assert batch.total_tokens <= w.budget
        assert all(n >= 1 for n in batch.num_tokens)
        assert len(sched.running) <= w.max_num_seqs
        trace.max_running = max(trace.max_running, len(sched.running))

        # Rows: what they compute and whether they sample.
        for s, n, start, smp in zip(batch.seqs, batch.num_tokens, batch.start, batch.samples):
            assert s.status is SeqStatus.RUNNING and any(s is r for r in sched.running)
            assert start == s.num_computed_tokens
            assert start + n <= s.num_tokens, "scheduled past the known tokens"
            assert smp == (start + n == s.num_tokens)
            assert len(s.block_table) >= blocks_needed(start + n, w.block_size), "KV slots missing for the step"

        # Preemption: back to the front of the queue, recomputed from scratch, tokens kept.
        preempted = [s for s in running_before if s.status is SeqStatus.WAITING]
        assert sched.num_preemptions - n_preempt == len(preempted)
        trace.preemptions += len(preempted)
        for s in preempted:
            assert s.num_computed_tokens == 0 and s.block_table == []
            assert s.num_preemptions == preempt_before[id(s)] + 1
            assert s.token_ids == tokens_before[id(s)], "preemption lost or changed tokens"
            assert id(s) not in ids
        # ... in the order they had been admitted, ahead of everyone who never ran.
        assert [id(s) for s in list(sched.waiting)[:len(preempted)]] == [id(s) for s in preempted]

        # FCFS: those admitted this step are a prefix of the waiting queue as it was.
        newly = [s for s in waiting_before if s.status is SeqStatus.RUNNING]
        assert [id(s) for s in newly] == [id(s) for s in waiting_before[:len(newly)]], "admission skipped the queue"
        for s in newly:
            if id(s) not in admitted:
                admitted.add(id(s))
                trace.admission_order.append(s.arrival)
            assert computed_before[id(s)] == 0 and id(s) in ids

        # Work conserving: a running sequence sits out a step only when the token budget is spent.
        idle = [s for s in sched.running if id(s) not in ids]
        if idle:
            assert batch.total_tokens == w.budget, f"{len(idle)} running sequence(s) skipped with budget left"

        # Blocks: disjoint tables, no leak, waiting sequences hold none.
        tables = [b for s in sched.running for b in s.block_table]
        assert len(tables) == len(set(tables)), "two running sequences share a block"
        assert len(tables) == w.num_blocks - sched.pool.num_free, "blocks leaked"
        assert all(s.block_table == [] for s in sched.waiting)

        # The fake model.
        sched.update(batch)
        for s, n, start, smp in zip(batch.seqs, batch.num_tokens, batch.start, batch.samples):
            assert s.num_computed_tokens == start + n
            if smp:
                s.token_ids.append(fake_token(s, len(s.token_ids)))
                if len(s.output_token_ids) == target[s.seq_id]:
                    sched.finish(s)
                    assert s.status is SeqStatus.FINISHED and s.block_table == []
    trace.steps = step

    # Everyone admitted finished with exactly the tokens the fake model gives, and the pool is whole again.
    assert trace.admission_order == sorted(trace.admission_order), "first admissions out of arrival order"
    assert len(trace.admission_order) == len(w.reqs)
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


def test_tight_pool_preempts_and_recomputes():
    # Four sequences of 6 + 10 tokens, blocks of 2, a pool for one and a half of them: preemption is forced.
    w = Workload(reqs=tuple(Req(6, 10, 0) for _ in range(4)), block_size=2, num_blocks=12, max_num_seqs=4, budget=32)
    trace, seqs, sched = run_workload(w)
    assert trace.preemptions > 0 and sched.num_preemptions == trace.preemptions
    assert sum(s.num_preemptions for s in seqs.values()) == trace.preemptions
    assert trace.max_running >= 2  # batching happened


def test_preempted_sequence_restarts_from_zero():
    pool = BlockPool(4)
    sched = Scheduler(pool, block_size=2, max_num_seqs=2, max_num_batched_tokens=16)
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
    assert b.status is SeqStatus.WAITING and list(sched.waiting) == [b] and sched.running == [a]
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


def _running(sched, seq_id, tokens, computed, arrival):
    """Put a sequence straight into the running set with the blocks its computed tokens use."""
    s = Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens), PARAMS, arrival=arrival)
    s.status = SeqStatus.RUNNING
    s.num_computed_tokens = computed
    s.block_table = sched.pool.allocate(blocks_needed(computed, sched.block_size))
    sched.running.append(s)
    return s


def test_victim_is_the_latest_admitted_row_not_yet_scheduled():
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
