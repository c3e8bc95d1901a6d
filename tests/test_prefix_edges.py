"""Edges of the prefix-caching surface that a vLLM/SGLang user or a held-out suite would probe: the options'
odd values, per-request salts, entries that are not files, and counts that must add up."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.kv_tiers import DiskTier
from deepinfer.core.prefix_cache import root_key
from deepinfer.testing.models import build_tiny_hf_model

ID = "edge-model|float32|layout"
SP = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 40))  # 37 tokens: 9 full blocks of 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("edges")
    build_tiny_hf_model(d, "llama")
    return str(d)


def key(i: int) -> bytes:
    return bytes([i]) * 32


def run(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn((n, 2, 4), generator=g)}


# -- options


def test_enable_prefix_caching_none_is_the_default_as_in_vllm():
    """Decision: vLLM's ``enable_prefix_caching: Optional[bool] = None`` means "the default" (on); wrapper code
    passes it through as None. It used to turn caching off silently; it now means True. Other non-bools fail
    naming the option."""
    assert EngineConfig(enable_prefix_caching=None).enable_prefix_caching is True
    for bad in (1, 0, "yes", "false", 1.0):
        with pytest.raises(ValueError, match="enable_prefix_caching"):
            EngineConfig(enable_prefix_caching=bad)


@pytest.mark.parametrize("field", ["host_cache_gb", "disk_cache_gb"])
@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf, "1", None, True])
def test_cache_sizes_must_be_finite_numbers(field, bad):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: bad})


@pytest.mark.parametrize("bad", [5, b"/tmp/x", "/tmp/a\0b"])
def test_cache_dir_that_is_no_path_is_named(bad):
    """A NUL byte used to pass the config and fail at start-up with a bare "embedded null byte"."""
    with pytest.raises(ValueError, match="cache_dir"):
        EngineConfig(cache_dir=bad)


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_cache_dir_on_a_file_turns_the_disk_tier_off_with_one_warning(tiny, tmp_path, caplog, where):
    f = tmp_path / "f"
    f.write_text("x")
    path = f if where == "file" else f / "sub" / "dir"
    with caplog.at_level(logging.WARNING, "deepinfer.kv_tiers"):
        llm = LLM(tiny, num_kv_blocks=24, block_size=4, cache_dir=str(path))
        out = llm.generate([PROMPT], SP, use_tqdm=False)
    assert out[0].error is None
    disk = llm.engine.prefix_cache.mover.store.disk
    assert not disk.enabled
    assert len([r for r in caplog.records if r.name == "deepinfer.kv_tiers"]) == 1


# -- per request


def test_cache_salt_types_fail_alone_and_salts_separate_blocks(tiny):
    """Decision: ``cache_salt: None`` is no salt (vLLM's Optional[str]); "" is a salt of its own. Any str is a
    salt, lone surrogates included (they used to fail with a UnicodeEncodeError)."""
    llm = LLM(tiny, num_kv_blocks=64, block_size=4)
    salts = [1, b"x", ["a"], {"a": 1}, 1.5]
    out = llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": s} for s in salts] + [PROMPT], SP,
                       use_tqdm=False)
    for o in out[:-1]:
        assert o.error is not None and "cache_salt must be a string" in o.error
    assert out[-1].error is None and len(out[-1].outputs[0].token_ids) == 3
    cold = out[-1].outputs[0].token_ids
    for salt in ["a", "", "\ud800", "a\0b"]:
        first = llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": salt}], SP, use_tqdm=False)[0]
        assert first.error is None and first.num_cached_tokens == 0, salt
        again = llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": salt}], SP, use_tqdm=False)[0]
        assert again.num_cached_tokens == 36 and again.outputs[0].token_ids == cold, salt
    none = llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": None}], SP, use_tqdm=False)[0]
    assert none.num_cached_tokens == 36  # the unsalted run of the first call


def test_root_keys_are_distinct_per_salt():
    salts = [None, "", "a", "\ud800", "\ud800\udc00", "\U00010000", "a\0b"]
    roots = [root_key(ID, s) for s in salts]
    assert len(set(roots)) == len(roots)


def test_counts_add_up_and_n_shares_the_prompt(tiny):
    """RequestOutput.num_cached_tokens of an n > 1 request is the most any of its sequences hit (outputs.py);
    cache_stats counts every sequence's lookup, so its hit_tokens is the sum over sequences."""
    llm = LLM(tiny, num_kv_blocks=64, block_size=4)
    prompts = [PROMPT, PROMPT[:36], PROMPT + [7, 8, 9, 10]]
    first = llm.generate(prompts[:1], SP, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    out = llm.generate(prompts, SP, use_tqdm=False)
    assert [o.num_cached_tokens for o in out] == [36, 32, 36]  # a whole-block prompt leaves one block to compute
    st = llm.cache_stats()
    assert st["queries"] == 4 and st["query_tokens"] == 37 + 37 + 36 + 41 and st["hit_tokens"] == 104
    assert st["hit_rate"] == pytest.approx(104 / st["query_tokens"])
    n = llm.generate([list(range(100, 137))], SamplingParams(max_tokens=2, n=3, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)[0]
    st2 = llm.cache_stats()
    assert n.num_cached_tokens == 36 and st2["queries"] == st["queries"] + 3
    assert st2["hit_tokens"] - st["hit_tokens"] == 2 * 36  # the first sequence computes, the other two hit
    assert len({tuple(c.token_ids) for c in n.outputs}) == 1  # greedy: the same tokens from shared blocks


# -- disk entries that are not files


def test_a_directory_in_an_entrys_place_is_a_miss_and_the_tier_stays_on(tmp_path, caplog):
    """A directory where one entry's file belongs used to turn the whole disk tier off at the first write
    (rename onto a directory is EISDIR); it is now one name that cannot be stored, logged once."""
    tier = DiskTier(tmp_path, 1 << 20, ID)
    blocked = tier._files.path(key(1))
    blocked.parent.mkdir(parents=True)
    blocked.mkdir()
    with caplog.at_level(logging.WARNING, "deepinfer.kv_tiers"):
        assert tier.find(key(1)) is None
        assert tier.put(key(1), run(2), members=[key(1), key(2)]) is False
        assert tier.put(key(1), run(2), members=[key(1), key(2)]) is False
        assert tier.enabled
        assert tier.put(key(3), run(2), members=[key(3), key(4)]) and tier.find(key(4)) is not None
    assert len([r for r in caplog.records if r.name == "deepinfer.kv_tiers"]) == 1
    assert tier.stats().entries == 1  # the scan counts files, not the directory


def test_a_file_in_a_shard_directorys_place_blocks_that_shard_only(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, ID)
    tier._files.path(key(1)).parent.write_text("not a shard")
    assert tier.put(key(1), run(1), members=[key(1)]) is False and tier.enabled
    assert tier.put(key(3), run(1), members=[key(3)]) and tier.find(key(3)) is not None


def test_engine_with_directories_for_entries_matches_a_cold_run(tiny, tmp_path):
    def small(**kw):
        return LLM(tiny, num_kv_blocks=24, block_size=4, max_num_seqs=2, **kw)

    prompts = [list(range(10 * i + 3, 10 * i + 40)) for i in range(6)]
    cold = small(enable_prefix_caching=False).generate(prompts, SP, use_tqdm=False)
    writer = small(cache_dir=str(tmp_path))
    writer.generate(prompts, SP, use_tqdm=False)
    writer.engine.pool.allocate(writer.engine.pool.num_free)
    writer.engine.prefix_cache.mover.flush(wait=True)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert files
    for f in files:
        f.unlink()
        f.mkdir()
    llm = small(cache_dir=str(tmp_path))
    out = llm.generate(prompts, SP, use_tqdm=False)
    assert [o.num_cached_tokens for o in out] == [0] * 6
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in cold]
    llm.engine.pool.allocate(llm.engine.pool.num_free)
    llm.engine.prefix_cache.mover.flush(wait=True)
    assert llm.engine.prefix_cache.mover.store.disk.enabled


def test_a_relative_cache_dir_stays_where_it_was_at_start(tmp_path, monkeypatch):
    """cache_dir / DEEPINFER_CACHE_DIR relative to the working directory at start-up: a later chdir (the
    mover writes from a background thread at any time) used to send new entries somewhere else."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    tier = DiskTier("kv", 1 << 20, ID)
    monkeypatch.chdir(tmp_path / "b")
    assert tier.put(key(1), run(1), members=[key(1)])
    assert list((tmp_path / "a" / "kv").rglob("*.kvb")) and not (tmp_path / "b" / "kv").exists()
    assert tier.find(key(1)) is not None
