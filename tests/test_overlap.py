"""Overlap scheduling: launching step N+1 before step N's tokens reach the host changes no output.

The engine runs the same requests with overlap on and off (on the CPU, where the device work is synchronous,
so this checks the bookkeeping: pending token references, draining sequences, dropped rows of sequences that
finished meanwhile, preemption, aborts, failures). Greedy and seeded outputs must be identical, token for token.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.core.state import Sequence
from deepinfer.testing.compare import NEAR_TIE, assert_greedy_matches
from deepinfer.testing.models import build_tiny_hf_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    build_tiny_hf_model(d, "llama")
    return str(d)


@pytest.fixture(scope="module")
def pair(ckpt):
    # Few KV blocks: long batches preempt. max_num_seqs small: admission queues.
    # On the CPU: this checks bookkeeping, and identical tokens need identical arithmetic; on a GPU a step's
    # batch (overlap samples a finished row's extra token) picks other GEMM kernels (test_overlap_on_gpu below).
    kw = dict(num_kv_blocks=24, block_size=4, max_model_len=64, max_num_seqs=6, max_num_batched_tokens=48,
              device="cpu", backend="reference")
    return LLM(ckpt, overlap_scheduling=False, **kw), LLM(ckpt, overlap_scheduling=True, **kw)


def _summary(outs):
    """Per request, per completion: (tokens, text, finish, stop reason, logprob keys) and the logprob values
    (compared with a tolerance: a step's batch differs with overlap, so float sums may round differently)."""
    exact, values = [], []
    for o in outs:
        exact.append([(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                       None if c.logprobs is None else [sorted(d) for d in c.logprobs]) for c in o.outputs])
        values.append([[] if c.logprobs is None else [l.logprob for d in c.logprobs for _, l in sorted(d.items())]
                       for c in o.outputs])
    return list(zip(exact, values))


@st.composite
def params_st(draw):
    max_tokens = draw(st.integers(1, 24))
    return SamplingParams(
        n=draw(st.integers(1, 2)), max_tokens=max_tokens, min_tokens=draw(st.integers(0, min(3, max_tokens))),
        temperature=draw(st.sampled_from([0.0, 0.0, 0.8, 1.3])), top_k=draw(st.sampled_from([0, 5])),
        top_p=draw(st.sampled_from([1.0, 0.9])), repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
        presence_penalty=draw(st.sampled_from([0.0, 0.5])), seed=draw(st.sampled_from([None, 0, 3])),
        logprobs=draw(st.sampled_from([None, 2])), stop=draw(st.sampled_from([None, ["e"], ["the", "\n"]])),
        ignore_eos=draw(st.booleans()))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(st.integers(1, 30), params_st()), min_size=1, max_size=9))
def test_overlap_matches_sync(pair, batch):
    sync, over = pair
    prompts = [list(range(3, 3 + n)) for n, _ in batch]
    params = [p for _, p in batch]
    a = sync.generate(prompts, params, use_tqdm=False)
    b = over.generate(prompts, params, use_tqdm=False)
    # Greedy and seeded rows must agree; unseeded random rows draw from the engine's shared generator, whose
    # stream depends on which rows each step samples (overlap samples a finished row's wasted extra token).
    for p, (x, xv), (y, yv) in zip(params, _summary(a), _summary(b)):
        if p.greedy or p.seed is not None:
            assert x == y
            assert xv == [pytest.approx(v, abs=1e-4) for v in yv]
    assert over.engine._inflight is None  # generate leaves no step behind
    assert over.engine.pool.num_free == over.engine.pool.num_blocks  # every block came back


