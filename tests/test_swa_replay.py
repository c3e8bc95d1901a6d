"""The swa_replay stage on CED prefix hits: the replayed tokens rebuild the SWA rings and never touch the
shared blocks; exact replay reproduces cold prefill; bounded replay runs n_win tokens before the hit."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.core.graph import Pipeline
from deepinfer.models.ced.model import CEDForCausalLM
from deepinfer.stages.swa_replay import SwaReplayStage
from deepinfer.testing.ced import REPLAY_CONFIG, build_ced_checkpoint
from deepinfer.testing.compare import NEAR_TIE, assert_same_or_near_tie

CFG = REPLAY_CONFIG
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def ced(tmp_path_factory):
    d = tmp_path_factory.mktemp("ced_replay")
    cfg = build_ced_checkpoint(d, seed=11, **CFG)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, cfg.vocab_size, (40,), generator=g).tolist()
    return str(d), cfg, base


def make(path, mode="bounded", **kw):
    pipe = Pipeline.from_recipe("default").with_args("swa_replay", mode=mode)  # the plain pipeline
    return LLM(path, pipeline=pipe, num_kv_blocks=64, block_size=4, **kw)


def paged_bytes(llm, blocks):
    model, cache = llm.engine.model, llm.engine.kv_cache
    return {name: t.narrow(dim, b * rows, rows).clone() for name, t, dim, rows in
            model.paged_kv_views(cache, llm.engine.config.block_size) for b in blocks}


def test_replayed_tokens_never_write_the_shared_blocks(ced):
    path, cfg, base = ced
    llm = make(path)
    llm.generate([base], SP, use_tqdm=False)
    shared = [b for b in llm.engine.prefix_cache.block_of.values()]
    before = paged_bytes(llm, shared)
    out = llm.generate([base[:36] + [7, 8, 9, 10, 11]], SP, use_tqdm=False)[0]  # hits 36 tokens: 9 blocks
    assert out.error is None and out.num_cached_tokens == 36
    after = paged_bytes(llm, shared)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bounded_replay_recomputes_n_win_tokens_before_the_hit(ced):
    path, cfg, base = ced
    llm = make(path)
    llm.generate([base], SP, use_tqdm=False)
    model: CEDForCausalLM = llm.engine.model
    model.reset_counters()
    prompt = base[:36] + [7, 8, 9, 10, 11]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    W = cfg.n_win
    enc = model.counters["layer_tokens"][: cfg.num_encoder_layers]
    assert enc == [W + len(prompt) - 36] * cfg.num_encoder_layers  # replay [36 - W, 36) and the suffix
    assert model.counters["min_pos"][0] == 36 - W


def test_exact_replay_on_a_hit_matches_cold_prefill(ced):
    path, cfg, base = ced
    # Exact replay goes (layers + 1) * n_win = 42 tokens back: the hit must lie beyond that.
    long = base + base[::-1]
    prompt = long[:72] + [7, 8, 9, 10, 11]
    cold = make(path, enable_prefix_caching=False).generate([prompt], SP, use_tqdm=False)[0]
    llm = make(path, mode="exact")
    llm.generate([long], SP, use_tqdm=False)
    llm.engine.model.reset_counters()
    hit = llm.generate([prompt], SP, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 72 and llm.engine.model.counters["min_pos"][0] == 72 - 42
    a, b = hit.outputs[0], cold.outputs[0]
    assert_same_or_near_tie(a.token_ids, b.token_ids, b.logprobs, NEAR_TIE["float32"])
    for step, (x, y, t) in enumerate(zip(a.logprobs, b.logprobs, b.token_ids)):
        if t not in x:
            break  # parted at a near-tie (checked above)
        assert abs(x[t].logprob - y[t].logprob) <= 1e-4 * max(1.0, abs(y[t].logprob)), step


def test_exact_replay_mode_model_uses_no_hit(ced):
    path, cfg, base = ced
    llm = make(path, hf_overrides={"replay_mode": "exact"})
    llm.generate([base], SP, use_tqdm=False)
    out = llm.generate([base], SP, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # the decoder runs over every prompt position: nothing can be skipped


def test_plan_without_window_state_is_the_hit(ced):
    class Plain:
        def swa_state(self):
            return None

    seq = type("S", (), {"num_preemptions": 0})()
    assert SwaReplayStage(model=Plain()).plan(seq, 32) == 32
    with pytest.raises(ValueError, match="mode='fast'"):
        SwaReplayStage(model=Plain(), mode="fast")
