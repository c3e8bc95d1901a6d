"""CED verify steps in CUDA graphs: the padded batch (backends/cuda_graph.py's verify graphs, every row k + 1
tokens) through models/ced/decode_path.py against the eager ragged forward (engine_path.Pass), its oracle.

On the CPU the graph's function runs eagerly (capture needs CUDA): for hypothesis-drawn draft lengths 0..k and
contexts around the window edge, the real tokens' hidden states (and the kept ones a DSpark drafter reads)
and expert load equal the eager forward's, and every cache byte outside the scratch slot and block (global KV, indexer K, SWA
rings, compressor tails, kept encoder outputs) ends the same, also on a second step after partial acceptance
rolled the first back. Through the engine (DecodeGraphs whose graphs run eagerly), greedy DSpark output equals
plain decoding. On a GPU: graph vs eager tokens with DSpark on a CED model."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as hs

from deepinfer import LLM, SamplingParams
from deepinfer.backends.cuda_graph import fill_verify, verify_inputs, verify_metadata
from deepinfer.core.block_tables import BlockTables
from deepinfer.core.draft_gate import DraftGate
from deepinfer.core.inputs import plan
from deepinfer.core.speculative import StepTime
from deepinfer.core.state import ScheduledBatch, Sequence
from deepinfer.models.ced.dspark import DSpark, DSparkConfig, save_dspark
from deepinfer.testing.ced import REPLAY_CONFIG, build_ced_checkpoint

BS, BLOCKS, MAX_SEQS, MAX_BLOCKS = 4, 40, 6, 8
K = REPLAY_CONFIG["swa_allowance"]  # the most drafts a CED step may verify
W = REPLAY_CONFIG["n_win"]


def _checkpoint(d, **formats) -> str:
    """REPLAY_CONFIG's CED with a random DSpark drafter beside it."""
    cfg = build_ced_checkpoint(d, seed=3, **REPLAY_CONFIG, **formats)
    net = DSpark(DSparkConfig(target_hidden=cfg.hidden_size, vocab_size=cfg.vocab_size, hidden=32, num_blocks=1,
                              num_heads=2, ffn=64))
    net.init_weights(1, std=0.2)
    save_dspark(net, d / "dspark")
    return str(d)


@pytest.fixture(scope="module")
def ced(tmp_path_factory):
    # Lossless caches: the two paths differ by float rounding alone (the device path fuses the residual adds
    # into the norms), which a low-bit code would turn into a neighbouring code now and then.
    return _checkpoint(tmp_path_factory.mktemp("ced_verify_graphs"), global_kv_format="fp32",
                       index_k_format="fp32", swa_kv_format="fp32")


@pytest.fixture(scope="module")
def model(ced):
    m = LLM(ced, num_kv_blocks=16, block_size=BS, device="cpu").engine.model
    m.capture_last = 2  # also compare the kept hidden states (what a DSpark drafter reads)
    return m


def _random_cache(model):
    """A CED cache (scratch block last, scratch slot last) full of finite noise: a stray write shows."""
    cache = model.allocate_kv_cache((BLOCKS + 1) * BS, torch.float32, "cpu", block_size=BS, max_seqs=MAX_SEQS)
    cache.henc = torch.zeros(MAX_SEQS + 1, model.config.ring_size, model.config.hidden_size)
    g = torch.Generator().manual_seed(0)
    for t in _tensors(cache):
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 0x70, t.shape, generator=g, dtype=torch.uint8))  # finite E4M3 / E2M1
        else:
            t.copy_(torch.randn(t.shape, generator=g))
    return cache


def _tensors(cache) -> list:
    out = []
    for store in (cache.kv, cache.ik, cache.ring, cache.score_ring):
        for l in sorted(store):
            out += list(store[l])
    return out + [cache.pending[l] for l in sorted(cache.pending)] + [cache.henc]


def _clone(cache):
    import copy

    new = copy.copy(cache)
    for name in ("kv", "ik", "ring", "score_ring"):
        setattr(new, name, {l: tuple(t.clone() for t in v) for l, v in getattr(cache, name).items()})
    new.pending = {l: t.clone() for l, t in cache.pending.items()}
    new.henc = cache.henc.clone()
    return new


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float32) if t.dtype == torch.uint8 else t  # fp32 "codes": 4 bytes a value