def test_overlap_actually_overlaps(pair):
    """With overlap, a step's call reports the step before: the first call launches and reports nothing."""
    _, over = pair
    over.engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert over.engine.step() == [] and over.engine._inflight is not None
    seq = over.engine.requests["x"].seqs[0]
    assert len(seq.pending) == 1 and seq.pending[0] < 0 and seq.output_token_ids == []
    over.engine.step()  # launches step 2 (its input is step 1's pending token), collects step 1
    assert len(seq.output_token_ids) == 1 and len(seq.pending) == 1
    outs = []
    while over.engine.has_unfinished():
        outs += over.engine.step()
    assert [len(o.outputs[0].token_ids) for o in outs] == [3]
    assert seq.pending == [] and over.engine._inflight is None


def test_abort_while_in_flight(pair):
    _, over = pair
    eng = over.engine
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    eng.add_request("b", [8, 9], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort("a")  # its next token is in flight: dropped at collection
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    by = {o.request_id: o.outputs[0] for o in outs}
    assert by["a"].finish_reason == "abort" and len(by["a"].token_ids) == 1
    ref = over.generate([[8, 9]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert by["b"].token_ids == ref[0].outputs[0].token_ids
    assert eng.pool.num_free == eng.pool.num_blocks


def test_failing_host_stage_fails_its_batch_only(ckpt):
    """A host stage that raises fails the requests of its step; the engine keeps serving."""
    llm = LLM(ckpt, overlap_scheduling=True, num_kv_blocks=32, max_model_len=64, device="cpu", backend="reference")
    det = llm.engine.stages["step"][-1]
    calls = {"n": 0}
    orig = type(det).__call__

    def flaky(self, state):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return orig(self, state)

    type(det).__call__ = flaky
    try:
        outs = llm.generate([[5, 6]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        type(det).__call__ = orig
    assert outs[0].outputs[0].finish_reason == "error" and "boom" in outs[0].error
    ok = llm.generate([[5, 6]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 8
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_input_ids_reads_pending_references():
    s = Sequence(seq_id=0, request_id="r", index=0, token_ids=[1, 2, 3], num_prompt_tokens=2,
                 params=SamplingParams(), arrival=0)
    s.pending = [-5, -9]
    assert s.num_tokens == 5
    assert s.input_ids(1, 4) == [2, 3, -5, -9]
    assert s.input_ids(3, 1) == [-5] and s.input_ids(4, 1) == [-9]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("in_graph", [False, True])
def test_overlap_on_gpu(ckpt, in_graph, monkeypatch):
    """On the GPU, where the next step really runs while the host collects: float32 greedy tokens as without
    overlap, and every step after the first reported one step late; with the decode graphs resolving the pending
    references themselves (cuda_graph.RESOLVE_IN_GRAPH) too."""
    from deepinfer.backends import cuda_graph

    monkeypatch.setattr(cuda_graph, "RESOLVE_IN_GRAPH", in_graph)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 26, 2)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=2)  # logprobs: the top two
              for m in (24, 5, 17, 1, 30, 12)]
    kw = dict(device="cuda", backend="nvidia", dtype="float32", num_kv_blocks=64, block_size=4)
    on, off = LLM(ckpt, overlap_scheduling=True, **kw), LLM(ckpt, overlap_scheduling=False, **kw)
    assert on.engine.overlap and not off.engine.overlap
    graphs = on.engine.decode_graphs
    assert graphs is not None
    assert all((st.get("future") is not None) == in_graph for _, st, _ in graphs.graphs.values())
    a = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0] for o in off.generate(prompts, params, use_tqdm=False)]
    assert [len(x) for x in a] == [24, 5, 17, 1, 30, 12]
    # Overlap changes a step's batch (a finished row's extra token), so cuBLAS may pick another GEMM and round
    # differently: a sequence may part from the synchronous run only at a near-tie of that run's top two logits.
    assert_greedy_matches(a, [y.token_ids for y in b], [y.logprobs for y in b], NEAR_TIE["float32"])
    assert on.engine.pool.num_free == on.engine.pool.num_blocks


def test_graph_resolution_is_resolve_future():
    """cuda_graph.resolve_in_graph (pending references resolved inside a decode graph) gives resolve_future's ids
    wherever the eager one is defined; a reference past the buffer reads its last entry instead of raising."""
    from deepinfer.backends.cuda_graph import resolve_in_graph
    from deepinfer.layout import resolve_future

    g = torch.Generator().manual_seed(3)
    future = torch.randint(0, 1000, (12,), generator=g)
    for _ in range(20):
        ids = torch.randint(-12, 50, (9,), generator=g)
        assert torch.equal(resolve_in_graph(ids, future), resolve_future(ids, future))
    assert resolve_in_graph(torch.tensor([-13, -1, 4]), future).tolist() == [int(future[-1]), int(future[0]), 4]


def test_pending_ids_resolved_in_the_graph_give_the_same_tokens(ckpt, monkeypatch):
    """An overlapping engine on the graph path (EagerGraphs: the captured functions run eagerly on the CPU), with
    RESOLVE_IN_GRAPH on: the graphs resolve the pending references from the engine's future buffer and the host
    resolves none; greedy tokens and their logprobs as with it off, which resolves each replay's on the host."""
    from deepinfer.backends import cuda_graph
    from deepinfer.testing.graphs import install_eager_graphs_paged

    kw = dict(num_kv_blocks=40, block_size=4, max_model_len=64, max_num_seqs=4, device="cpu", backend="reference",
              overlap_scheduling=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(3, 20)), [9, 9, 9, 9], list(range(30, 41)), [4]]
    sp = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1) for m in (12, 7, 15, 1, 9)]
    host_calls = []
    real = cuda_graph.resolve_future
    monkeypatch.setattr(cuda_graph, "resolve_future", lambda *a: host_calls.append(1) or real(*a))
    got = {}
    for on in (False, True):
        monkeypatch.setattr(cuda_graph, "RESOLVE_IN_GRAPH", on)
        llm = LLM(ckpt, **kw)
        graphs = install_eager_graphs_paged(llm, 3)
        host_calls.clear()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert graphs.num_replays > 0 and all(o.error is None for o in outs)
        assert all((st.get("future") is not None) == on for _, st, _ in graphs.graphs.values())
        got[on] = (_summary(outs), len(host_calls))
    assert got[False][1] > 0 and got[True][1] == 0  # pending references reached the graphs both times
    for (x, xv), (y, yv) in zip(got[False][0], got[True][0]):
        assert x == y
        assert xv == [pytest.approx(v, abs=1e-5) for v in yv]


