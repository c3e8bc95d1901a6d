"""Greedy DSpark drafting in CUDA graphs (models/ced/dspark_graphs.py) against the eager drafter (GPU only)."""

import pytest
import torch

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

SPEC = {"method": "dspark", "num_speculative_tokens": 4}


def _contexts(net, n: int, dtype, seed: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = net.config.target_layers * net.config.target_hidden
    return list(torch.randn(n, width, generator=g, device="cuda").to(dtype))


def test_graph_drafts_equal_the_eager_drafter():
    """A full bucket gives what draft_batch gives for greedy rows (the same kernels at the same batch); fewer rows
    give what the full bucket gave them (rows are independent), at every wanted length."""
    llm = LLM(speculative_config=SPEC, cuda_graph_sizes=[1, 4, 8])
    stage = llm.engine.drafter
    graphs, net, model = stage.graphs, stage.drafter_net, llm.engine.model
    assert graphs is not None and sorted(graphs.graphs) == [1, 4, 8]
    dtype = model.embed.weight.dtype
    for B in (1, 4, 8):
        ctx = _contexts(net, B, dtype, seed=B)
        anchors = [(37 * i + 11) % model.vocab_size for i in range(B)]
        ks = [1 + i % 4 for i in range(B)]
        want_t, q, want_s = net.draft_batch(ctx, anchors, ks, model, [True] * B, [None] * B)
        assert q is None
        assert graphs.covers(ctx, [True] * B, ks)
        got_t, got_s = graphs.draft(ctx, anchors, ks)
        assert got_t == want_t and got_s == want_s, B
        if B > 1:
            part = graphs.draft(ctx[:B - 1], anchors[:B - 1], ks[:B - 1])
            assert part == (got_t[:B - 1], got_s[:B - 1])
    assert not graphs.covers(ctx, [True] * 7 + [False], ks)  # a sampled row: the eager drafter
    assert not graphs.covers(ctx * 2, [True] * 16, ks * 2)  # beyond the largest bucket


def test_generation_with_draft_graphs_equals_eager_drafting():
    """The engine drafts through the graphs (replays counted) and emits what it emits drafting eagerly, with the
    same acceptance (the drafts themselves are the same)."""
    prompts = ["import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n", "for i in range(", "x = [1, 2, "]
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = []
    for use_graphs in (True, False):
        llm = LLM(speculative_config=SPEC, cuda_graph_sizes=[4])
        if not use_graphs:
            llm.engine.drafter.graphs = None
        out = llm.generate(prompts, sp, use_tqdm=False)
        st = llm.spec_stats()
        runs.append(([o.outputs[0].token_ids for o in out], st["num_accepted_tokens"], st["num_draft_tokens"]))
        if use_graphs:
            assert llm.engine.drafter.graphs.replays > 0
    assert runs[0] == runs[1]
    assert runs[0][1] > 0


def test_buckets_whose_logits_would_stay_large_draft_eagerly(monkeypatch):
    """A captured bucket keeps its [B, P, V] float32 logits in the pool: buckets past MAX_LOGITS_BYTES are not
    captured, and their batches draft eagerly."""
    from deepinfer.models.ced import dspark_graphs

    llm = LLM(speculative_config=SPEC, cuda_graph_sizes=[1, 4, 8])
    net = llm.engine.drafter.drafter_net
    per_row = net.config.positions * net.config.vocab_size * 4
    monkeypatch.setattr(dspark_graphs, "MAX_LOGITS_BYTES", 4 * per_row)
    small = dspark_graphs.DraftGraphs(net, llm.engine.model, [1, 4, 8], 4, llm.engine.model.embed.weight.dtype)
    small.capture()
    assert sorted(small.graphs) == [1, 4]
    ctx = _contexts(net, 6, llm.engine.model.embed.weight.dtype, seed=0)
    assert small.covers(ctx[:4], [True] * 4, [4] * 4) and not small.covers(ctx, [True] * 6, [4] * 6)
