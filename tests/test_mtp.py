"""MTP drafting from DeepSeek-V3's nextn layers (models/deepseek_mtp.py, stages/mtp_draft.py), float32 on the CPU,
on a tiny random V3 checkpoint given one MTP layer (deepinfer.testing.mtp.add_mtp_layer: MLA + MoE block):

* greedy output with MTP speculation equals plain decoding, k = 1 and 3, in a mixed batch (a chunked prefill
  beside decoding rows, a seeded sampled row) and again on a second pass whose prompts hit the prefix cache;
* with the drafts replaced by the known continuation for 0..k positions in turn (so that many stand and the
  rest roll back), every first draft's logits equal an independent float64 oracle of the module over the whole
  sequence (testing.mtp.mtp_logits_oracle, the target's hidden states from transformers), and spec_stats counts
  exactly the drafts proposed and the ones that stood;
* a checkpoint without MTP tensors, or whose config declares none, fails naming it; ``optional`` turns
  speculation off there instead;
* an FP8 checkpoint's MTP tensors (experts included) load dequantized, as the target's.

Random weights: the MTP's own drafts almost never stand (the acceptance the run reports is ~0).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from deepinfer import LLM, SamplingParams
from deepinfer.testing.compare import MODEL_FACTOR, NEAR_TIE, assert_logits_close, assert_same_or_near_tie
from deepinfer.testing.models import build_tiny_hf_model
from deepinfer.testing.mtp import add_mtp_layer, mtp_logits_oracle

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPTS = [list(range(5, 18)), list(range(40, 45)), [7, 9, 11] * 7, [300, 301, 302, 303, 304, 305, 306, 307, 308]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(path with an MTP layer, path without one, transformers' target model in float64)."""
    root = tmp_path_factory.mktemp("mtp")
    plain, path = root / "plain", root / "mtp"
    hf = build_tiny_hf_model(plain, "deepseek_v3", seed=4, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0})
    shutil.copytree(plain, path)
    add_mtp_layer(path, seed=5)
    hf.config._experts_implementation = "eager"  # transformers' grouped-mm experts refuse float64
    return str(path), str(plain), hf.double().eval()


def llm(path, **kw):
    return LLM(path, num_kv_blocks=96, block_size=4, max_num_batched_tokens=16, **kw)


@pytest.fixture(scope="module")
def reference(ckpt):
    return llm(ckpt[0]).generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_mtp_drafts_equals_plain_decoding(ckpt, reference, k):
    fast = llm(ckpt[0], speculative_config={"method": "mtp", "num_speculative_tokens": k})
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    for attempt in range(2):  # the second pass hits the prefix cache (the MTP starts at the hit)
        outs = fast.generate(PROMPTS + [PROMPTS[0][:6]], [GREEDY] * len(PROMPTS) + [sampled], use_tqdm=False)
        for i, (a, b) in enumerate(zip(outs, reference)):
            assert a.error is None, a.error
            assert_same_or_near_tie(a.outputs[0].token_ids, b.outputs[0].token_ids, b.outputs[0].logprobs,
                                    NEAR_TIE["float32"], what=f"k={k} pass {attempt} prompt {i}")
        assert outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == 12
    st = fast.spec_stats()
    assert st["method"] == "mtp" and st["verified_rows"] > 0 and st["draft_tokens"] >= st["verified_rows"], st
    assert len(st["acceptance_by_position"]) == k


