"""The paged KV block pool: fixed-size blocks, ref counts, block tables.

The pool only does bookkeeping (which block ids are in use and by how many
owners); the KV tensors themselves are laid out by the model (see
models/base.py), indexed by slot = block_id * block_size + offset.

Prefix caching (core/prefix_cache.py) marks blocks whose content is known by hash (``mark_cached``). A
cached block whose last owner frees it is not wiped: it waits in least-recently-freed order among the free
blocks, where a later request can take it back (``revive``). Allocation takes never-cached free blocks
first, then evicts cached ones, oldest first, telling ``on_evict`` (which drops the hash, or moves the
content to a slower tier) before the block is reused.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Callable, Optional


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler preempts and retries."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    """Free list plus a reference count per block. A block is free iff its count is 0."""

    def __init__(self, num_blocks: int, on_evict: Optional[Callable[[list], None]] = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))  # free, holding nothing anyone looks up
        self._cached_free: OrderedDict = OrderedDict()  # free but cached, least recently freed first
        self._cached: set = set()  # blocks marked cached (in use or free)
        self._refs = [0] * num_blocks
        self.on_evict = on_evict  # called with the cached blocks an allocation is about to reuse

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never-cached free ones and evictable cached ones."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def part_of(self, state_slot: int) -> "BlockPool":
        """The pool a sequence allocates from: this one (core/rank_pools.py partitions blocks by rank)."""
        return self

    def allocate(self, n: int) -> list:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free of {self.num_blocks}")
        out = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        evict = [self._cached_free.popitem(last=False)[0] for _ in range(n - len(out))]
        if evict:
            self._cached.difference_update(evict)
            if self.on_evict is not None:
                self.on_evict(evict)
            out += evict
        for b in out:
            self._refs[b] = 1
        return out

    # Prefix caching.
    def mark_cached(self, block: int) -> None:
        """An allocated block's content is now findable by hash: when freed, keep it until evicted."""
        self._check_id(block)
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is free and cannot be marked cached")
        self._cached.add(block)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def uncache_free(self, blocks) -> None:
        """Unmark free cached blocks: they become plain free blocks (prefix-cache reset)."""
        for b in blocks:
            if b in self._cached_free:
                del self._cached_free[b]
                self._cached.discard(b)
                self._free.append(b)

    def revive(self, block: int) -> int:
        """Add an owner to a cached block, in use or waiting among the free ones; returns the block id."""
        self._check_id(block)
        if block not in self._cached:
            raise ValueError(f"block {block} is not cached")
        if self._refs[block] == 0:
            del self._cached_free[block]
        self._refs[block] += 1
        return block

    def _check_id(self, block) -> None:
        # A negative id would silently index _refs from the end.
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block!r} is out of range [0, {self.num_blocks})")

    def share(self, block: int) -> int:
        """Add an owner to an allocated block (prefix sharing); returns the block id."""
        self._check_id(block)
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is free and cannot be shared")
        self._refs[block] += 1
        return block

    def free(self, blocks) -> None:
        """Drop one owner of each block; blocks whose count reaches 0 return to the free list.

        All or nothing: an over-free raises before any count changes."""
        blocks = list(blocks)
        drops = Counter(blocks)
        for b, k in drops.items():
            self._check_id(b)
            if self._refs[b] < k:
                raise ValueError(f"block {b} freed more times than it was allocated or shared")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._cached:
                    self._cached_free[b] = None  # most recently freed: evicted last
                else:
                    self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]
