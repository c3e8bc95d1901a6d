"""The encoder-SWA pool (core/swa_pool.py): a CED prefix hit whose encoder window state was snapshotted
restores it instead of replaying, reproduces a cold prefill, and falls back to bounded replay once the
snapshot's TTL has run out."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.testing.ced import REPLAY_CONFIG, build_ced_checkpoint
from deepinfer.testing.compare import NEAR_TIE, assert_same_or_near_tie

CFG = REPLAY_CONFIG
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def ced(tmp_path_factory):
    d = tmp_path_factory.mktemp("ced_swa_pool")
    cfg = build_ced_checkpoint(d, seed=11, **CFG)
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, cfg.vocab_size, (41,), generator=g).tolist()
    return str(d), cfg, base


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(path, clock=None, **kw):
    llm = LLM(path, num_kv_blocks=64, block_size=4, host_cache_gb=0.01, **kw)
    if clock is not None:
        llm.engine.swa_pool.store._clock = clock
    return llm


def close_to(hit, cold, near=NEAR_TIE["float32"], tol=1e-4):
    a, b = hit.outputs[0], cold.outputs[0]
    assert_same_or_near_tie(a.token_ids, b.token_ids, b.logprobs, near)
    for step, (x, y, t) in enumerate(zip(a.logprobs, b.logprobs, b.token_ids)):
        if t not in x:
            break  # parted at a near-tie (checked above)
        assert abs(x[t].logprob - y[t].logprob) <= tol * max(1.0, abs(y[t].logprob)), step


def test_a_prompt_snapshot_restores_instead_of_replaying(ced):
    path, cfg, base = ced
    llm = make(path)
    model = llm.engine.model
    # 41 tokens: the prefill stops at the prompt's last block boundary (40), whose state is snapshotted.
    llm.generate([base], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    assert llm.cache_stats()["swa_snapshots"] >= 1
    prompt = base[:40] + [7, 8, 9, 10, 11]
    model.reset_counters()
    # One token: the prefill alone (the device decode path keeps no per-layer counters on the GPU).
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    assert first.num_cached_tokens == 40 and llm.cache_stats()["swa_restores"] == 1
    enc = model.counters["layer_tokens"][: cfg.num_encoder_layers]
    # No replay: the encoder computes only the suffix (5 prompt tokens).
    assert enc == [len(prompt) - 40] * cfg.num_encoder_layers
    prompt = base[:40] + [12, 13, 14, 15, 16]  # another suffix: the first one's block 40-44 is cached now
    hit = llm.generate([prompt], SP, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 40 and llm.cache_stats()["swa_restores"] == 2
    cold = LLM(path, num_kv_blocks=64, block_size=4, enable_prefix_caching=False).generate([prompt], SP,
                                                                                           use_tqdm=False)[0]
    close_to(hit, cold)


def test_restored_state_is_the_snapshot(ced):
    path, cfg, base = ced
    llm = make(path)
    llm.generate([base], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    pool, cache, model = llm.engine.swa_pool, llm.engine.kv_cache, llm.engine.model
    (key,) = list(pool.store._entries)
    snap = {k: v.clone() for k, v in pool.store.get(key).items()}
    for l in range(cfg.num_encoder_layers):  # scribble over every slot's rings: the restore must rewrite them
        cache.ring[l][0].fill_(0x5A)
    seq = type("S", (), {"swa_restore": (40, snap), "state_slot": 1})()
    pool.restore(seq)
    again = model.swa_snapshot(cache, 1, 40)
    # The snapshot lives in the host tier; the rings it was restored into may be on the GPU.
    assert again.keys() == snap.keys() and all(torch.equal(again[k].cpu(), snap[k].cpu()) for k in snap)
    assert set(snap) >= {"ring0.codes", "ring2.codes", "encoder_out"} and snap["encoder_out"].shape == (6, 48)


def test_decode_snapshots_every_boundary_it_crosses(ced):
    path, cfg, base = ced
    llm = make(path)
    out = llm.generate([base[:30]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    # Prompt boundary 28 (prefill stops there), then decode crosses 32, 36 and 40 (41 tokens known at the end).
    assert llm.cache_stats()["swa_snapshots"] == 4
    full = base[:30] + list(out.outputs[0].token_ids)
    prompt = full[:40] + [5, 6, 7]
    model = llm.engine.model
    model.reset_counters()
    hit = llm.generate([prompt], SP, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 40 and llm.cache_stats()["swa_restores"] == 1
    assert model.counters["min_pos"][0] == 40  # nothing before the hit was recomputed by the encoder
    cold = LLM(path, num_kv_blocks=64, block_size=4, enable_prefix_caching=False).generate([prompt], SP,
                                                                                           use_tqdm=False)[0]
    close_to(hit, cold)


def test_an_expired_snapshot_falls_back_to_bounded_replay(ced):
    path, cfg, base = ced
    clock = Clock()
    llm = make(path, clock=clock, swa_cache_ttl_s=60)
    model = llm.engine.model
    llm.generate([base], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    clock.t = 61.0
    model.reset_counters()
    prompt = base[:40] + [7, 8, 9]
    hit = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    stats = llm.cache_stats()
    assert hit.num_cached_tokens == 40 and stats["swa_restores"] == 0 and stats["swa_expirations"] >= 1
    assert model.counters["min_pos"][0] == 40 - cfg.n_win  # bounded replay [P - n_win, P)


def test_pool_needs_a_host_tier_and_takes_its_settings(ced):
    path, cfg, base = ced
    assert LLM(path, num_kv_blocks=64, block_size=4).engine.swa_pool is None  # no host tier
    assert make(path, swa_cache_gb=0).engine.swa_pool is None
    assert make(path, hf_overrides={"replay_mode": "exact"}).engine.swa_pool is None  # no hit is usable there
    pool = make(path, swa_cache_gb=0.002).engine.swa_pool
    assert pool.store.capacity_bytes == int(0.002 * 2**30)
    with pytest.raises(ValueError, match="swa_cache_ttl_s"):
        EngineConfig(swa_cache_ttl_s=0)
    with pytest.raises(ValueError, match="swa_cache_gb"):
        EngineConfig(swa_cache_gb=-1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and overlap scheduling need a GPU")
def test_graph_decode_snapshots_restore_like_cold_on_the_gpu(ced):
    """Decode under CUDA graphs and overlap writes the encoder outputs the snapshots take; a hit restores them."""
    path, cfg, base = ced
    kw = dict(device="cuda", dtype="float32", backend="nvidia", num_kv_blocks=64, block_size=4)
    llm = LLM(path, enforce_eager=False, host_cache_gb=0.01, **kw)
    assert llm.engine.decode_graphs is not None
    out = llm.generate([base[:30]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert llm.engine.decode_graphs.num_replays > 0 and llm.cache_stats()["swa_snapshots"] == 4
    prompt = base[:30] + list(out.outputs[0].token_ids)[:10] + [5, 6, 7]
    hit = llm.generate([prompt], SP, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 40 and llm.cache_stats()["swa_restores"] == 1
    cold = LLM(path, enforce_eager=True, enable_prefix_caching=False, **kw).generate([prompt], SP, use_tqdm=False)[0]
    close_to(hit, cold, NEAR_TIE["bfloat16"], 1e-2)  # Triton dots round through TF32
