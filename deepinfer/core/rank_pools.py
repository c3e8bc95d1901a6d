"""The block pool of data-parallel attention: one partition of block ids per rank.

With ``data_parallel_size`` D, a sequence lives on rank ``state slot mod D`` (parallel/workers.py, ``dp_rows``),
and that rank alone holds its KV. ``RankPools`` gives rank r the block ids ``[r N, (r + 1) N)`` (N: the blocks one
rank's cache holds, what the KV plan sized for one device), so a sequence's blocks all come from its rank's
partition and each rank's cache is N blocks, not the whole pool: the rank subtracts ``r N`` from the ids it reads.

The scheduler asks ``part_of(state slot)`` for the pool a sequence allocates from (a plain BlockPool is its own
only partition) and ``free_for(slot)`` to put a new sequence on the rank with the most room.

Prefix caching (``RankPrefixCache``): one PrefixCache per partition, so a cached block is found only by a
sequence on the rank that holds it, and the same prefix may be cached on several ranks. Admission routes a
sequence to the rank that holds the longest run of its prefix (``cached_blocks``, when that rank has a free state
slot, room for the rest of the prompt and not ROUTE_SLACK more running sequences than the least busy rank), else
to the rank with the most free blocks, where the prefix is then cached too; see docs/decisions.md.
"""

from __future__ import annotations

from typing import Optional

from .kv_cache import BlockPool, blocks_needed
from .prefix_cache import PrefixCache, hash_at


# A sequence goes to the rank holding its prefix unless that rank runs this many more sequences than the least
# busy one: a shared prefix (a system prompt) would otherwise put every request on one rank.
ROUTE_SLACK = 2


class _Part:
    """Rank r's partition: a BlockPool of N local ids, handed out and taken back as global ids (offset ``r N``);
    a PrefixCache runs over it as over a whole pool."""

    def __init__(self, num_blocks: int, offset: int):
        self.inner, self.offset = BlockPool(num_blocks), offset
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return self.inner.num_free

    @property
    def num_cached_free(self) -> int:
        return self.inner.num_cached_free

    def can_allocate(self, n: int) -> bool:
        return self.inner.can_allocate(n)

    def allocate(self, n: int) -> list:
        return [b + self.offset for b in self.inner.allocate(n)]

    def _local(self, blocks) -> list:
        return [b - self.offset for b in blocks]

    def free(self, blocks) -> None:
        self.inner.free(self._local(blocks))

    def revive(self, block: int) -> int:
        return self.inner.revive(block - self.offset) + self.offset

    def mark_cached(self, block: int) -> None:
        self.inner.mark_cached(block - self.offset)

    def ref_count(self, block: int) -> int:
        return self.inner.ref_count(block - self.offset)

    def uncache_free(self, blocks) -> None:
        self.inner.uncache_free(self._local(blocks))

    @property
    def on_evict(self):
        return self.inner.on_evict

    @on_evict.setter
    def on_evict(self, fn) -> None:
        self.inner.on_evict = None if fn is None else (lambda blocks: fn([b + self.offset for b in blocks]))


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
            by_rank.setdefault(self.rank_of(b), []).append(b)
        for r, mine in by_rank.items():
            self.parts[r].free(mine)  # (global ids: the partition takes its offset off)

    def ref_count(self, block: int) -> int:
        return self.parts[self.rank_of(block)].ref_count(block)

    def prefix_cache(self, block_size: int, mover=None) -> "RankPrefixCache":
        """The engine's prefix cache over these partitions (core/engine.py asks the pool for it)."""
        if mover is not None:
            raise ValueError("the prefix cache's host and disk tiers are not supported with data-parallel attention")
        return RankPrefixCache(self, block_size)


class RankPrefixCache:
    """One PrefixCache per rank's partition, behind PrefixCache's interface: a sequence looks up and registers
    its blocks in its own rank's cache (state slot mod D, taken before the lookup); ``cached_blocks`` says how
    much of its prefix each rank holds, for the scheduler to choose the rank."""

    mover = None

    def __init__(self, pools: RankPools, block_size: int):
        self.pools, self.block_size = pools, block_size
        self.caches = [PrefixCache(p, block_size) for p in pools.parts]

    def _of(self, seq) -> PrefixCache:
        self.pools.part_of(seq.state_slot)  # (a sequence without a slot is refused by name)
        return self.caches[seq.state_slot % self.pools.num_ranks]

    def lookup(self, seq, max_tokens: int) -> list:
        return self._of(seq).lookup(seq, max_tokens)

    def count(self, seq) -> None:
        self._of(seq).count(seq)

    def commit(self, seq, num_tokens: int) -> None:
        if seq.block_table:  # its blocks' rank: the sequence may already have given its slot back
            self.caches[self.pools.rank_of(seq.block_table[0])].commit(seq, num_tokens)

    def cached_blocks(self, seq, max_tokens: int) -> list:
        """[D] how many leading blocks of seq's prefix (of at most ``max_tokens`` tokens) each rank's cache holds;
        no owner is added."""
        limit = min(len(seq.token_ids), max_tokens) // self.block_size
        out = []
        for c in self.caches:
            n = 0
            while n < limit and hash_at(seq, self.block_size, n, limit) in c.block_of:
                n += 1
            out.append(n)
        return out

    def preferred_rank(self, seq, max_tokens: int, ranks, running: list) -> Optional[int]:
        """Among ``ranks`` (those with a free state slot), the one holding the longest run of seq's prefix, with
        room for the rest of its prompt and fewer than ROUTE_SLACK more running sequences (``running``: per rank)
        than the least busy of them; None when none does (the caller balances by free blocks)."""
        hits = self.cached_blocks(seq, max_tokens)
        need = blocks_needed(len(seq.token_ids), self.block_size)
        least = min(running[r] for r in ranks)
        fits = [r for r in ranks if hits[r] and self.pools.parts[r].num_free >= need - hits[r]
                and running[r] - least < ROUTE_SLACK]
        return max(fits, key=lambda r: (hits[r], self.pools.parts[r].num_free, -r)) if fits else None

    def summary(self) -> dict:
        """PrefixCache.summary summed over the ranks (hit rate over all lookups)."""
        parts = [c.summary() for c in self.caches]
        out = {k: sum(p[k] for p in parts) for k in parts[0] if k != "hit_rate"}
        out["hit_rate"] = out["hit_tokens"] / out["query_tokens"] if out["query_tokens"] else 0.0
        out["cached_blocks_per_rank"] = [p["cached_blocks"] for p in parts]
        return out

    def reset(self) -> int:
        return sum(c.reset() for c in self.caches)
