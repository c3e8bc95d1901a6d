"""EPLB over the torch.distributed workers (parallel/expert_moves.py, placement.Eplb with a mover).

The oracle is the single-process engine on the same checkpoint with the same skewed router (a fixed selection
bias towards experts 0 and 1, both loaded on rank 0: the default placement is as unbalanced as it gets), set here
directly on its blocks. One set of 2 gloo workers (tensor-parallel attention, expert-parallel experts, 2
redundant slots) rebalances every 4 steps while generating; its greedy tokens are the oracle's, the placement
moved experts between the ranks and did not make balancedness worse, and every rank's slots hold, bitwise, the
checkpoint weights of the expert the tables say. A second engine does the same with data-parallel attention,
where each rank routes only its own tokens and rank 0 learns the whole batch's load from the dispatch counts.

In one process: the move plan (every changed slot takes its new expert from a slot holding it now, on its own rank
where one does) and the initial placement (each rank's slots hold only the experts it loaded).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.models.moe import MoEBlock
from deepinfer.parallel.expert_moves import move_plan, rank_initial_placement
from deepinfer.testing.models import build_tiny_hf_model

HOT, BIAS = (0, 1), 0.5
PROMPTS = [[7, 11, 13, 17, 19], [23, 29, 31, 37, 41, 43, 47, 53], [59, 61], [3, 5, 8, 13, 21, 34, 55]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ENGINE = dict(num_kv_blocks=64, max_model_len=128, threads=1)
EPLB = {"window_size": 8, "step_interval": 4, "num_redundant_experts": 2}


def skew(bias_of: dict, blocks: list) -> None:
    """The oracle's router bias, set on its blocks (no parallel code)."""
    for name, b in blocks:
        b.e_score_correction_bias = torch.nn.Parameter(bias_of[name].to(b.gate_weight.device), requires_grad=False)


def moe_blocks(model) -> list:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoEBlock)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe")
    build_tiny_hf_model(path, "qwen3-moe", init_range=0.3)
    return str(path)


@pytest.fixture(scope="module")
def oracle(ckpt):
    return make_oracle(ckpt)


def make_oracle(ckpt, **kw) -> tuple:
    """(greedy tokens, expert load, {block name: w13, w2 [E, ...]}, bias) of one process with the skewed router."""
    llm = LLM(ckpt, hf_overrides={"expert_load_window": EPLB["window_size"]}, **ENGINE, **kw)  # EPLB's window
    blocks = moe_blocks(llm.engine.model)
    E = blocks[0][1].num_experts
    bias = torch.zeros(E)
    bias[list(HOT)] = BIAS
    skew({n: bias for n, _ in blocks}, blocks)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    weights = {n: (b.w13.detach().clone(), b.w2.detach().clone()) for n, b in blocks}
    return tokens, llm.expert_load()["layers"], weights, bias


def serve(ckpt, oracle, **kw):
    """A 2-rank engine with EPLB, skewed on every rank, after the prompts. Returns (llm, tokens, [(state slot,
    block table) of every scheduled row of every step])."""
    llm = LLM(ckpt, enable_expert_parallel=True, enable_eplb=True, eplb_config=dict(EPLB), enable_prefix_caching=False,
              distributed_timeout_s=60, **kw, **ENGINE)
    rows, schedule = [], llm.engine.scheduler.schedule

    def spy():
        batch = schedule()
        rows.extend((s.state_slot, list(s.block_table)) for s in (batch.seqs if batch else ()))
        return batch

    llm.engine.scheduler.schedule = spy
    try:
        llm.engine.model.set_parameters({f"{n}.e_score_correction_bias": oracle[3]
                                         for n, _ in moe_blocks(llm.engine.model.inner)})
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    except BaseException:
        llm.shutdown()
        raise
    return llm, tokens, rows


