"""BlockPool under random allocate / share / free, checked against a plain ref-count model (hypothesis stateful)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deepinfer.core.kv_cache import BlockPool, NoFreeBlocks, blocks_needed


class BlockPoolMachine(RuleBasedStateMachine):
    """The model: block id -> number of owners. A block is in use iff it has an owner."""

    @initialize(num_blocks=st.integers(1, 24))
    def setup(self, num_blocks):
        self.pool = BlockPool(num_blocks)
        self.refs = {}  # block -> owners (> 0); absent = free

    def _snapshot(self):
        return self.pool.num_free, [self.pool.ref_count(b) for b in range(self.pool.num_blocks)]

    def _in_use(self):
        return sorted(self.refs)

    @rule(n=st.integers(0, 8))
    def allocate(self, n):
        free_before = self.pool.num_blocks - len(self.refs)
        if n > free_before:
            before = self._snapshot()
            with pytest.raises(NoFreeBlocks):
                self.pool.allocate(n)
            assert self._snapshot() == before, "a failed allocation changed the pool"
            assert not self.pool.can_allocate(n)
            return
        assert self.pool.can_allocate(n)
        got = self.pool.allocate(n)
        assert len(got) == n
        assert len(set(got)) == n, f"allocate handed out a block twice in one call: {got}"
        for b in got:
            assert 0 <= b < self.pool.num_blocks
            assert b not in self.refs, f"block {b} handed out while in use ({self.refs[b]} owners)"
            self.refs[b] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def share(self, data):
        b = data.draw(st.sampled_from(self._in_use()))
        assert self.pool.share(b) == b
        self.refs[b] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free_some(self, data):
        blocks = data.draw(st.lists(st.sampled_from(self._in_use()), min_size=1, max_size=4, unique=True))
        self.pool.free(blocks)
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]

    @precondition(lambda self: len(self.refs) < self.pool.num_blocks)
    @rule(data=st.data())
    def share_free_block_fails(self, data):
        b = data.draw(st.sampled_from([b for b in range(self.pool.num_blocks) if b not in self.refs]))
        before = self._snapshot()
        with pytest.raises(ValueError, match=f"block {b} is free"):
            self.pool.share(b)
        assert self._snapshot() == before

    @rule(data=st.data())
    def over_free_fails(self, data):
        """Free a list that drops some block more often than it has owners: an error, and nothing changes."""
        n = self.pool.num_blocks
        blocks = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6))
        extra = data.draw(st.integers(0, n - 1))
        # Make sure at least one block is dropped more times than it is owned.
        blocks = blocks + [extra] * (self.refs.get(extra, 0) + 1 - blocks.count(extra))
        blocks = data.draw(st.permutations(blocks))
        before = self._snapshot()
        with pytest.raises(ValueError, match="freed more times"):
            self.pool.free(blocks)
        assert self._snapshot() == before, "a failed free changed the pool (it must be all or nothing)"

    @rule(block=st.sampled_from([-1, -2, 10**6]))
    def out_of_range_ids_fail(self, block):
        before = self._snapshot()
        with pytest.raises(ValueError, match="out of range"):
            self.pool.share(block)
        with pytest.raises(ValueError, match="out of range"):
            self.pool.free([block])
        assert self._snapshot() == before

    @invariant()
    def counts_match_model(self):
        pool = self.pool
        in_use = sum(1 for b in range(pool.num_blocks) if pool.ref_count(b) > 0)
        assert pool.num_free + in_use == pool.num_blocks, "blocks leaked or double counted"
        assert pool.num_free == pool.num_blocks - len(self.refs)
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == self.refs.get(b, 0), f"block {b}"


BlockPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_pool_state_machine = BlockPoolMachine.TestCase


def test_free_list_after_drain_and_refill():
    pool = BlockPool(4)
    a = pool.allocate(4)
    assert sorted(a) == [0, 1, 2, 3] and pool.num_free == 0
    with pytest.raises(NoFreeBlocks, match="asked for 1 blocks, 0 free of 4"):
        pool.allocate(1)
    pool.share(a[0])
    pool.free(a)  # a[0] keeps one owner
    assert pool.num_free == 3 and pool.ref_count(a[0]) == 1
    assert a[0] not in pool.allocate(3)


def test_over_free_within_one_call_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError, match="freed more times"):
        pool.free([b, b])


@pytest.mark.parametrize("n", [0, -3])
def test_pool_needs_a_block(n):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(n)


def test_negative_allocation_is_an_error():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="cannot allocate -1"):
        pool.allocate(-1)
    assert pool.num_free == 3


@pytest.mark.parametrize("tokens,size,want", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (5, 1, 5)])
def test_blocks_needed(tokens, size, want):
    assert blocks_needed(tokens, size) == want
