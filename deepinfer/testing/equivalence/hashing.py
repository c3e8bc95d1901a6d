"""Prefix hashes: distinct prefixes (or salts) never share a block hash in the test space.

The contract (``hash_blocks(tokens, block_size, salt) -> list``): one hash per full block of ``tokens``,
block i's hash standing for (salt, tokens[:(i + 1) * block_size]). The oracle draws sequences over a tiny
vocabulary, so many share leading blocks or whole blocks at other offsets, and checks that two hashes are
equal exactly when what they stand for is equal (any block index, any sequence, any salt).
"""

from __future__ import annotations

from typing import Callable

import attrs
from hypothesis import strategies as st


@attrs.frozen
class HashCase:
    block_size: int
    seqs: list  # [(salt or None, tokens)]


@st.composite
def hash_cases(draw, max_seqs: int = 6, max_len: int = 16) -> HashCase:
    bs = draw(st.integers(1, 4))
    vocab = draw(st.sampled_from([2, 3, 300]))  # 300: tokens that need more than one byte
    base = draw(st.lists(st.integers(0, vocab - 1), max_size=max_len))
    seqs = []
    for _ in range(draw(st.integers(2, max_seqs))):
        keep = draw(st.integers(0, len(base)))  # a shared prefix, then its own tail
        tail = draw(st.lists(st.integers(0, vocab - 1), max_size=max_len - keep))
        seqs.append((draw(st.sampled_from([None, "a", "b"])), base[:keep] + tail))
    return HashCase(block_size=bs, seqs=seqs)


def prefix_cache_hasher(identity: str = "deepinfer-equivalence-kit") -> Callable:
    """Our implementation: core.prefix_cache.block_hashes chained from root_key(identity, salt)."""
    from ...core.prefix_cache import block_hashes, root_key

    return lambda tokens, block_size, salt: block_hashes(root_key(identity, salt), list(tokens), block_size)


def check_hashes(hash_blocks: Callable, case: HashCase) -> None:
    """Every hash stands for one (salt, prefix), and the same (salt, prefix) always gets the same hash."""
    bs = case.block_size
    meaning: dict = {}  # hash -> (salt, prefix)
    given: dict = {}  # (salt, prefix) -> hash
    for salt, tokens in case.seqs:
        hashes = hash_blocks(list(tokens), bs, salt)
        assert len(hashes) == len(tokens) // bs, f"{len(hashes)} hashes for {len(tokens)} tokens, block size {bs}"
        for i, h in enumerate(hashes):
            what = (salt, tuple(tokens[:(i + 1) * bs]))
            other = meaning.setdefault(h, what)
            assert other == what, f"one hash for two prefixes (block size {bs}): {other} and {what}"
            assert given.setdefault(what, h) == h, f"two hashes for one prefix (block size {bs}): {what}"
