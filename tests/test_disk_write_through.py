"""Disk write-through (core/prefix_cache.py, EngineConfig.disk_write_through): every block the prefix cache
registers goes to the disk tier, once, so an engine that ran without memory pressure leaves its blocks for a
restart (before, only evicted blocks reached the disk and a restart found nothing). Hits from the disk give
cold prefill's outputs; with write-through off the disk gets evictions only. Run on the CPU, with
and without overlap scheduling (the H200's default: there the last block of each finished request, holding
output tokens still pending at its last launch, was not registered until the engine committed a finishing
sequence's blocks)."""

from __future__ import annotations

import threading

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.graph import Pipeline
from deepinfer.core.kv_tiers.entry_format import read_head
from deepinfer.testing.compare import assert_outputs_match, generated
from deepinfer.testing.models import build_tiny_hf_model

SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPTS = [list(range(10 * i + 3, 10 * i + 40)) for i in range(4)]  # 37 tokens: 9 cacheable blocks of 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("write_through")
    build_tiny_hf_model(d, "llama")
    return str(d)


def gen(llm, prompts, sp=SP):
    return generated(llm, prompts, sp)


def same(a, b):
    assert_outputs_match(a, b)


def roomy(path, **kw):  # plenty of device blocks: nothing is ever evicted
    return LLM(path, num_kv_blocks=256, block_size=4, max_num_seqs=4, device="cpu", **kw)


def stored_members(directory) -> list:
    """Every block hash the directory's entry files hold, one per copy (a block written twice counts twice)."""
    out = []
    for f in sorted(directory.rglob("*.kvb")):
        with open(f, "rb") as fh:
            out += read_head(fh.read)[1]
    return out


def test_write_through_is_skipped_while_the_disk_queue_is_full_and_evictions_store_those_blocks(tiny, tmp_path):
    llm = LLM(tiny, num_kv_blocks=24, block_size=4, max_num_seqs=1, device="cpu", cache_dir=str(tmp_path))
    writes = llm.engine.prefix_cache.writer.store.writes
    block = llm.engine.prefix_cache.writer.block_bytes
    writes.max_pending_bytes = 3 * block  # nothing more than 3 blocks may wait for the disk
    gate = threading.Event()
    inner = writes.disk.put
    writes.disk.put = lambda *a, **k: (gate.wait(60), inner(*a, **k))[1]  # the disk stalls until told (or a minute)
    try:
        cold = gen(roomy(tiny, enable_prefix_caching=False), PROMPTS[:1])
        engine = llm.engine
        engine.add_request("a", {"prompt_token_ids": list(PROMPTS[0])}, SP)
        while engine.has_unfinished():
            engine.step()  # never waits for the stalled disk
        st = llm.cache_stats()
        assert st["write_through_skipped"] > 0 and writes.pending_bytes <= 3 * block
    finally:
        gate.set()
    llm.engine.prefix_cache.drain()
    gen(llm, PROMPTS[1:])  # other prompts evict the first one's blocks: the skipped ones reach the disk now
    llm.engine.prefix_cache.drain()
    restarted = roomy(tiny, cache_dir=str(tmp_path))
    out = gen(restarted, PROMPTS[:1])
    assert out[0].num_cached_tokens == 36
    same(out, cold)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_run_without_memory_pressure_is_found_after_a_restart(tiny, tmp_path, overlap):
    cold = gen(roomy(tiny, enable_prefix_caching=False), PROMPTS)
    first = roomy(tiny, cache_dir=str(tmp_path), overlap_scheduling=overlap)
    gen(first, PROMPTS)
    st = first.cache_stats()
    assert st["evictions"] == 0 and st["blocks_saved_to_tiers"] == 0  # nothing left the device by eviction
    # 37 prompt tokens + 3 computed output tokens: 10 full blocks per prompt, every one written through.
    assert st["blocks_written_through"] == st["blocks_registered"] == 40
    members = stored_members(tmp_path)
    assert len(members) == len(set(members)) == 40 and st["disk_writes"] <= 8
    restarted = roomy(tiny, cache_dir=str(tmp_path))
    out = gen(restarted, PROMPTS)
    assert [o.num_cached_tokens for o in out] == [36] * 4
    st = restarted.cache_stats()
    assert st["tier_hit_blocks"] == 36 and st["disk_hit_runs"] >= 4 and st["host_hit_runs"] == 0
    same(out, cold)
    # Blocks that came back from the disk, or that it holds already, are not written again.
    assert st["blocks_written_through"] == 0 and st["disk_writes"] == 0
    assert sorted(stored_members(tmp_path)) == sorted(members)