def test_verify_statics_resolved_in_the_graph():
    """A verify graph's inputs: fill_verify(in_graph=True) leaves the pending references for the graph, whose ids
    (cuda_graph._graph_ids) are then what the host-resolved fill writes; everything else is the same."""
    from deepinfer.backends import cuda_graph as cg

    future = torch.arange(100, 116)
    ids = [[7, -3], [-1, 4, 5], [-16]]
    starts, slots = [10, 3, 20], [2, 0, 1]
    host, graph = cg.verify_inputs(4, 8, 3, 4, 9, "cpu"), cg.verify_inputs(4, 8, 3, 4, 9, "cpu")
    graph["future"] = future
    keep_h = cg.fill_verify(host, ids, starts, slots, 9, future)
    keep_g = cg.fill_verify(graph, ids, starts, slots, 9, future, in_graph=True)
    assert torch.equal(keep_h, keep_g)
    assert graph["ids"].min() < 0 and host["ids"].min() >= 0
    assert torch.equal(cg._graph_ids(graph), host["ids"]) and torch.equal(cg._graph_ids(host), host["ids"])
    assert host["ids"][:6].tolist() == [7, 102, 0, 100, 4, 5] and int(host["ids"][6]) == 115
    for k in ("pos", "nums", "rows"):
        assert torch.equal(host[k], graph[k])
    assert cg._resolves(graph, future, future) and not cg._resolves(graph, future.clone(), future)
    assert not cg._resolves(host, future, future) and not cg._resolves(graph, None, future)
