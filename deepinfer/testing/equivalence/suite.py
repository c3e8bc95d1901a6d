"""The kit's test suite, collected by deepinfer.testing.pytest_plugin against the configured implementations.

Each test takes its implementation from a fixture ``deepinfer_compact_<kind>`` (the plugin's default resolves
the name given in ``deepinfer_compact``; a conftest.py fixture of the same name overrides it) and draws
``deepinfer_kit_examples`` cases (the model-backed kinds batch and llm a fifth of them).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import batching, hashing, paged, prefix, ring, tiers


def _run(request, body, heavy: bool = False) -> None:
    n = int(request.config.getini("deepinfer_kit_examples"))
    n = max(1, n // 5) if heavy else n

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(data=st.data())
    def inner(data):
        body(data)

    inner()


def test_ring_window_matches_a_list(request, deepinfer_compact_ring):
    _run(request, lambda d: ring.check_ring(deepinfer_compact_ring, d.draw(ring.ring_cases())))


def test_paged_read_matches_contiguous(request, deepinfer_compact_paged):
    _run(request, lambda d: paged.check_paged(deepinfer_compact_paged, d.draw(paged.paged_kv_cases())))


def test_tier_round_trip_is_bit_exact(request, deepinfer_compact_tier):
    _run(request, lambda d: tiers.check_tier(deepinfer_compact_tier, d.draw(tiers.tier_cases())))


def test_distinct_prefixes_never_share_a_hash(request, deepinfer_compact_hash):
    _run(request, lambda d: hashing.check_hashes(deepinfer_compact_hash, d.draw(hashing.hash_cases())))


def test_batch_rows_match_rows_alone(request, deepinfer_compact_batch):
    vocab = getattr(deepinfer_compact_batch, "vocab_size", 64)
    _run(request, lambda d: batching.check_batch(deepinfer_compact_batch, d.draw(batching.batch_cases(vocab))),
         heavy=True)


def test_prefix_hit_matches_cold_prefill(request, deepinfer_compact_llm):
    vocab = getattr(deepinfer_compact_llm, "vocab_size", 64)
    bs = getattr(deepinfer_compact_llm, "block_size", 4)
    _run(request, lambda d: prefix.check_prefix_hit(deepinfer_compact_llm, d.draw(prefix.prefix_cases(vocab, bs))),
         heavy=True)