def test_first_draft_logits_match_the_oracle_under_rollback(ckpt, reference, monkeypatch):
    path, _, hf = ckpt
    k = 3
    fast = llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    truth = {tuple(p): p + list(r.outputs[0].token_ids) for p, r in zip(PROMPTS, reference)}
    seen, forced = [], []
    from deepinfer.models import mtp_batch

    draft_batch = mtp_batch.draft_batch

    def forcing(mtp, caches, token_ids, computed, ks, pick):
        """The real drafts of the step (they update the MTP's KV), then each sequence's tokens replaced: the
        known continuation for m = 0, 1, ..., n positions in turn, then a wrong token."""
        out = []
        for (tokens, logits), ids, c in zip(draft_batch(mtp, caches, token_ids, computed, ks, pick), token_ids,
                                            computed):
            if not tokens:
                out.append((tokens, logits))
                continue
            full = next(v for p, v in truth.items() if tuple(ids[:len(p)]) == p)
            seen.append((full, c, logits[0].clone()))
            m = len(forced) % (len(tokens) + 1)
            right = full[len(ids):len(ids) + len(tokens)]
            forced.append((len(tokens), m))
            out.append((right[:m] + [(t + 1) % 512 for t in right[m:]], logits))
        return out

    monkeypatch.setattr(mtp_batch, "draft_batch", forcing)
    outs = fast.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]

    # Accounting: every proposal verified, and exactly the forced-right drafts stood.
    st = fast.spec_stats()
    assert st["verified_rows"] == len(forced) and st["draft_tokens"] == sum(n for n, _ in forced), (st, forced)
    assert st["accepted_tokens"] == sum(m for _, m in forced) > 0, (st, forced)
    assert st["tokens_per_verified_row"] == pytest.approx(1 + st["accepted_tokens"] / len(forced), abs=1e-3)
    assert {m for _, m in forced} == set(range(k + 1))  # every rollback length happened

    # The oracle over each final sequence (its committed tokens are what every draft saw).
    tensors = load_file(f"{path}/model.safetensors")
    cfg = json.loads(open(f"{path}/config.json").read())
    oracle = {}
    for full in truth.values():
        with torch.no_grad():
            hidden = hf.model(torch.tensor([full])).last_hidden_state[0]
        oracle[tuple(full)] = mtp_logits_oracle(tensors, cfg, full, hidden)
    assert len(seen) > 20
    for full, c, logits in seen:
        assert_logits_close(logits, oracle[tuple(full)][c - 1], factor=MODEL_FACTOR,
                            what=f"first draft after position {c} of a {len(full)}-token sequence")


def test_batched_drafting_equals_one_sequence_at_a_time(ckpt):
    """draft_batch (the engine's path: one forward per draft position for every sequence) gives each sequence the
    tokens and logits DeepseekMTP.draft (its oracle) gives it alone, and leaves its cache in the same state;
    sequences at different points: fresh, after a draft and 1..3 kept positions, not ready."""
    from deepinfer.models.deepseek_mtp import MTPCache
    from deepinfer.models.mtp_batch import draft_batch

    mtp = llm(ckpt[0], speculative_config={"method": "mtp", "num_speculative_tokens": 3}).engine.drafter.mtp
    d, V = mtp.config.hidden_size, mtp.config.vocab_size
    dev = mtp.layer.eh_proj.weight.device  # the engine's: hidden states arrive there, as the target's
    g = torch.Generator().manual_seed(0)
    caches, tokens, computed = [], [], []
    for start, first, more in [(0, 5, 2), (3, 1, 0), (7, 4, 3), (2, 2, 1)]:
        ids = torch.randint(0, V, (start + first + more + 1,), generator=g).tolist()
        cache, comp = mtp.new_cache(start, torch.randn(first, d, generator=g).to(dev)), start + first
        if more:  # an earlier draft, then the target computed `more` further positions (the engine's observe)
            mtp.draft(cache, ids[:comp + 1], comp, 2, lambda lg: int(lg.argmax()))
            cache.observe(comp, torch.randn(more, d, generator=g).to(dev))
            comp += more
        caches.append(cache)
        tokens.append(ids[:comp + 1])
        computed.append(comp)
    alone = [MTPCache(c.kv.clone(), c.hidden.clone(), c.base, c.length) for c in caches]
    ks = [3, 1, 2, 3]
    with torch.no_grad():
        got = draft_batch(mtp, caches + [None], tokens + [[1]], computed + [0], ks + [2], lambda lg: lg.argmax(-1))
    assert got[-1] == ([], None)
    for b, c in enumerate(alone):
        with torch.no_grad():
            want, want_logits = mtp.draft(c, tokens[b], computed[b], ks[b], lambda lg: int(lg.argmax()))
        assert got[b][0] == want, b
        assert_logits_close(got[b][1], want_logits, factor=MODEL_FACTOR, what=f"sequence {b}")
        mine = caches[b]
        assert (mine.base, mine.length) == (c.base, c.length) and torch.equal(mine.hidden, c.hidden)
        torch.testing.assert_close(mine.kv[:mine.length], c.kv[:c.length], rtol=1e-4, atol=1e-5)