def _assert_same_state(got, want, scratch_block: int):
    """Every cache value equal (to float rounding) but the scratch block's entry rows and the scratch slot's
    rows: the noise _random_cache left anywhere else would show a stray write by far."""
    c = got.c

    def same(a, b, what):
        a, b = _values(a), _values(b)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()), msg=what)

    for store in ("kv", "ik"):
        for l in getattr(want, store):
            rows = scratch_block * (BS // c.ratio(l))
            for a, b in zip(getattr(got, store)[l], getattr(want, store)[l]):
                if b.shape[-1]:
                    same(a[:rows], b[:rows], f"{store}{l} differs outside the scratch block")
    for l in want.ring:
        same(got.ring[l][0][:MAX_SEQS], want.ring[l][0][:MAX_SEQS], f"SWA ring {l} differs")
    for l in want.score_ring:
        assert torch.equal(got.score_ring[l][0], want.score_ring[l][0]), f"scoring ring {l} differs"
    for l in want.pending:
        same(got.pending[l][:MAX_SEQS], want.pending[l][:MAX_SEQS], f"compressor tail {l} differs")
    same(got.henc[:MAX_SEQS], want.henc[:MAX_SEQS], "kept encoder outputs differ")


def _sequences(model, lens: list, rng) -> list:
    """Sequences whose prompts of lens[r] tokens were prefilled (positions 0..L-1) and whose next token is
    sampled; blocks for L + 2 K + 2 positions (two verify steps)."""
    free = rng.sample(range(BLOCKS), BLOCKS)
    seqs = []
    for r, L in enumerate(lens):
        s = Sequence(seq_id=r, request_id=str(r), index=0, token_ids=[rng.randrange(500) for _ in range(L + 1)],
                     num_prompt_tokens=L, params=SamplingParams(), arrival=r)
        s.state_slot, s.replay_start = r, model.replay_start_for(L)
        s.block_table = [free.pop() for _ in range(-(-(L + 2 * K + 2) // BS))]
        seqs.append(s)
    return seqs


def _eager(model, seqs, starts, nums, cache, tables, drafts=None):
    batch = ScheduledBatch(seqs=seqs, num_tokens=nums, start=starts, samples=[True] * len(seqs), drafts=drafts)
    inp = plan(batch, BS, "cpu", tables)
    ids, meta = inp.tensors()
    model.device_decode = False  # the host path (engine_path.Pass) even when every row is one token
    try:
        with torch.no_grad():
            h = model(ids, meta, cache)
    finally:
        model.device_decode = True
    return inp, h, model.captured_hidden


def _graph_function(model, seqs, inp, batch_start, cache, tables, extra_rows: int, extra_blocks: int):
    """The verify graph's forward run eagerly on a bucket with extra padded rows and blocks."""
    rows = [seqs[i] for i in inp.rows]
    starts = [batch_start[i] for i in inp.rows]
    Q = K + 1
    B = min(MAX_SEQS, len(rows) + extra_rows)
    NB = min(MAX_BLOCKS, -(-(max(starts) + Q) // BS) + extra_blocks)
    st = verify_inputs(B, NB, Q, BS, tables.scratch_row, "cpu")
    keep = fill_verify(st, [s.input_ids(a, 1 + len(s.draft)) for s, a in zip(rows, starts)], starts,
                       [s.state_slot for s in rows], tables.scratch_row)
    with torch.no_grad():
        h = model(st["ids"], verify_metadata(st, tables, BS), cache)
    return h[keep], model.captured_hidden[keep]


def _close(got, want):
    tol = 1e-5 * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=tol)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(ks=hs.lists(hs.integers(0, K), min_size=1, max_size=4), data=hs.data())
def test_padded_verify_equals_the_ragged_forward(model, ks, data):
    ring = model.config.ring_size
    # Contexts around the window edge and the ring's: the window's first key from the ring, the compressor
    # group (m = 2) completing or not inside the step.
    lens = [data.draw(hs.sampled_from([1, 2, W - 2, W - 1, W, W + 1, ring - 1, ring, ring + 1, 2 * W + 1, 3 * W]))
            for _ in ks]
    rng = random.Random(data.draw(hs.integers(0, 99)))
    extra = (data.draw(hs.integers(0, 2)), data.draw(hs.integers(0, 1)))
    seqs = _sequences(model, lens, rng)
    tables = BlockTables(MAX_SEQS, MAX_BLOCKS, "cpu", scratch_block=BLOCKS)
    tables.sync(seqs)
    eager = _random_cache(model)
    _eager(model, seqs, [0] * len(seqs), list(lens), eager, tables)  # prefill
    graph = _clone(eager)
    starts = list(lens)
    for _ in range(2):  # a verify step, partial acceptance, then another from the accepted position
        for s, k, a in zip(seqs, ks, starts):  # token a: the row's last sampled token, then its drafts
            s.draft = [rng.randrange(500) for _ in range(k)]
            s.token_ids[a + 1:] = s.draft
        nums = [1 + k for k in ks]
        load = model.expert_load
        load.current.zero_()
        inp, want, want_kept = _eager(model, seqs, starts, nums, eager, tables, [list(s.draft) for s in seqs])
        want_load = load.current.clone()
        load.current.zero_()
        got, got_kept = _graph_function(model, seqs, inp, starts, graph, tables, *extra)
        _close(got, want)
        _close(got_kept, want_kept)
        assert torch.equal(load.current, want_load), "the padding counted as expert load"
        _assert_same_state(graph, eager, BLOCKS)
        accepted = [data.draw(hs.integers(0, k)) for k in ks]  # the rest roll back: the next step rewrites them
        for s, n, a in zip(seqs, accepted, starts):
            s.token_ids[a + 1 + n:] = [rng.randrange(500)]  # the bonus token after the accepted drafts
        starts = [a + 1 + n for a, n in zip(starts, accepted)]


# ----------------------------------------------------------------------------------------------------------
# The engine's graph path end to end on the CPU: DecodeGraphs with each "graph" run eagerly instead of replayed.

def _eager_ced_graphs(llm, width: int):
    """Give a CPU CED engine a scratch block (its cache's last) and DecodeGraphs whose graphs run eagerly."""
    from deepinfer.testing.graphs import install_eager_graphs

    cache, bs = llm.engine.kv_cache, llm.engine.config.block_size
    for store in (cache.kv, cache.ik):
        for l, (codes, scales) in store.items():
            per = bs // cache.c.ratio(l)
            store[l] = tuple(torch.cat([t, t.new_zeros(per, t.shape[1])]) for t in (codes, scales))
    return install_eager_graphs(llm, width, cache.scratch_block, sizes=(1, 2, 4))


class _PriorOnly(StepTime):
    """T(n) without the measured steps: dynamic lengths then depend on the confidences alone, not on timing."""

    def record(self, tokens: int, seconds: float, rows=None) -> None:
        pass


class _AlwaysDrafts(DraftGate):
    def open(self, rows: int) -> bool:
        return True


@pytest.mark.parametrize("dynamic", [False, True])
def test_greedy_dspark_through_verify_graphs_equals_plain_decoding(ced, dynamic, monkeypatch):
    """Greedy output equals plain decoding; the drafts, read from the kept hidden states the graphs return,
    are accepted as often as with eager verification (fixed lengths); dynamic steps through padded graphs
    verify every draft the rows have (the gate chose drafting; cutting one saves nothing there), and steps
    that verify eagerly may cut them."""
    from deepinfer.backends.cuda_graph import DecodeGraphs

    ps = [[5, 9, 13, 17, 21, 25, 29, 33], [40, 41, 42, 43, 40, 41, 42], list(range(60, 63))]
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    kw = dict(num_kv_blocks=64, block_size=BS, device="cpu")
    spec = {"method": "dspark", "num_speculative_tokens": K, "dynamic": dynamic}
    plain = [o.outputs[0].token_ids for o in LLM(ced, **kw).generate(ps, sp, use_tqdm=False)]
    eager = LLM(ced, speculative_config=spec, **kw)
    eager.engine.step_time = _PriorOnly()
    eager.generate(ps, sp, use_tqdm=False)
    fast = LLM(ced, speculative_config=spec, **kw)
    fast.engine.step_time = _PriorOnly()
    if dynamic:  # every step drafts (the rows near max_tokens draft fewer, padded), whatever the gate measures
        fast.engine.draft_gate = _AlwaysDrafts()
    graphs = _eager_ced_graphs(fast, K + 1)
    lengths: list = []
    run = DecodeGraphs.run_verify
    monkeypatch.setattr(DecodeGraphs, "run_verify", lambda self, ids, *a, **k: lengths.extend(map(len, ids))
                        or run(self, ids, *a, **k))
    eng, cuts = fast.engine, []  # (padded verify graph, drafts proposed, drafts kept) per drafting row and step
    proposed: dict = {}
    propose_batch, propose_drafts = eng.drafter.propose_batch, eng._propose_drafts

    def spy_batch(seqs, ks):
        out = propose_batch(seqs, ks)
        proposed.update({s.seq_id: len(d) for s, d in zip(seqs, out)})
        return out

    def spy_drafts():
        proposed.clear()
        padded = bool(eng._padded_verify_width())
        propose_drafts()
        cuts.extend((padded, proposed[s.seq_id], len(s.draft)) for s in eng.scheduler.running if s.seq_id in proposed)

    eng.drafter.propose_batch, eng._propose_drafts = spy_batch, spy_drafts
    got = [o.outputs[0].token_ids for o in fast.generate(ps, sp, use_tqdm=False)]
    assert got == plain
    assert graphs.num_verify_replays > 0 and graphs.num_replays > graphs.num_verify_replays
    assert fast.spec_stats()["draft_tokens"] > 0
    assert min(lengths) < K + 1, "no row was padded"  # (rows near max_tokens draft fewer)
    if not dynamic:
        for key in ("draft_tokens", "accepted_tokens"):
            assert fast.spec_stats()[key] == eager.spec_stats()[key], key
    else:
        assert any(p for p, _, _ in cuts) and all(kept == n for p, n, kept in cuts if p)


def test_ced_engine_asks_for_verify_graphs(ced):
    from deepinfer.core.speculative import verify_width, wants_hidden

    llm = LLM(ced, num_kv_blocks=16, block_size=BS, device="cpu",
              speculative_config={"method": "dspark", "num_speculative_tokens": K})
    eng = llm.engine
    assert verify_width(eng.pipeline, eng.config, eng.model, ced) == K + 1
    assert not wants_hidden(eng.pipeline, eng.config, eng.model, ced)  # its graphs keep the drafter's states


# ----------------------------------------------------------------------------------------------------------
# On a GPU: the graphs themselves.

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ced_verify_graphs_give_the_eager_tokens(tmp_path, dtype):
    """The real cache formats (FP4 entries, FP8 rings) and the nvidia kernels, graphs against eager."""
    from deepinfer.testing.compare import NEAR_TIE, assert_same_or_near_tie

    ced = _checkpoint(tmp_path)

    spec = {"method": "dspark", "num_speculative_tokens": K}
    kw = dict(device="cuda", dtype=dtype, num_kv_blocks=128, block_size=BS, backend="nvidia", speculative_config=spec)
    graphs, eager = LLM(ced, enforce_eager=False, **kw), LLM(ced, enforce_eager=True, **kw)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9, 26, 6)]
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    a = graphs.generate(prompts, sp, use_tqdm=False)
    b = eager.generate(prompts, sp, use_tqdm=False)
    assert graphs.engine.decode_graphs is not None and graphs.engine.decode_graphs.num_verify_replays > 0
    assert graphs.spec_stats()["draft_tokens"] > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same_or_near_tie(x.outputs[0].token_ids, y.outputs[0].token_ids, y.outputs[0].logprobs,
                                NEAR_TIE[dtype], what=f"CED {dtype} prompt {i}")


@cuda
@pytest.mark.gpu
def test_demo_dspark_accepts_as_often_through_graphs_as_eagerly():
    """The demo's trained drafter reads the kept hidden states the graphs return: float32, the same drafts and
    acceptances as eager verification (graphs captured before the drafter asked for them once returned none,
    and acceptance fell from 0.20 to 0.05 with the same tokens)."""
    ps = ["import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self"]
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    spec = {"method": "dspark", "num_speculative_tokens": 4}
    runs = {}
    for eager in (True, False):
        llm = LLM(device="cuda", dtype="float32", backend="nvidia", enforce_eager=eager, speculative_config=spec)
        toks = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        runs[eager] = toks, llm.spec_stats()
    assert runs[False][0] == runs[True][0]
    assert runs[True][1]["acceptance_rate"] > 0.1
    for key in ("draft_tokens", "accepted_tokens"):
        assert runs[False][1][key] == runs[True][1][key], key


@cuda
@pytest.mark.gpu
def test_ced_dspark_step_syncs_once(tmp_path):
    """A DSpark step on CED through the graphs: its drafts' one copy to the host (DSpark.draft_batch) and the
    collection's event wait (not reported); eager CED verification would add its host layout's reads."""
    from deepinfer.testing.syncs import synchronizing_calls

    ced = _checkpoint(tmp_path)
    llm = LLM(ced, device="cuda", dtype="bfloat16", num_kv_blocks=256, block_size=BS, backend="nvidia",
              enforce_eager=False, speculative_config={"method": "dspark", "num_speculative_tokens": K})
    eng = llm.engine
    sp = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for i, n in enumerate((5, 12, 20)):
        eng.add_request(str(i), {"prompt_token_ids": list(range(7, 7 + n))}, sp)
    for _ in range(4):
        eng.step()
    before, steps = eng.decode_graphs.num_verify_replays, 16
    syncs = synchronizing_calls(eng.step, steps)
    assert eng.decode_graphs.num_verify_replays - before == steps
    assert len(syncs) <= steps, syncs[:5]
