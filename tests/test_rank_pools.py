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
    used = [set() for _ in range(D)]  # blocks in use (a prefix hit shares them)
    for s in sched.running:
        rank = s.state_slot % D
        assert all(b // N == rank for b in s.block_table), f"slot {s.state_slot} holds blocks {s.block_table}"
        used[rank] |= set(s.block_table)
    assert [N - p.num_free for p in pools.parts] == [len(u) for u in used], "a partition leaked blocks"


def until_done(sched: Scheduler, seqs: list):
    """Add seqs, then yield once per step while any is unfinished (at most 2000 steps: no livelock)."""
    for s in seqs:
        sched.add(s)
    for _ in range(2000):
        if not sched.has_unfinished():
            return
        yield
    raise AssertionError("livelock")


@given(st.integers(2, 3), st.sampled_from([2, 4]), st.integers(0, 6),
       st.lists(st.tuples(st.integers(1, 24), st.integers(1, 10)), min_size=1, max_size=9), st.integers(1, 6))
@settings(max_examples=40, deadline=None)
def test_sequences_stay_in_their_ranks_blocks(D, block_size, spare, reqs, max_seqs):
    longest = max(p + o for p, o in reqs)
    pools = RankPools(blocks_needed(longest, block_size) + spare, D)  # each rank can hold the longest alone
    sched = Scheduler(pools, block_size, max_seqs * D, 32, watermark=0.0)
    seqs = [Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=[(i * 31 + j) % 997 for j in range(p)],
                     num_prompt_tokens=p, params=PARAMS, arrival=i) for i, (p, _) in enumerate(reqs)]
    for _ in until_done(sched, seqs):
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


# ------------------------------------------------------------------------------------------ prefix caching


def cached_seq(i: int, tokens: list) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    params=PARAMS, arrival=i, cache_root=b"root")


@given(st.integers(2, 3), st.sampled_from([2, 4]),
       st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9), st.integers(1, 6)), min_size=1, max_size=8),
       st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_prefix_hits_come_from_the_sequences_rank(D, block_size, reqs, max_seqs):
    """Per-rank prefix caches under the real scheduler, registering blocks as the engine does: every sequence's
    blocks (its hits included) lie in its rank's partition, each rank's cache names only its own blocks, and
    every block is free again at the end (no owner leaked by a hit)."""
    prefixes = [[p * 100 + j for j in range(8)] for p in range(3)]
    pools = RankPools(blocks_needed(8 + 9 + 6, block_size) + 4, D)
    cache = pools.prefix_cache(block_size)
    sched = Scheduler(pools, block_size, max_seqs * D, 16, watermark=0.0, prefix=cache)
    seqs = [cached_seq(i, prefixes[p] + [1000 + i * 10 + j for j in range(t)]) for i, (p, t, _) in enumerate(reqs)]
    for _ in until_done(sched, seqs):
        batch = sched.schedule()
        check_partitions(sched, pools)
        if batch is None:
            continue
        sched.update(batch)
        for s, smp in zip(batch.seqs, batch.samples):
            cache.commit(s, s.num_computed_tokens)
            if smp:
                s.token_ids.append(7)
                if len(s.output_token_ids) == reqs[s.seq_id][2]:
                    sched.finish(s)
        for r, c in enumerate(cache.caches):
            assert all(b // pools.blocks_per_rank == r for b in c.hash_of), f"rank {r} caches {list(c.hash_of)}"
    assert [p.num_free for p in pools.parts] == [pools.blocks_per_rank] * D


def test_a_request_goes_to_the_rank_holding_its_prefix():
    """A prefix cached on one rank draws the next requests sharing it there (the other rank has more free
    blocks), until that rank runs ROUTE_SLACK more sequences than the other; a request without a cached prefix
    goes where the room is."""
    from deepinfer.core.rank_pools import ROUTE_SLACK

    pools = RankPools(16, 2)
    cache = pools.prefix_cache(4)
    sched = Scheduler(pools, 4, 8, 64, watermark=0.0, prefix=cache)
    shared = list(range(1, 9))  # two full blocks
    first = cached_seq(0, shared + [50])
    sched.add(first)
    sched.update(sched.schedule())
    cache.commit(first, first.num_computed_tokens)
    r = first.state_slot % 2
    assert len(cache.caches[r].block_of) == 2 and not cache.caches[1 - r].block_of
    sched.finish(first)  # its blocks stay cached on rank r, free
    pools.parts[r].allocate(5)  # rank r now has less room than the other
    sharing = [cached_seq(i, shared + [60 + i]) for i in range(1, 2 + ROUTE_SLACK)]
    for s in sharing:
        sched.add(s)
    sched.update(sched.schedule())
    ranks = [s.state_slot % 2 for s in sharing]
    assert ranks == [r] * ROUTE_SLACK + [1 - r], ranks  # then rank r runs ROUTE_SLACK more than the other
    assert [s.num_cached_tokens for s in sharing] == [8] * ROUTE_SLACK + [0]
    other = cached_seq(9, [90, 91, 92])
    sched.add(other)
    sched.update(sched.schedule())
    assert other.state_slot % 2 == 1 - r and other.num_cached_tokens == 0
