"""The equivalence kit (deepinfer/testing/equivalence) and its pytest plugin: every oracle passes on our
implementation and fails on a deliberately broken one, so the kit can fail; the plugin runs the suite
against a named implementation and reports a broken one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings

from deepinfer import LLM
from deepinfer.testing.ced import build_ced_checkpoint
from deepinfer.testing.equivalence import batching, hashing, paged, prefix, ring, tiers
from deepinfer.testing.models import build_tiny_hf_model


def holds(check, impl, strategy, n: int = 40) -> None:
    @settings(max_examples=n, deadline=None, database=None)
    @given(strategy)
    def run(case):
        check(impl, case)

    run()


def breaks(check, impl, strategy, n: int = 200) -> None:
    @settings(max_examples=n, deadline=None, database=None, report_multiple_bugs=False)
    @given(strategy)
    def run(case):
        check(impl, case)

    with pytest.raises(AssertionError):
        run()


# ----------------------------------------------------------------------------------------------------------
# Broken twins.

class ForgetfulRing(ring.ListRing):
    """Ignores rollback: the rejected tokens stay in the window."""

    def rollback(self, k):
        pass


class SlacklessRing:
    """n_win slots only: a rollback exposes slots the rejected tokens overwrote."""

    def __init__(self, n_win, allowance, width):
        self.inner = ring.CEDRing(n_win, 0, width)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def off_by_one_block(cache, tables, lengths, bs):
    return [cache[torch.tensor([t[(p // bs + 1) % len(t)] * bs + p % bs for p in range(n)], dtype=torch.long)]
            for t, n in zip(tables, lengths)]


def contiguous_blocks(cache, tables, lengths, bs):
    return [cache[t[0] * bs:t[0] * bs + n] for t, n in zip(tables, lengths)]


class LossyTier:
    """Stores every tensor through float64: int64 beyond 2**53, NaN payloads and more come back changed."""

    def __init__(self):
        self.inner = tiers.host_tier()

    def put(self, key, payload):
        return self.inner.put(key, {k: v.to(torch.float64).to(v.dtype) for k, v in payload.items()})

    def get(self, key):
        return self.inner.get(key)


def parentless_hasher(tokens, bs, salt):
    """Hashes each block's own tokens: blocks at the same offset after different prefixes collide."""
    import hashlib

    return [hashlib.sha256(repr((salt, tokens[i * bs:(i + 1) * bs])).encode()).digest() for i in range(len(tokens) // bs)]


def saltless_hasher(tokens, bs, salt):
    return hashing.prefix_cache_hasher()(tokens, bs, None)


def left_padded_full(net, pad_id: int = 0):
    """Left padding without a mask: the pads are attended."""

    def run(rows):
        N = max(len(r) for r in rows)
        ids = torch.tensor([[pad_id] * (N - len(r)) + list(r) for r in rows])
        out = net.forward_full(ids)
        return [out[i, N - len(r):] for i, r in enumerate(rows)]

    return run


# ----------------------------------------------------------------------------------------------------------
# The cheap oracles.

def test_ring_oracle():
    holds(ring.check_ring, ring.CEDRing, ring.ring_cases())
    breaks(ring.check_ring, ForgetfulRing, ring.ring_cases())
    breaks(ring.check_ring, SlacklessRing, ring.ring_cases())


def test_paged_oracle():
    holds(paged.check_paged, paged.engine_read, paged.paged_kv_cases())
    breaks(paged.check_paged, off_by_one_block, paged.paged_kv_cases())
    breaks(paged.check_paged, contiguous_blocks, paged.paged_kv_cases())


def test_tier_oracle(tmp_path):
    holds(tiers.check_tier, tiers.host_tier, tiers.tier_cases())
    holds(tiers.check_tier, tiers.disk_tier(tmp_path), tiers.tier_cases(), n=20)
    breaks(tiers.check_tier, LossyTier, tiers.tier_cases())


def test_hash_oracle():
    holds(hashing.check_hashes, hashing.prefix_cache_hasher(), hashing.hash_cases(), n=100)
    breaks(hashing.check_hashes, parentless_hasher, hashing.hash_cases())
    breaks(hashing.check_hashes, saltless_hasher, hashing.hash_cases())


# ----------------------------------------------------------------------------------------------------------
# The model-backed oracles.

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_tiny_hf_model(path, "llama", vocab_size=300)
    return str(path)


def test_batch_oracle(tmp_path, tiny_llama):
    ced = build_ced_checkpoint(tmp_path / "ced", vocab_size=300, num_layers=3, num_encoder_layers=1,
                               layer_modes=("full", "full", "reindex"), hidden_size=32, head_dim=32, rope_dim=8,
                               num_heads=2, out_groups=1, out_group_dim=32, q_lora_rank=32, n_win=4,
                               index_topk=4, pool_block=2, pool_blocks=2, moe_intermediate_size=32,
                               n_routed_experts=4, index_heads=2, index_head_dim=32, global_kv_format="fp32",
                               index_k_format="fp32", swa_kv_format="fp32")
    net = LLM(str(tmp_path / "ced"), dtype="float32", block_size=2).engine.model
    cases = batching.batch_cases(ced.vocab_size, max_len=8)
    holds(batching.check_batch, batching.padded_full(net), cases, n=5)
    breaks(batching.check_batch, left_padded_full(net), cases, n=20)
    llama = LLM(tiny_llama, dtype="float32").engine.model
    holds(batching.check_batch, batching.ragged_engine(llama, block_size=4, chunk=3),
          batching.batch_cases(300, max_len=8), n=5)


def test_prefix_hit_oracle(tiny_llama):
    llms = {on: LLM(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64, enable_prefix_caching=on)
            for on in (True, False)}
    holds(prefix.check_prefix_hit, llms.get, prefix.prefix_cases(300, 4), n=4)

    class Stale:
        """A caching engine whose cached blocks go stale between requests (noise added to the KV)."""

        def __init__(self, llm):
            self.llm = llm

        def reset_prefix_cache(self):
            return self.llm.reset_prefix_cache()

        def generate(self, *a, **kw):
            out = self.llm.generate(*a, **kw)
            for t in self.llm.engine.kv_cache:
                t.add_(torch.randn_like(t) * 0.1)
            return out

    breaks(prefix.check_prefix_hit, lambda on: Stale(llms[True]) if on else llms[False],
           prefix.prefix_cases(300, 4), n=4)


# ----------------------------------------------------------------------------------------------------------
# The pytest plugin, in a subprocess over a scratch package.

def run_kit(tmp_path, ini: str, body: str, *args) -> subprocess.CompletedProcess:
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n" + textwrap.dedent(ini))
    (tmp_path / "myring.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path), *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path)


def test_plugin_runs_the_suite_against_a_named_ring_and_reports_a_broken_one(tmp_path):
    body = """
        from deepinfer.testing.equivalence.ring import CEDRing, ListRing

        class Forgetful(ListRing):
            def rollback(self, k):
                pass
        """
    ini = """
        deepinfer_compact = ["ring = myring:Forgetful"]
        deepinfer_kit_examples = "100"
        """
    bad = run_kit(tmp_path, ini, body)
    assert bad.returncode == 1 and "test_ring_window_matches_a_list" in bad.stdout, bad.stdout + bad.stderr
    good = run_kit(tmp_path, ini, body, "--deepinfer-compact", "ring=myring:CEDRing")  # the flag wins
    assert good.returncode == 0 and "1 passed" in good.stdout, good.stdout + good.stderr
    wrong = run_kit(tmp_path, 'deepinfer_compact = ["rings = myring:CEDRing"]\n', body)
    assert wrong.returncode == 4 and "KIND = MODULE:ATTR" in wrong.stderr, wrong.stdout + wrong.stderr
