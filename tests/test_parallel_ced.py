"""CED under parallel serving (parallel/ced_parallel.py) and prefix caching with data-parallel attention.

The oracle is the single-process engine on the same tiny CED checkpoint (float32; REPLAY_CONFIG: every layer
mode, a window of 6, 4 experts top-2). Two gloo ranks, experts expert-parallel, with attention replicated or
data-parallel, give its greedy tokens, top logprobs and prompt logprobs (deepinfer.testing.parallel's
tolerance) on a batch mix: prompts of 5 to 30 tokens (bounded replay from position N - 6 on the longer ones, one
request scoring its prompt, which makes every rank run the scoring pass), chunked prefills under a 12-token
budget, and requests that finish at different steps (one rank then runs no row and still joins every layer's
expert exchange). The expert load rank 0 reports is the whole batch's. With EPLB (2 redundant slots,
rebalancing every 3 steps) the outputs are the same while experts move between the ranks mid-generation.

With data-parallel attention and prefix caching, two prefixes land on different ranks; requests that extend
them hit the rank holding them. CED's hit replays the window before the hit point (bounded replay, an
approximation), so the oracle there is the single-process engine with prefix caching, whose hits are the same.

The multi-process tests are marked ``multiprocess`` (about 3-5 s each on two busy cores).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.testing.ced import REPLAY_CONFIG, build_ced_checkpoint
from deepinfer.testing.parallel import assert_same_outputs

ENGINE = dict(block_size=4, num_kv_blocks=64, max_model_len=128, threads=1, max_num_batched_tokens=12,
              dtype="float32", distributed_timeout_s=60)
MAX_TOKENS = (2, 4, 3, 12)


@pytest.fixture(scope="module")
def ced(tmp_path_factory):
    path = tmp_path_factory.mktemp("parallel_ced") / "ced"
    cfg = build_ced_checkpoint(path, seed=3, **REPLAY_CONFIG)
    return str(path), cfg


def batch(vocab: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 19, 11, 30)]
    sps = [SamplingParams(max_tokens=m, temperature=0.0, logprobs=4, prompt_logprobs=3 if i == 1 else None)
           for i, m in enumerate(MAX_TOKENS)]
    return prompts, sps


@pytest.fixture(scope="module")
def reference(ced):
    path, cfg = ced
    llm = LLM(path, enable_prefix_caching=False, **ENGINE)
    out = llm.generate(*batch(cfg.vocab_size), use_tqdm=False)
    return out, llm.expert_load(), sum(llm.engine.model.counters["layer_tokens"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tensor_parallel_size", "data_parallel_size"])
def test_ced_matches_single_process(ced, reference, layout):
    path, cfg = ced
    ref, ref_load, ref_tokens = reference
    llm = LLM(path, **{layout: 2}, enable_expert_parallel=True, enable_prefix_caching=False, **ENGINE)
    try:
        out = llm.generate(*batch(cfg.vocab_size), use_tqdm=False)
        shard = llm.engine.model.inner
        assert all(type(l).__name__ == "ExpertParallelCEDLayer" and l.w13.shape[0] == 2 and l.w2.shape[0] == 2
                   for l in shard.layers)  # 4 experts, 2 on each rank
        assert llm.expert_load() == ref_load
        tokens = sum(shard.counters["layer_tokens"])
        if layout == "data_parallel_size":  # rank 0 computed its own rows only, in caches of its own slots
            assert 0 < tokens < ref_tokens
            assert llm.engine.kv_cache.ring[0][0].shape[0] == llm.engine.config.max_num_seqs // 2 + 1
            assert llm.engine.model.kv_blocks == 64 and llm.engine.pool.num_blocks == 128
        else:
            assert tokens == ref_tokens
    finally:
        llm.shutdown()
    assert_same_outputs(ref, out)
    assert ref[1].prompt_logprobs and ref[3].outputs[0].token_ids  # the comparison covered both


@pytest.mark.multiprocess
def test_ced_prefix_hits_on_each_rank(ced):
    path, cfg = ced
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(0, cfg.vocab_size, (16,), generator=g).tolist() for _ in range(2))
    tail = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 6, 5, 9, 2, 7)]
    # a and b go to different ranks (the most free blocks), then each pair goes to the rank holding its prefix.
    rounds = [[a + tail[0], b + tail[1]], [a + tail[2], a + tail[3]], [b + tail[4], b + tail[5]]]
    sp = SamplingParams(max_tokens=5, temperature=0.0, logprobs=4)
    single = LLM(path, **ENGINE)
    want = [single.generate(r, sp, use_tqdm=False) for r in rounds]
    llm = LLM(path, data_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    try:
        got = [llm.generate(r, sp, use_tqdm=False) for r in rounds]
        caches = llm.engine.prefix_cache.caches
        per_rank = llm.cache_stats()["cached_blocks_per_rank"]
    finally:
        llm.shutdown()
    for w, o in zip(want[1:], got[1:]):
        assert [x.num_cached_tokens for x in o] == [x.num_cached_tokens for x in w] == [16, 16]
    assert all(n > 0 for n in per_rank) and all(c.stats["hit_tokens"] == 32 for c in caches), per_rank
    for w, o in zip(want, got):
        assert_same_outputs(w, o)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tensor_parallel_size", "data_parallel_size"])
def test_ced_eplb_rebalances_across_ranks_mid_generation(ced, reference, layout):
    """EPLB places CED's experts over the ranks as MoEBlocks': rebalanced while generating, the outputs unchanged."""
    path, cfg = ced
    llm = LLM(path, **{layout: 2}, enable_expert_parallel=True, enable_prefix_caching=False, enable_eplb=True,
              eplb_config={"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}, **ENGINE)
    try:
        out = llm.generate(*batch(cfg.vocab_size), use_tqdm=False)
        stats = llm.eplb_stats()
        shard = llm.engine.model.inner
        assert stats["distributed"] and stats["rebalances"] >= 2 and stats["num_physical_experts"] == 6
        assert sum(r["moved_slots"] for r in stats["history"]) > 0
        assert all(l.w13.shape[0] == 3 for l in shard.layers)  # 6 slots, 3 on each rank
        load = llm.expert_load()  # over EPLB's window, per logical expert
        assert load["window"] == 4 and all(len(c) == 4 and sum(c) > 0 for c in load["layers"].values())
    finally:
        llm.shutdown()
    assert_same_outputs(reference[0], out)


@pytest.mark.parametrize("kw,match", [
    (dict(tensor_parallel_size=2), r"mixture-of-experts model in every layer: 2 ranks need enable_expert_parallel"),
    (dict(tensor_parallel_size=3, enable_expert_parallel=True), r"4 experts do not divide over 3 ranks"),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
          eplb_config={"num_redundant_experts": 1}),
     r"4 experts and 5 physical slots .* must both divide over the ranks"),
])
def test_ced_bad_layouts_are_refused(ced, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(ced[0], **{**ENGINE, **kw})