def test_write_through_off_leaves_the_disk_to_evictions(tiny, tmp_path):
    first = roomy(tiny, cache_dir=str(tmp_path), disk_write_through=False)
    gen(first, PROMPTS[:2])
    assert first.cache_stats()["blocks_written_through"] == 0 and not stored_members(tmp_path)
    restarted = roomy(tiny, cache_dir=str(tmp_path), disk_write_through=False)
    out = gen(restarted, PROMPTS[:2])
    assert [o.num_cached_tokens for o in out] == [0, 0] and restarted.cache_stats()["disk_hit_runs"] == 0


def test_each_block_is_written_once_under_eviction_and_with_a_host_tier(tiny, tmp_path):
    """24 device blocks: the prompts evict one another's blocks, which the disk already holds (written through):
    no block reaches the disk twice; with a host tier the evictions still go to host memory (write-back)."""
    cold = gen(roomy(tiny, enable_prefix_caching=False), PROMPTS)
    small = LLM(tiny, num_kv_blocks=24, block_size=4, max_num_seqs=2, cache_dir=str(tmp_path / "a"), device="cpu")
    gen(small, PROMPTS)
    gen(small, PROMPTS)
    st = small.cache_stats()
    assert st["evictions"] > 0
    members = stored_members(tmp_path / "a")
    assert len(members) == len(set(members)) == 40
    # No host tier: an evicted block the disk holds already is not copied off again (only those whose
    # write-through was still pending are, and the disk stores them once all the same).
    assert st["blocks_saved_to_tiers"] < st["evictions"], st
    both = LLM(tiny, num_kv_blocks=24, block_size=4, max_num_seqs=2, cache_dir=str(tmp_path / "b"),
               host_cache_gb=0.01, device="cpu")
    gen(both, PROMPTS)
    again = gen(both, PROMPTS[:2])
    st = both.cache_stats()
    assert st["blocks_saved_to_tiers"] > 0 and st["host_hit_runs"] > 0
    assert [o.num_cached_tokens for o in again] == [36, 36]
    same(again, cold[:2])
    members = stored_members(tmp_path / "b")
    assert len(members) == len(set(members)) == 40


def test_ced_demo_restart_hits_the_disk_with_exact_replay(tmp_path):
    """The demo model (CED): its global KV and indexer keys come back from the disk after a restart without
    memory pressure; exact SWA replay then gives cold prefill's tokens."""
    pipe = Pipeline.from_recipe("default").with_args("swa_replay", mode="exact")
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = [(7 * i + 5) % 4000 + 3 for i in range(200)]  # 12 full blocks of 16
    cold = gen(LLM(pipeline=pipe, enable_prefix_caching=False), [prompt], sp)
    first = LLM(pipeline=pipe, cache_dir=str(tmp_path))
    gen(first, [prompt], sp)
    assert first.cache_stats()["evictions"] == 0 and len(stored_members(tmp_path)) == 12
    restarted = LLM(pipeline=pipe, cache_dir=str(tmp_path))
    out = gen(restarted, [prompt], sp)
    st = restarted.cache_stats()
    assert out[0].num_cached_tokens == 192 and st["tier_hit_blocks"] == 12 and st["disk_hit_runs"] == 1
    same(out, cold)
    off = LLM(pipeline=pipe, cache_dir=str(tmp_path / "off"), disk_write_through=False)
    gen(off, [prompt], sp)
    assert not stored_members(tmp_path / "off")


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_disk_write_through_must_be_a_bool(bad):
    with pytest.raises(ValueError, match=r"EngineConfig\.disk_write_through=.* must be a bool"):
        EngineConfig(disk_write_through=bad)
