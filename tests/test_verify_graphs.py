"""Verify steps in CUDA graphs (backends/cuda_graph.py): the padded graph path against the eager ragged forward.

On the CPU the graph's function runs eagerly (capture needs CUDA): for ragged draft lengths, its metadata at
every real token equals the eager path's (core/inputs.py), its padding writes only the scratch block, and the
hidden states and KV it computes equal the eager forward's. On a GPU, greedy tokens with verify graphs equal
eager verification's, and a speculating engine syncs the host at most once per step."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as hs

from deepinfer import LLM, SamplingParams
from deepinfer.backends.cuda_graph import _bucket, fill_verify, verify_inputs, verify_metadata
from deepinfer.core.block_tables import BlockTables
from deepinfer.core.inputs import plan
from deepinfer.core.state import ScheduledBatch, Sequence
from deepinfer.testing.models import build_tiny_hf_model

BS, BLOCKS, MAX_SEQS, MAX_BLOCKS = 4, 48, 8, 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify_graph_llama")
    build_tiny_hf_model(d, "llama", seed=2)
    return str(d)


@pytest.fixture(scope="module")
def model(checkpoint):
    # The reference backend on the CPU on every machine (a GPU machine would default to CUDA).
    return LLM(checkpoint, num_kv_blocks=16, block_size=BS, device="cpu").engine.model


def sequences(ks: list, lens: list, seed: int) -> list:
    rng = random.Random(seed)
    free = rng.sample(range(BLOCKS), BLOCKS)
    seqs = []
    for r, (k, L) in enumerate(zip(ks, lens)):
        s = Sequence(seq_id=r, request_id=str(r), index=0, token_ids=[rng.randrange(512) for _ in range(L + 1)],
                     num_prompt_tokens=L + 1, params=SamplingParams(), arrival=r)
        s.draft = [rng.randrange(512) for _ in range(k)]
        s.num_computed_tokens, s.state_slot = L, r
        s.block_table = [free.pop() for _ in range(-(-(L + 1 + k) // BS))]
        seqs.append(s)
    return seqs


@settings(max_examples=12, deadline=None)
@given(ks=hs.lists(hs.integers(0, 3), min_size=1, max_size=5), data=hs.data())
def test_verify_graph_function_equals_the_eager_forward(model, ks, data):
    lens = [data.draw(hs.integers(1, MAX_BLOCKS * BS - 3 - 2)) for _ in ks]
    extra = (data.draw(hs.integers(0, 2)), data.draw(hs.integers(0, 1)))
    check_padded_forward(model, ks, lens, data.draw(hs.integers(0, 99)), extra)


def test_verify_graph_function_on_the_nvidia_kernels(checkpoint):
    """The same through the nvidia backend's kernels (Triton's interpreter without a GPU, the real kernels on
    CUDA): the paged prefill kernel places a padded row's real queries where the eager ragged call does."""
    model = LLM(checkpoint, num_kv_blocks=16, block_size=BS, backend="nvidia").engine.model
    before = model.ops.kernel_calls["paged_prefill"]
    check_padded_forward(model, [3, 0, 1], [9, 5, 14], seed=4, extra=(1, 1))
    assert model.ops.kernel_calls["paged_prefill"] > before  # the kernel ran, not the reference fallback


