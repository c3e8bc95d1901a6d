"""The equivalence kit: hypothesis strategies and oracles that hold a compact implementation to a plain one.

One module per property; each has a case class, a strategy drawing cases, our implementation(s), and a
``check_*(implementation, case)`` oracle that raises AssertionError naming what differs:

- ring.py      the SWA ring with slack and rollback == a list            check_ring(make, case)
- paged.py     a paged cache read through block tables == contiguous KV  check_paged(read, case)
- prefix.py    a prefix-cache hit == cold prefill (exact reuse)          check_prefix_hit(make_llm, case)
- batching.py  rows in a padded or ragged batch == each row alone        check_batch(run, case)
- tiers.py     host/disk tier put then get == the payload, bit for bit   check_tier(make, case)
- hashing.py   distinct (salt, prefix) pairs never share a block hash    check_hashes(hash_blocks, case)

Use them from your own tests::

    from hypothesis import given
    from deepinfer.testing.equivalence import ring

    @given(ring.ring_cases())
    def test_my_ring(case):
        ring.check_ring(MyRing, case)

or let the pytest plugin (deepinfer.testing.pytest_plugin) run the whole suite (suite.py) against the
implementations your pytest configuration names.
"""

from . import batching, hashing, paged, prefix, ring, tiers

__all__ = ["batching", "hashing", "paged", "prefix", "ring", "tiers"]
