"""The paged KV block pool: fixed-size blocks, ref counts, block tables.

The pool only does bookkeeping (which block ids are in use and by how many
owners); the KV tensors themselves are laid out by the model (see
models/base.py), indexed by slot = block_id * block_size + offset.
"""

from __future__ import annotations

from collections import Counter, deque


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler preempts and retries."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    """Free list plus a reference count per block. A block is free iff its count is 0."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

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
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]