def check_moved(llm, oracle) -> dict:
    """Rebalanced mid-generation, never worse, experts moved across ranks, every slot bitwise its expert."""
    stats = llm.eplb_stats()
    assert stats["distributed"] and stats["num_ranks"] == 2 and stats["num_physical_experts"] == 10
    hist = stats["history"]
    assert len(hist) >= 2 and all(r["after"] >= r["before"] - 1e-12 for r in hist)
    assert hist[0]["after"] > hist[0]["before"] + 0.05  # the skew was worth moving for
    assert stats["balancedness"] > stats["balancedness_default"]  # on the window now, against the start
    load = llm.expert_load()["layers"]  # every rank's tokens: the same totals as one process over the window
    assert {k: sum(v) for k, v in load.items()} == {k: sum(v) for k, v in oracle[1].items()}
    assert all(load[k][e] > 2 * max(v[2:]) for k, v in load.items() for e in HOT)  # the skew is seen
    inner = llm.engine.model.inner
    for i, (name, b) in enumerate(moe_blocks(inner)):
        phy2log = b.placement.phy2log_host
        assert phy2log != rank_initial_placement(8, 10, 2)
        assert set(phy2log[5:]) & set(HOT), "no hot expert reached rank 1"  # weights crossed ranks
        slots = llm.engine.model.expert_slots(i)
        w13, w2 = oracle[2][name]
        for p, e in enumerate(phy2log):  # bitwise: the bytes moved, not a recomputation
            assert torch.equal(slots["w13"][p].view(torch.int32), w13[e].view(torch.int32)), (name, p, e)
            assert torch.equal(slots["w2"][p].view(torch.int32), w2[e].view(torch.int32)), (name, p, e)
        assert torch.equal(slots["w13"][:5].view(torch.int32), b.w13.view(torch.int32))  # rank 0's own slots
    return stats


@pytest.mark.multiprocess
def test_rebalancing_across_ranks_mid_generation(ckpt, oracle):
    llm, tokens, _ = serve(ckpt, oracle, tensor_parallel_size=2)
    try:
        assert tokens == oracle[0]
        check_moved(llm, oracle)
        again = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)  # serving goes on from the moved placement
        assert [o.outputs[0].token_ids for o in again] == oracle[0][:2]
    finally:
        llm.shutdown()


@pytest.mark.multiprocess
def test_rebalancing_with_data_parallel_attention(ckpt, oracle):
    """Each rank routes its own sequences' tokens; rank 0's expert load is still the whole batch's (its totals are
    the single process's over the same window of steps), so the policy sees every rank. Each rank's KV cache holds
    64 blocks, its own sequences' only: the pool's ids [64 r, 64 (r + 1)) are rank r's (core/rank_pools.py)."""
    llm, tokens, rows = serve(ckpt, oracle, data_parallel_size=2)
    try:
        assert tokens == oracle[0]
        check_moved(llm, oracle)
        assert llm.engine.model.kv_blocks == 64 and llm.engine.pool.num_blocks == 128
        assert {slot % 2 for slot, _ in rows} == {0, 1}  # both ranks served sequences
        for slot, table in rows:
            assert table and all(b // 64 == slot % 2 for b in table), (slot, table)
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_rebalancing_over_nccl(ckpt):
    """The same over NCCL on 2 GPUs (float32, eager): the one-GPU engine's tokens, the weights moved bitwise."""
    kw = dict(device="cuda", dtype="float32", enforce_eager=True)
    want = make_oracle(ckpt, **kw)
    llm, tokens, _ = serve(ckpt, want, tensor_parallel_size=2, **kw)
    try:
        assert tokens == want[0]
        check_moved(llm, want)
    finally:
        llm.shutdown()


# ------------------------------------------------------------------------------------------ in one process


@st.composite
def placements(draw):
    """(old, new, ranks): two phy2log lists of one layer, each giving every expert a slot."""
    R = draw(st.integers(1, 4))
    E = R * draw(st.integers(1, 4))
    P = E + R * draw(st.integers(0, 2))

    def one():
        extra = [draw(st.integers(0, E - 1)) for _ in range(P - E)]
        return draw(st.permutations(list(range(E)) + extra))

    return list(one()), list(one()), R


@given(placements())
@settings(max_examples=60, deadline=None)
def test_move_plan_fills_every_changed_slot_from_a_holder(case):
    old, new, R = case
    S = len(old) // R
    plan = move_plan(old, new, R)
    assert [d for d, _ in plan] == [p for p in range(len(old)) if old[p] != new[p]]
    after = list(old)
    for d, s in plan:
        assert old[s] == new[d]  # the source holds the expert before any write
        if any(old[q] == new[d] for q in range((d // S) * S, (d // S + 1) * S)):
            assert s // S == d // S  # a copy on the destination's own rank is used: nothing crosses ranks
        after[d] = old[s]
    assert after == new


def test_initial_placement_keeps_each_rank_on_its_loaded_experts():
    assert rank_initial_placement(8, 10, 2) == [0, 1, 2, 3, 0, 4, 5, 6, 7, 4]
    assert rank_initial_placement(4, 4, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"8 experts and 9 physical slots .* must both divide over the ranks"):
        rank_initial_placement(8, 9, 2)
