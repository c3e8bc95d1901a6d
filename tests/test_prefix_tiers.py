"""The prefix cache's host and disk tiers behind the engine (core/kv_offload.py over core/kv_tiers): blocks
evicted from device memory come back from host memory or disk, across a restart, with the outputs of cold
prefill; a damaged disk entry is a miss."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.testing.ced import build_ced_checkpoint
from deepinfer.testing.compare import assert_outputs_match, generated
from deepinfer.testing.models import build_tiny_hf_model

SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPTS = [list(range(10 * i + 3, 10 * i + 40)) for i in range(6)]  # 37 tokens: 9 cacheable blocks of 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiers")
    build_tiny_hf_model(d, "llama")
    return str(d)


def gen(llm, prompts):
    return generated(llm, prompts, SP)


def same(a, b):
    assert_outputs_match(a, b)


def small(path, **kw):  # 24 blocks: six prompts of 10 blocks each evict one another's
    return LLM(path, num_kv_blocks=24, block_size=4, max_num_seqs=2, **kw)


def test_host_tier_brings_evicted_blocks_back(tiny):
    cold = gen(small(tiny, enable_prefix_caching=False), PROMPTS)
    llm = small(tiny, host_cache_gb=0.01)
    gen(llm, PROMPTS)
    assert llm.cache_stats()["blocks_saved_to_tiers"] > 0
    again = gen(llm, PROMPTS[:2])
    assert [o.num_cached_tokens for o in again] == [36, 36]
    assert llm.cache_stats()["tier_hit_blocks"] > 0
    same(again, cold[:2])


def test_disk_tier_survives_a_restart_and_damage_is_a_miss(tiny, tmp_path, caplog):
    cold = gen(small(tiny, enable_prefix_caching=False), PROMPTS)
    gen(small(tiny, cache_dir=str(tmp_path)), PROMPTS)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert files
    restarted = small(tiny, cache_dir=str(tmp_path))
    out = gen(restarted, PROMPTS[:1])
    assert out[0].num_cached_tokens == 36 and restarted.cache_stats()["tier_hit_blocks"] == 9
    same(out, cold[:1])
    for f in files:  # every entry damaged in its payload: each read is a miss, never served
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    damaged = small(tiny, cache_dir=str(tmp_path))
    out = gen(damaged, PROMPTS[1:2])
    assert out[0].num_cached_tokens == 0
    same(out, cold[1:2])


def test_two_live_engines_share_a_directory(tiny, tmp_path):
    """An engine started before another one wrote its runs finds them (from each run's first block, by file
    name), with cold prefill's outputs; every disk entry holds a run of several blocks."""
    cold = gen(small(tiny, enable_prefix_caching=False), PROMPTS)
    reader = small(tiny, cache_dir=str(tmp_path))
    writer = small(tiny, cache_dir=str(tmp_path))
    gen(writer, PROMPTS)
    writer.engine.pool.allocate(writer.engine.pool.num_free)  # everything cached goes to the disk
    writer.engine.prefix_cache.mover.flush(wait=True)
    stats = writer.cache_stats()
    assert stats["runs_saved_to_tiers"] < stats["blocks_saved_to_tiers"]
    out = gen(reader, PROMPTS[:3])
    assert [o.num_cached_tokens for o in out] == [36, 36, 36]
    same(out, cold[:3])


def test_another_model_never_reads_the_entries(tiny, tmp_path, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    build_tiny_hf_model(other, "qwen3")
    gen(small(tiny, cache_dir=str(tmp_path)), PROMPTS)
    llm = small(str(other), cache_dir=str(tmp_path))
    out = gen(llm, PROMPTS[:1])
    assert out[0].num_cached_tokens == 0 and llm.cache_stats()["tier_hit_blocks"] == 0


def test_ced_global_kv_round_trips_through_the_disk(tmp_path):
    ckpt = tmp_path / "ced"
    cfg = build_ced_checkpoint(ckpt, seed=3, hidden_size=48, num_layers=5, num_encoder_layers=3, num_heads=2,
                               head_dim=32, rope_dim=8, q_lora_rank=32, out_groups=2, out_group_dim=32, n_win=6,
                               layer_modes=("swa", "full", "reuse", "full", "reindex"), encoder_ratio=2,
                               index_topk=4, pool_block=2, pool_blocks=2, index_heads=2, index_head_dim=32,
                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               n_shared_experts=1, max_position_embeddings=512)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (30,), generator=g).tolist()
    kw = dict(num_kv_blocks=24, block_size=4, max_num_seqs=2)
    warm = LLM(str(ckpt), **kw)
    gen(warm, [prompt])
    hit_device = gen(warm, [prompt])[0]  # a device-tier hit: bounded replay over the cached blocks
    assert hit_device.num_cached_tokens == 28
    writer = LLM(str(ckpt), cache_dir=str(tmp_path / "d"), **kw)
    gen(writer, [prompt])
    # Blocks reach the disk when evicted: fill the pool, which evicts every cached block.
    writer.engine.pool.allocate(writer.engine.pool.num_free)
    writer.engine.prefix_cache.mover.flush(wait=True)
    reader = LLM(str(ckpt), cache_dir=str(tmp_path / "d"), **kw)  # a restart: the blocks come from disk
    hit_disk = gen(reader, [prompt])[0]
    assert hit_disk.num_cached_tokens == 28 and reader.cache_stats()["tier_hit_blocks"] == 7
    # The same bytes in the shared blocks and the same bounded replay: the same tokens as the device-tier hit.
    assert hit_disk.outputs[0].token_ids == hit_device.outputs[0].token_ids