def test_checkpoint_without_mtp_layers_is_named(ckpt):
    _, plain, _ = ckpt
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=rf"{plain}.*num_nextn_predict_layers=1 but stores no model\.layers\.3\."):
        llm(plain, speculative_config=spec)
    with pytest.raises(ValueError, match=rf"{plain}.*num_nextn_predict_layers=0"):
        llm(plain, speculative_config=spec, hf_overrides={"num_nextn_predict_layers": 0})
    off = llm(plain, speculative_config={**spec, "optional": True})
    assert off.engine.drafter is None and off.spec_stats()["enabled"] is False
    assert len(off.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_mtp_cache_keeps_the_hidden_states_the_target_kept():
    """observe(start, rows): a recomputation from an earlier position (preemption) replaces what it covers, a
    gap (a prefix-cache hit) or a start before the held rows starts over there."""
    from deepinfer.models.deepseek_mtp import MTPCache

    def rows(a, b):
        return torch.arange(a, b, dtype=torch.float32)[:, None].expand(-1, 2)

    def held(c):
        return c.hidden[:, 0].long().tolist()

    c = MTPCache(kv=torch.zeros(4, 3), hidden=rows(0, 5))
    c.observe(1, rows(1, 3))  # positions 1.. recomputed: 0 stays
    assert held(c) == [0, 1, 2]
    c.length, c.hidden = 2, rows(2, 3)  # as a draft leaves it: rows for 0, 1; position 2's hidden state pending
    c.observe(3, rows(3, 5))
    assert (c.base, c.length, held(c)) == (0, 2, [2, 3, 4])
    c.observe(1, rows(1, 2))  # recomputed from inside the held rows: they end there
    assert (c.base, c.length, held(c)) == (0, 1, [1])
    c.observe(9, rows(9, 11))  # positions 2..8 never seen
    assert (c.base, c.length, held(c)) == (9, 0, [9, 10])
    c.observe(4, rows(4, 6))  # before the base
    assert (c.base, c.length, held(c)) == (4, 0, [4, 5])


def test_fp8_mtp_tensors_are_dequantized_like_the_target(ckpt, tmp_path):
    from deepinfer.models.quant import dequantize_fp8_block
    from deepinfer.testing.models import write_fp8_checkpoint

    def pick(name, t):
        return name.startswith("model.layers.3.") and "norm" not in name and name.endswith("proj.weight")

    quant = write_fp8_checkpoint(ckpt[0], tmp_path / "fp8", pick, block=(16, 16))
    drafter = llm(str(tmp_path / "fp8"), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    layer = drafter.engine.drafter.mtp.layer
    w, s = quant["model.layers.3.eh_proj.weight"]  # on the host; the layer on the engine's device
    assert torch.equal(layer.eh_proj.weight.cpu(), dequantize_fp8_block(w, s, (16, 16)).float())
    w, s = quant["model.layers.3.mlp.experts.2.up_proj.weight"]
    F = w.shape[0]
    assert torch.equal(layer.mlp.w13[2, F:].cpu(), dequantize_fp8_block(w, s, (16, 16)).float())