def check_padded_forward(model, ks: list, lens: list, seed: int, extra: tuple) -> None:
    """extra: (padded rows beyond the batch, blocks beyond the ones needed) of the graph's bucket. Runs on the
    model's device."""
    dev = model.model.embed_tokens.weight.device
    K = 3
    Q = K + 1
    seqs = sequences(ks, lens, seed)
    batch = ScheduledBatch(seqs=seqs, num_tokens=[1 + k for k in ks], start=list(lens), samples=[True] * len(ks),
                           drafts=[list(s.draft) for s in seqs])
    tables = BlockTables(MAX_SEQS, MAX_BLOCKS, dev, scratch_block=BLOCKS)
    tables.sync(seqs)
    g = torch.Generator().manual_seed(1)
    kv = tuple(torch.randn(t.shape, generator=g).to(dev)
               for t in model.allocate_kv_cache((BLOCKS + 1) * BS, torch.float32, dev))
    kv_eager, kv_graph = tuple(t.clone() for t in kv), tuple(t.clone() for t in kv)

    inp = plan(batch, BS, dev, tables)
    ids, meta = inp.tensors()
    with torch.no_grad():
        want = model(ids, meta, kv_eager)  # [T, d] the stream the verify stage reads

    rows = [seqs[i] for i in inp.rows]
    starts = [batch.start[i] for i in inp.rows]
    B = _bucket(len(rows) + extra[0], range(1, MAX_SEQS + 1))  # some padded rows
    NB = min(MAX_BLOCKS, -(-(max(starts) + Q) // BS) + extra[1])
    st = verify_inputs(B, NB, Q, BS, tables.scratch_row, dev)
    keep = fill_verify(st, [s.input_ids(a, 1 + len(s.draft)) for s, a in zip(rows, starts)], starts,
                       [s.state_slot for s in rows], tables.scratch_row)
    gmeta = verify_metadata(st, tables, BS)
    # The real tokens' inputs and metadata are the eager path's; every padded token writes the scratch block.
    assert torch.equal(st["ids"][keep], ids)
    assert torch.equal(gmeta.positions[keep], meta.positions)
    assert torch.equal(gmeta.slot_mapping[keep], meta.slot_mapping)
    pad = torch.ones(B * Q, dtype=torch.bool, device=dev)
    pad[keep] = False
    assert (gmeta.slot_mapping[pad] // BS == BLOCKS).all()
    with torch.no_grad():
        got = model(st["ids"], gmeta, kv_graph)[keep]
    tol = 1e-5 * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=tol)
    for a, b in zip(kv_graph, kv_eager):  # the same KV everywhere but the scratch block
        torch.testing.assert_close(a[:, :BLOCKS * BS], b[:, :BLOCKS * BS], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# On a GPU: the graphs themselves.

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _ngram_llms(path, K):
    pytest.importorskip("deepinfer_ngram", reason="the n-gram draft plugin: pip install -e plugins/deepinfer-ngram")
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=128, block_size=4, backend="nvidia",
              speculative_config=spec)
    return LLM(path, enforce_eager=False, **kw), LLM(path, enforce_eager=True, **kw)


def _prompts():
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(3, 512, (6,), generator=g).tolist()
    return [motif * 4 + [7, 8], torch.randint(3, 512, (23,), generator=g).tolist(), motif[:3] * 3, motif * 2]


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "deepseek_v2"])
def test_verify_graphs_give_the_eager_tokens(tmp_path, name):
    from deepinfer.testing.compare import NEAR_TIE, assert_same_or_near_tie

    build_tiny_hf_model(tmp_path, name)
    graphs, eager = _ngram_llms(str(tmp_path), 3)
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    a = graphs.generate(_prompts(), sp, use_tqdm=False)
    b = eager.generate(_prompts(), sp, use_tqdm=False)
    assert graphs.engine.decode_graphs.num_verify_replays > 0 and eager.engine.decode_graphs is None
    assert graphs.spec_stats()["accepted_tokens"] > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same_or_near_tie(x.outputs[0].token_ids, y.outputs[0].token_ids, y.outputs[0].logprobs,
                                NEAR_TIE["float32"], what=f"{name} prompt {i}")


@cuda
@pytest.mark.gpu
def test_speculating_engine_syncs_at_most_once_per_step(tmp_path):
    """profile_decode.py's sync detection: every synchronizing CUDA call warns; a speculating step's only one
    is its collection (the event wait), which does not warn."""
    from deepinfer.testing.syncs import synchronizing_calls

    build_tiny_hf_model(tmp_path, "llama")
    llm, _ = _ngram_llms(str(tmp_path), 3)
    eng = llm.engine
    sp = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for i, p in enumerate(_prompts()):
        eng.add_request(str(i), {"prompt_token_ids": p}, sp)
    for _ in range(4):
        eng.step()
    steps = 16
    syncs = synchronizing_calls(eng.step, steps)
    assert eng.decode_graphs.num_verify_replays > 0
    assert len(syncs) <= steps, syncs[:5]


# ----------------------------------------------------------------------------------------------------------
# The engine's graph path end to end on the CPU: DecodeGraphs with each "graph" run eagerly instead of replayed.

def _eager_graphs(llm, width: int):
    """Give a CPU engine a scratch block and DecodeGraphs whose graphs run eagerly (capture needs CUDA)."""
    from deepinfer.testing.graphs import install_eager_graphs_paged

    return install_eager_graphs_paged(llm, width)


def test_engine_verify_graph_path_gives_eager_verification_tokens(checkpoint):
    """Through ForwardStage and DecodeGraphs.run_verify (fill, padded forward, gather to the stream layout),
    speculative greedy output equals eager verification's; some steps verify through the graphs."""
    pytest.importorskip("deepinfer_ngram", reason="the n-gram draft plugin: pip install -e plugins/deepinfer-ngram")
    from deepinfer.testing.compare import NEAR_TIE, assert_same_or_near_tie

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    kw = dict(num_kv_blocks=64, block_size=BS, speculative_config=spec, device="cpu")  # graphs run eagerly
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    eager = LLM(checkpoint, **kw).generate(_prompts(), sp, use_tqdm=False)
    llm = LLM(checkpoint, **kw)
    graphs = _eager_graphs(llm, 4)
    got = llm.generate(_prompts(), sp, use_tqdm=False)
    assert graphs.num_verify_replays > 0 and graphs.num_replays > graphs.num_verify_replays
    assert llm.spec_stats()["accepted_tokens"] > 0
    for i, (a, b) in enumerate(zip(got, eager)):
        assert a.error is None, a.error
        assert_same_or_near_tie(a.outputs[0].token_ids, b.outputs[0].token_ids, b.outputs[0].logprobs,
                                NEAR_TIE["float32"], what=f"prompt {i}")
