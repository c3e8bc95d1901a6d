"""The block pool of data-parallel attention: one partition of block ids per rank.

With ``data_parallel_size`` D, a sequence lives on rank ``state slot mod D`` (parallel/workers.py, ``dp_rows``),
and that rank alone holds its KV. ``RankPools`` gives rank r the block ids ``[r N, (r + 1) N)`` (N: the blocks one
rank's cache holds, what the KV plan sized for one device), so a sequence's blocks all come from its rank's
partition and each rank's cache is N blocks, not the whole pool: the rank subtracts ``r N`` from the ids it reads.

The scheduler asks ``part_of(state slot)`` for the pool a sequence allocates from (a plain BlockPool is its own
only partition) and ``free_for(slot)`` to put a new sequence on the rank with the most room. Prefix caching is not
supported here (data-parallel attention refuses it: a cached block would be hit from another rank).
"""

from __future__ import annotations

from .kv_cache import BlockPool


class _Part:
    """Rank r's partition: a BlockPool of N local ids, handed out as global ids (offset ``r N``)."""

    def __init__(self, num_blocks: int, offset: int):
        self.inner, self.offset = BlockPool(num_blocks), offset

    @property
    def num_free(self) -> int:
        return self.inner.num_free

    def can_allocate(self, n: int) -> bool:
        return self.inner.can_allocate(n)

    def allocate(self, n: int) -> list:
        return [b + self.offset for b in self.inner.allocate(n)]


class RankPools:
    """D partitions of ``blocks_per_rank`` blocks; block id b belongs to rank ``b // blocks_per_rank``."""

    def __init__(self, blocks_per_rank: int, num_ranks: int):
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1")
        self.blocks_per_rank, self.num_ranks = blocks_per_rank, num_ranks
        self.parts = [_Part(blocks_per_rank, r * blocks_per_rank) for r in range(num_ranks)]
        self.num_blocks = blocks_per_rank * num_ranks

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self.parts)

    def part_of(self, state_slot: int) -> _Part:
        if state_slot < 0:
            raise ValueError("a sequence allocates KV blocks only once it holds a state slot (its rank)")
        return self.parts[state_slot % self.num_ranks]

    def free_for(self, state_slot: int) -> int:
        return self.part_of(state_slot).num_free

    def rank_of(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block!r} is out of range [0, {self.num_blocks})")
        return block // self.blocks_per_rank

    def free(self, blocks) -> None:
        by_rank: dict = {}
        for b in blocks:
            by_rank.setdefault(self.rank_of(b), []).append(b - self.rank_of(b) * self.blocks_per_rank)
        for r, local in by_rank.items():
            self.parts[r].inner.free(local)

    def ref_count(self, block: int) -> int:
        return self.parts[self.rank_of(block)].inner.ref_count(block % self.blocks_per_rank)
