"""Prefix caching (core/prefix_cache.py, stages/prefix_cache.py, stages/swa_replay.py): hashing, the pool's
cached blocks, and the engine serving hits with the outputs of cold prefill."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.core.kv_cache import BlockPool
from deepinfer.core.prefix_cache import PrefixCache, block_hashes, root_key
from deepinfer.testing.compare import NEAR_TIE, assert_same_or_near_tie
from deepinfer.testing.models import build_tiny_hf_model


# ----------------------------------------------------------------------------------------------------------
# Hashes and the pool.

@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(0, 50), max_size=24), b=st.lists(st.integers(0, 50), max_size=24),
       bs=st.integers(1, 5), salt_a=st.sampled_from([None, "x", "y"]), salt_b=st.sampled_from([None, "x", "y"]))
def test_blocks_share_a_hash_iff_their_whole_prefix_and_salt_agree(a, b, bs, salt_a, salt_b):
    ha = block_hashes(root_key("m", salt_a), a, bs)
    hb = block_hashes(root_key("m", salt_b), b, bs)
    assert len(ha) == len(a) // bs and len(hb) == len(b) // bs
    for i in range(min(len(ha), len(hb))):
        same = salt_a == salt_b and a[:(i + 1) * bs] == b[:(i + 1) * bs]
        assert (ha[i] == hb[i]) == same, i
    assert block_hashes(root_key("m"), a, bs) != block_hashes(root_key("n"), a, bs) or len(a) < bs


class _Seq:
    def __init__(self, tokens, root=b"r"):
        self.token_ids, self.cache_root = tokens, root
        self.block_hashes, self.block_table, self.num_committed_blocks = [], [], 0


def test_freed_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(4)
    cache = PrefixCache(pool, block_size=2)
    seqs = [_Seq([i, i, i, i]) for i in range(2)]
    for s in seqs:
        s.block_table = pool.allocate(2)
        cache.commit(s, 4)
    assert cache.summary()["cached_blocks"] == 4 and pool.num_free == 0
    pool.free(seqs[1].block_table)  # freed first: evicted first
    pool.free(seqs[0].block_table)
    assert pool.num_free == 4 and pool.num_cached_free == 4
    got = pool.allocate(1)
    assert got == [seqs[1].block_table[0]]
    assert cache.lookup(_Seq([1, 1, 1, 1, 9]), 4) == []  # its first block is gone: nothing after it is found
    hit = cache.lookup(_Seq([0, 0, 0, 0, 9]), 4)
    assert hit == seqs[0].block_table and all(pool.ref_count(b) == 1 for b in hit)
    assert cache.summary()["evictions"] == 1


def test_lookup_leaves_at_least_the_tokens_it_is_told():
    pool = BlockPool(8)
    cache = PrefixCache(pool, block_size=2)
    s = _Seq(list(range(6)))
    s.block_table = pool.allocate(3)
    cache.commit(s, 6)
    assert len(cache.lookup(_Seq(list(range(6))), 5)) == 2  # at most 5 tokens: two whole blocks
    assert len(cache.lookup(_Seq(list(range(7))), 6)) == 3


@settings(max_examples=60, deadline=None)
@given(n_cached=st.integers(0, 12), n_tokens=st.integers(0, 60), bs=st.integers(1, 4), diverge=st.integers(0, 60),
       max_tokens=st.integers(0, 70))
def test_lookup_hashes_only_as_far_as_it_walks(n_cached, n_tokens, bs, diverge, max_tokens):
    """A lookup finds the same blocks as against fully hashed sequences, having hashed at most about twice the
    blocks it found (plus the one that missed), never past its limit; commit then hashes the rest, each hash that
    of block_hashes over the whole prompt (computed here separately)."""
    pool = BlockPool(128)
    cache = PrefixCache(pool, block_size=bs)
    old = _Seq(list(range(n_cached * bs)))
    old.block_table = pool.allocate(n_cached)
    cache.commit(old, n_cached * bs)
    tokens = [t if i < diverge else 1000 + t for i, t in enumerate(range(n_tokens))]
    s = _Seq(tokens)
    hit = cache.lookup(s, max_tokens)
    limit = min(n_tokens, max_tokens) // bs
    want = 0
    full = block_hashes(b"r", tokens, bs)
    while want < min(limit, n_cached) and full[want] in cache.block_of:
        want += 1
    assert hit == old.block_table[:want]
    assert len(s.block_hashes) <= min(limit, max(2 * want, want + 1)) and s.block_hashes == full[:len(s.block_hashes)]
    s.block_table = hit + pool.allocate(len(tokens) // bs - len(hit))
    cache.commit(s, len(tokens))
    assert s.block_hashes == full


# ----------------------------------------------------------------------------------------------------------
# The engine.

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("pc")
    build_tiny_hf_model(d, "llama")
    return str(d)


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


def run(llm, prompts, params=GREEDY, **kw):
    out = llm.generate(prompts, params, use_tqdm=False, **kw)
    assert all(o.error is None for o in out), [o.error for o in out]
    return out


@settings(max_examples=8, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=4), shared=st.integers(0, 40),
       bs=st.sampled_from([2, 4, 16]), budget=st.sampled_from([5, 512]))
def test_hits_generate_what_cold_prefill_generates(tiny, lens, shared, bs, budget):
    g = torch.Generator().manual_seed(sum(lens) + shared)
    common = torch.randint(3, 400, (shared,), generator=g).tolist()
    prompts = [common + torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]
    kw = dict(num_kv_blocks=96, block_size=bs, max_num_batched_tokens=budget, max_num_seqs=4)
    cold = run(LLM(tiny, enable_prefix_caching=False, **kw), prompts)
    warm_llm = LLM(tiny, **kw)
    run(warm_llm, prompts[:1])  # caches the first prompt (and the common part)
    warm = run(warm_llm, prompts)
    want_hit = [min(len(common) if i else len(prompts[0]), len(p) - 1) // bs * bs for i, p in enumerate(prompts)]
    for i, (c, w) in enumerate(zip(cold, warm)):
        assert w.num_cached_tokens >= want_hit[i], (i, w.num_cached_tokens, want_hit[i])
        assert_same_or_near_tie(w.outputs[0].token_ids, c.outputs[0].token_ids, c.outputs[0].logprobs,
                                NEAR_TIE["float32"], what=f"prompt {i}")
    stats = warm_llm.cache_stats()
    assert stats["hit_tokens"] >= sum(want_hit)


def test_hit_skips_the_cached_tokens(tiny):
    llm = LLM(tiny, num_kv_blocks=64, block_size=4)
    prompt = list(range(5, 46))  # 41 tokens: 10 full blocks cacheable (40 tokens, one left to compute)
    run(llm, [prompt])
    before = llm.engine.stats["forward_tokens"]
    out = run(llm, [prompt])[0]
    assert out.num_cached_tokens == 40
    assert llm.engine.stats["forward_tokens"] - before == 1 + GREEDY.max_tokens - 1  # 1 prompt token, 7 decodes


def test_n_sequences_share_the_prompt(tiny):
    llm = LLM(tiny, num_kv_blocks=64, block_size=4)
    prompt = list(range(5, 46))
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=7, n=3, ignore_eos=True)
    out = run(llm, [prompt], params)[0]
    # The first sequence computes the 41 prompt tokens, the others only the one after the 40 cached ones.
    assert llm.engine.stats["forward_tokens"] == 41 + 2 * 1 + 3 * 3
    assert out.num_cached_tokens == 40 and len(out.outputs) == 3
    off = LLM(tiny, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    ref = run(off, [prompt], params)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]  # seeded: same draws


def test_cache_salt_separates_and_a_bad_salt_fails_alone(tiny):
    llm = LLM(tiny, num_kv_blocks=64, block_size=4)
    prompt = list(range(5, 30))
    run(llm, [{"prompt_token_ids": prompt, "cache_salt": "a"}])
    same, other, none = run(llm, [{"prompt_token_ids": prompt, "cache_salt": "a"},
                                  {"prompt_token_ids": prompt, "cache_salt": "b"}, prompt])
    assert same.num_cached_tokens == 24 and other.num_cached_tokens == 0 and none.num_cached_tokens == 0
    bad, good = llm.generate([{"prompt_token_ids": prompt, "cache_salt": 3}, prompt], GREEDY, use_tqdm=False)
    assert bad.error is not None and "cache_salt must be a string" in bad.error
    assert good.error is None and len(good.outputs[0].token_ids) == GREEDY.max_tokens


def test_eviction_under_pressure_keeps_outputs(tiny):
    kw = dict(num_kv_blocks=14, block_size=4, max_num_seqs=2)
    prompts = [list(range(10 * i + 3, 10 * i + 30)) for i in range(5)]  # 27 tokens: 9 blocks with the output
    llm = LLM(tiny, **kw)
    ref = run(LLM(tiny, enable_prefix_caching=False, **kw), prompts + prompts[:1])
    got = run(llm, prompts) + run(llm, prompts[:1])
    assert llm.cache_stats()["evictions"] > 0
    for r, g in zip(ref, got):
        assert_same_or_near_tie(g.outputs[0].token_ids, r.outputs[0].token_ids, r.outputs[0].logprobs,
                                NEAR_TIE["float32"])
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_prompt_logprobs_requests_neither_hit_nor_register(tiny):
    llm = LLM(tiny, num_kv_blocks=64, block_size=4)
    prompt = list(range(5, 30))
    run(llm, [prompt])
    out = run(llm, [prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)


def test_reset_prefix_cache_forgets_free_blocks(tiny):
    llm = LLM(tiny, num_kv_blocks=64, block_size=4)
    prompt = list(range(5, 30))
    run(llm, [prompt])
    n = llm.cache_stats()["cached_blocks"]
    assert n > 0 and llm.reset_prefix_cache() == n
    assert llm.cache_stats()["cached_blocks"] == 0 and llm.engine.pool.num_cached_free == 0
    assert run(llm, [prompt])[0].num_cached_tokens == 0


@pytest.mark.parametrize("name", ["mistral", "qwen2", "deepseek_v3"])
def test_windowed_and_mla_models_hit_with_cold_outputs(tmp_path, name):
    """Mistral's and Qwen2's sliding-window layers keep their window's KV in the blocks (the swa_replay stage
    uses a hit as is); MLA caches its latent in the blocks."""
    build_tiny_hf_model(tmp_path, name)
    prompt = list(range(5, 46))
    kw = dict(num_kv_blocks=64, block_size=4)
    cold = run(LLM(str(tmp_path), enable_prefix_caching=False, **kw), [prompt])[0]
    llm = LLM(str(tmp_path), **kw)
    run(llm, [prompt[:-3] + [1, 2, 3]])
    hit = run(llm, [prompt])[0]
    assert hit.num_cached_tokens == 36
    assert_same_or_near_tie(hit.outputs[0].token_ids, cold.outputs[0].token_ids, cold.outputs[0].logprobs,
                            NEAR_TIE["float32"])
