"""Data-parallel attention's block pool (core/rank_pools.py) under the real scheduler, in one process.

A fake model (no forward) drives hypothesis-drawn workloads to completion over D partitions: every running
sequence's blocks lie in its rank's partition (state slot mod D), so each rank's cache holds only its own
sequences' KV; the partitions never leak; a step preempts only when some rank's running rows outgrow that
rank's free blocks (a full rank does not evict another rank's sequences); and every request finishes.
The multi-process check (each rank's engine holds its partition and the tokens equal one process's) is
tests/test_parallel_eplb.py's data-parallel test; test_parallel.py's data-parallel tests run on these pools too.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from deepinfer.core.kv_cache import blocks_needed
from deepinfer.core.params import SamplingParams
from deepinfer.core.rank_pools import RankPools
from deepinfer.core.scheduler import Scheduler
from deepinfer.core.state import Sequence, SeqStatus

PARAMS = SamplingParams(max_tokens=64, temperature=0.0)


def check_partitions(sched: Scheduler, pools: RankPools) -> None:
    D, N = pools.num_ranks, pools.blocks_per_rank
    used = [0] * D
    for s in sched.running:
        rank = s.state_slot % D
        assert all(b // N == rank for b in s.block_table), f"slot {s.state_slot} holds blocks {s.block_table}"
        used[rank] += len(s.block_table)
    assert [N - p.num_free for p in pools.parts] == used, "a partition leaked blocks"


@given(st.integers(2, 3), st.sampled_from([2, 4]), st.integers(0, 6),
       st.lists(st.tuples(st.integers(1, 24), st.integers(1, 10)), min_size=1, max_size=9), st.integers(1, 6))
@settings(max_examples=40, deadline=None)
def test_sequences_stay_in_their_ranks_blocks(D, block_size, spare, reqs, max_seqs):
    longest = max(p + o for p, o in reqs)
    pools = RankPools(blocks_needed(longest, block_size) + spare, D)  # each rank can hold the longest alone
    sched = Scheduler(pools, block_size, max_seqs * D, 32, watermark=0.0)
    seqs = [Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=[(i * 31 + j) % 997 for j in range(p)],
                     num_prompt_tokens=p, params=PARAMS, arrival=i) for i, (p, _) in enumerate(reqs)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 2000, "livelock"
        before = list(sched.running)
        demand = [0] * D
        for s in before:
            demand[s.state_slot % D] += max(0, blocks_needed(s.num_tokens, block_size) - len(s.block_table))
        free = [p.num_free for p in pools.parts]
        rank_of = {id(s): s.state_slot % D for s in before}
        n_pre = sched.num_preemptions
        batch = sched.schedule()
        check_partitions(sched, pools)
        preempted = [s for s in before if s.status is SeqStatus.WAITING]
        assert sched.num_preemptions - n_pre == len(preempted)
        for s in preempted:  # only a rank short of blocks gives any up
            r = rank_of[id(s)]
            assert demand[r] > free[r], f"rank {r} lost a sequence with demand {demand}, free {free}"
            assert s.num_computed_tokens == 0 and s.block_table == []
        if batch is None:
            continue
        sched.update(batch)
        for s, smp in zip(batch.seqs, batch.samples):
            if smp:
                s.token_ids.append(7)
                if len(s.output_token_ids) == reqs[s.seq_id][1]:
                    sched.finish(s)
    assert all(s.status is SeqStatus.FINISHED for s in seqs)
    assert [p.num_free for p in pools.parts] == [pools.blocks_per_rank] * D


def test_a_full_rank_preempts_its_own_sequence_not_the_latest():
    """Rank 0's two sequences outgrow its 3 blocks while rank 1 needs none: the victim is rank 0's latest, not the
    latest overall (rank 1's, whose blocks would not help)."""
    pools = RankPools(3, 2)
    sched = Scheduler(pools, 8, 4, 64, watermark=0.0)
    seqs = [Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=list(range(1, n + 1)), num_prompt_tokens=n,
                     params=PARAMS, arrival=i) for i, n in enumerate((7, 3, 7, 15))]

    def step():
        batch = sched.schedule()
        check_partitions(sched, pools)
        sched.update(batch)
        for s in batch.seqs:
            s.token_ids.append(7)

    for s in seqs[:3]:
        sched.add(s)
    step()  # one block each: slots 0, 1, 2 on ranks 0, 1, 0
    sched.add(seqs[3])  # the latest key, two blocks: rank 1 (2 free; rank 0 has 1)
    step()
    assert [s.state_slot % 2 for s in seqs] == [0, 1, 0, 1] and sched.num_preemptions == 0
    step()  # A and C reach 9 tokens: a second block each, rank 0 has 1 free; rank 1's sequences need none
    assert [s.num_preemptions for s in seqs] == [0, 0, 1, 0]


def test_bad_ids_are_refused():
    pools = RankPools(4, 2)
    with pytest.raises(ValueError, match=r"block id 8 is out of range \[0, 8\)"):
        pools.free([8])
    with pytest.raises(ValueError, match="only once it holds a state slot"):
        pools.part_of(-1)
