"""Bounded replay's decoder pass from static tensors (models/ced/pass_graphs.py) against the eager layers.

On the CPU (hypothesis-drawn configs, prompt lengths, block sizes and chunk budgets): the static pass run
eagerly (``capture=False``: full layers compressed first, entry rows padded to a power-of-two width, the pass's
lists copied into static tensors) generates what the plain eager pass generates, and leaves the same host
counters (tokens per layer, scored entries at the real width, indexer calls, lowest positions); past MAX_GRAPHS
a covered pass runs the plain layers after its eager compressions, with the same results. On a GPU: the
captured graphs replay (several prompt lengths per width bucket, so replays run at widths they were not
captured with) and generate what the eager pass generates, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.core.kv_cache import blocks_needed
from deepinfer.models.ced.pass_graphs import DecoderPassGraphs, pad_slots, width_bucket
from deepinfer.testing.ced import block_sizes_for, build_ced_checkpoint, ced_configs
from deepinfer.testing.compare import assert_same_or_near_tie
from test_ced_decode_path import GPU_CFG as DECODE_GPU_CFG


def test_width_bucket_and_padding():
    assert [width_bucket(j) for j in (0, 1, 64, 65, 128, 129, 1000)] == [64, 64, 64, 128, 128, 256, 1024]
    s = torch.tensor([[3, 4, 9], [7, 7, 8]])
    assert pad_slots(s, 5).tolist() == [[3, 4, 9, 9, 9], [7, 7, 8, 8, 8]]
    assert pad_slots(torch.zeros(1, 0, dtype=torch.long), 3).tolist() == [[0, 0, 0]]


@st.composite
def cases(draw) -> dict:
    ov = draw(ced_configs())
    W = ov["n_win"]
    return dict(ov=ov, seed=draw(st.integers(0, 2**16)), block_size=draw(block_sizes_for(ov)),
                lens=draw(st.lists(st.integers(W, 6 * W + 5), min_size=2, max_size=4)),
                budget=draw(st.sampled_from([4096, W + 1, 4096, 2 * W])), prompt_logprobs=draw(st.booleans()))


def run(path: str, case: dict, prompts: list, static: bool):
    blocks = max(blocks_needed(len(p) + 4, case["block_size"]) for p in prompts) + 1
    llm = LLM(path, block_size=case["block_size"], num_kv_blocks=blocks, max_num_batched_tokens=case["budget"],
              max_num_seqs=1, device="cpu")  # one row a step: the steps the graphs take
    graphs = DecoderPassGraphs(capture=False) if static else None
    llm.engine.kv_cache.pass_graphs = graphs
    calls = []
    if static:
        seen = graphs.run
        graphs.run = lambda *a: calls.append(1) or seen(*a)
    llm.engine.model.reset_counters()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1 if case["prompt_logprobs"] else None)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [(o.outputs[0], o.prompt_logprobs) for o in outs]
    return got, {k: list(v) for k, v in llm.engine.model.counters.items()}, len(calls)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_static_pass_equals_eager(case, tmp_path_factory):
    d = tmp_path_factory.mktemp("pass_graphs")
    ov = dict(case["ov"], global_kv_format="fp32", index_k_format="fp32", swa_kv_format="fp32")
    cfg = build_ced_checkpoint(d, seed=case["seed"], **ov)
    g = torch.Generator().manual_seed(case["seed"])
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in case["lens"]]
    fast, fast_counts, n = run(str(d), case, prompts, True)
    slow, slow_counts, _ = run(str(d), case, prompts, False)
    if case["budget"] >= max(case["lens"]):  # one chunk a prompt: each decoder pass is n_win queries, static
        assert n == len(prompts)
    assert fast_counts == slow_counts
    for i, ((f, fp), (s, sp)) in enumerate(zip(fast, slow)):
        assert_same_or_near_tie(f.token_ids, s.token_ids, s.logprobs, 1e-4, what=f"prompt {i}")
        a, b = [], []
        if f.token_ids == s.token_ids:
            a = [lp[t].logprob for t, lp in zip(f.token_ids, f.logprobs)]
            b = [lp[t].logprob for t, lp in zip(s.token_ids, s.logprobs)]
        if case["prompt_logprobs"]:  # scored by the exact-replay pass, after the static one
            assert len(fp) == len(sp) == case["lens"][i]
            a += [d[t].logprob for d, t in zip(fp[1:], prompts[i][1:])]  # each prompt token's own
            b += [d[t].logprob for d, t in zip(sp[1:], prompts[i][1:])]
        if b:
            scale = max(1.0, max(abs(x) for x in b))
            assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5 * scale


class _Full(DecoderPassGraphs):
    """Graphs that may capture no more (MAX_GRAPHS reached), on the CPU: every covered pass takes the fallback."""

    def covers(self, model, meta, dec, hd, scoring):
        self.capture = False
        ok = super().covers(model, meta, dec, hd, scoring)
        self.capture = True
        return ok


def test_full_graphs_fall_back_to_the_plain_layers(tmp_path, monkeypatch):
    """Past MAX_GRAPHS a covered pass runs the plain layers after its eager compressions (no static copies)."""
    import deepinfer.models.ced.pass_graphs as pg

    monkeypatch.setattr(pg, "MAX_GRAPHS", 0)
    ov = dict(num_layers=4, num_encoder_layers=2, layer_modes=("swa", "full", "full", "reindex"), hidden_size=32,
              num_heads=2, head_dim=32, rope_dim=8, n_win=5, swa_allowance=1, encoder_ratio=2, index_topk=3,
              pool_block=2, pool_blocks=2, index_head_dim=32, index_heads=2, q_lora_rank=32, out_group_dim=32,
              moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, decoder_ratio=1,
              global_kv_format="fp32", index_k_format="fp32", swa_kv_format="fp32", max_position_embeddings=256)
    build_ced_checkpoint(tmp_path, seed=4, **ov)
    prompts = [list(range(3, 3 + n)) for n in (9, 23, 40)]  # n_win 5: every prompt's pass is covered
    case = dict(block_size=4, budget=4096, prompt_logprobs=False)
    slow, slow_counts, _ = run(str(tmp_path), case, prompts, False)
    llm = LLM(str(tmp_path), block_size=4, num_kv_blocks=64, max_num_batched_tokens=4096, max_num_seqs=1,
              device="cpu")
    graphs = llm.engine.kv_cache.pass_graphs = _Full()
    seen, calls = graphs.run, []
    graphs.run = lambda *a: calls.append(1) or seen(*a)
    llm.engine.model.reset_counters()
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    assert len(calls) == len(prompts) and not graphs.graphs
    assert {k: list(v) for k, v in llm.engine.model.counters.items()} == slow_counts
    for o, (s, _) in zip(outs, slow):
        assert o.outputs[0].token_ids == s.token_ids
        assert [lp[t].logprob for t, lp in zip(s.token_ids, o.outputs[0].logprobs)] == \
            [lp[t].logprob for t, lp in zip(s.token_ids, s.logprobs)]


# ----------------------------------------------------------------------------------------------------------
# On a GPU: the captured graphs replay, with the eager pass's bits.

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
GPU_CFG = dict(DECODE_GPU_CFG, n_win=16, max_position_embeddings=2048)  # test_ced_decode_path's, longer prompts


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_pass_matches_eager(tmp_path, dtype):
    build_ced_checkpoint(tmp_path, seed=7, **GPU_CFG)
    g = torch.Generator().manual_seed(3)
    # lengths in one width bucket (decoder ratio 1: widths 70..120 pad to 128) and in two others
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (70, 96, 120, 70, 300, 40, 301)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    kw = dict(device="cuda", dtype=dtype, num_kv_blocks=200, block_size=4, backend="nvidia", max_num_seqs=1,
              enforce_eager=False)
    fast, slow = LLM(str(tmp_path), **kw), LLM(str(tmp_path), **kw)
    graphs = fast.engine.kv_cache.pass_graphs
    assert isinstance(graphs, DecoderPassGraphs)
    slow.engine.kv_cache.pass_graphs = None
    outs, scored = {}, {}
    sp_scored = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    for name, llm in (("fast", fast), ("slow", slow)):
        llm.engine.model.reset_counters()
        outs[name] = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        scored[name] = [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
                        for o, p in zip(llm.generate(prompts[:2], sp_scored, use_tqdm=False), prompts[:2])]
    assert scored["fast"] == scored["slow"]
    assert graphs.captures >= 2 and graphs.replays >= 3, (graphs.captures, graphs.replays, graphs.failed)
    assert not graphs.failed
    assert fast.engine.model.counters == slow.engine.model.counters
    for i, (f, s) in enumerate(zip(outs["fast"], outs["slow"])):
        assert f.token_ids == s.token_ids, f"prompt {i}"
        assert [lp[t].logprob for t, lp in zip(f.token_ids, f.logprobs)] == \
            [lp[t].logprob for t, lp in zip(s.token_ids, s.logprobs)], f"prompt {i}"
