"""Expert-parallel load balancing: the policy (parallel/eplb.py) and its use while serving (parallel/placement.py).

* Policy properties on hypothesis-drawn skewed loads: every logical expert has a replica, the replica counts
  fill the physical slots exactly and agree with both maps; under the global policy the heaviest rank is never
  heavier than under the default placement, and on small cases it equals a brute-force optimum (an exhaustive
  enumeration written here, with exact fractions, sharing no code with the policy); the hierarchical policy
  keeps each expert group on one node.
* Serving: a MoEBlock on replicated slots computes what it computed before; every replica gets its share of a
  expert's tokens to within one; rebalancing in the middle of a generation moves weights (each slot then holds
  its logical expert's original weights) and leaves greedy tokens unchanged (tiny Mixtral, Qwen3-MoE,
  DeepSeek-V3, CED); bad configurations fail naming the value.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.models.moe import MoEBlock
from deepinfer.models.quant import FP8, quantize_fp8_block, store_experts_fp8
from deepinfer.parallel import eplb
from deepinfer.parallel.placement import EplbConfig, ExpertPlacement
from deepinfer.testing.ced import REPLAY_CONFIG, build_ced_checkpoint
from deepinfer.testing.models import build_tiny_hf_model

# ------------------------------------------------------------------------------------------ the oracle


def heaviest_rank(load: list, phy2log: list, num_ranks: int) -> Fraction:
    """Exact: the largest over ranks of sum(load[e] / replicas of e) over the rank's slots."""
    replicas = {e: phy2log.count(e) for e in set(phy2log)}
    per_rank = len(phy2log) // num_ranks
    return max(sum((Fraction(load[e], replicas[e]) for e in phy2log[r * per_rank:(r + 1) * per_rank]), Fraction(0))
               for r in range(num_ranks))


def brute_force_optimum(load: list, num_slots: int, num_ranks: int) -> Fraction:
    """Every assignment of experts to slots that gives each expert a slot: the lightest heaviest rank."""
    E = len(load)
    return min(heaviest_rank(load, list(a), num_ranks)
               for a in itertools.product(range(E), repeat=num_slots) if len(set(a)) == E)


# ------------------------------------------------------------------------------------------ strategies


@st.composite
def skewed_loads(draw, num_experts: int) -> list:
    """Integer token counts: a background level plus a few hot experts (a router biased towards them)."""
    base = draw(st.integers(0, 20))
    load = [base + draw(st.integers(0, 5)) for _ in range(num_experts)]
    for e in draw(st.lists(st.integers(0, num_experts - 1), max_size=3)):
        load[e] += draw(st.sampled_from([10, 100, 1000, 5000]))
    return load


@st.composite
def layouts(draw, max_experts: int = 16, max_redundant: int = 8, max_ranks: int = 8, small: bool = False):
    """(load, num_replicas, num_groups, num_nodes, num_ranks); ``small``: brute-force sized, global policy."""
    if small:
        E = draw(st.integers(1, 4))
        ranks = draw(st.integers(1, 3))
        P = draw(st.sampled_from([p for p in range(E, 7) if p % ranks == 0] or [E]))
        if P % ranks:
            ranks = 1
        groups = draw(st.sampled_from([g for g in (1, 2, 4) if E % g == 0]))  # one node: the global policy
        return draw(skewed_loads(E)), P, groups, 1, ranks
    nodes = draw(st.sampled_from([1, 2, 4]))
    ranks = nodes * draw(st.integers(1, max_ranks // nodes))
    groups = draw(st.sampled_from([1, 2, 3, 4, 8]))
    E = groups * draw(st.integers(1, max(1, max_experts // groups)))
    P = E + draw(st.integers(0, max_redundant))
    P += (-P) % ranks
    return draw(skewed_loads(E)), P, groups, nodes, ranks


def _global(groups: int, nodes: int) -> bool:
    return nodes == 1 or groups % nodes != 0


# ------------------------------------------------------------------------------------------ policy properties


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_every_expert_has_a_replica_and_counts_fill_the_slots(case):
    load, P, groups, nodes, ranks = case
    phy2log, log2phy, logcnt = eplb.rebalance_experts(load, P, groups, nodes, ranks)
    E = len(load)
    assert phy2log.shape == (1, P) and logcnt.shape == (1, E) and log2phy.shape[:2] == (1, E)
    assert logcnt.min() >= 1 and int(logcnt.sum()) == P
    for e in range(E):
        slots = [p for p in log2phy[0, e].tolist() if p >= 0]
        assert len(slots) == logcnt[0, e] and all(phy2log[0, p] == e for p in slots)
        assert log2phy[0, e, len(slots):].eq(-1).all()
        assert sorted(slots) == [p for p in range(P) if phy2log[0, p] == e]


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_heaviest_rank_never_heavier_than_the_default_placement(case):
    load, P, groups, nodes, ranks = case
    phy2log, _, _ = eplb.rebalance_experts(load, P, groups, nodes, ranks)
    default = [p % len(load) for p in range(P)]
    if _global(groups, nodes):
        assert heaviest_rank(load, phy2log[0].tolist(), ranks) <= heaviest_rank(load, default, ranks)
    else:  # hierarchical: each group on one node, num_groups / num_nodes groups per node
        per_node, size = P // nodes, len(load) // groups
        node_of = {}
        for p, e in enumerate(phy2log[0].tolist()):
            assert node_of.setdefault(e // size, p // per_node) == p // per_node
        assert sorted(node_of.values()) == sorted(list(range(nodes)) * (groups // nodes))


@settings(max_examples=40, deadline=None)
@given(layouts(small=True))
def test_heaviest_rank_equals_the_brute_force_optimum(case):
    load, P, groups, nodes, ranks = case
    phy2log, _, _ = eplb.rebalance_experts(load, P, groups, nodes, ranks)
    assert eplb.is_exact(load, P, groups, nodes, ranks)
    got = heaviest_rank(load, phy2log[0].tolist(), ranks)
    want = brute_force_optimum(load, P, ranks)
    assert abs(got - want) <= Fraction(1, 10**9) * max(1, sum(load)), (load, P, ranks, got, want)


def test_greedy_replication_alone_is_not_optimal():
    # The case the exact phase exists for: the greedy replicates a heavy expert (heaviest rank 5); giving the
    # light expert the redundant slot halves it on both ranks (4.5).
    assert eplb._max_rank([4, 4, 1], eplb._greedy([4, 4, 1], 4, 2)) == 5
    phy2log, _, logcnt = eplb.rebalance_experts([4, 4, 1], 4, 1, 1, 2)
    assert logcnt[0].tolist() == [1, 1, 2]
    assert heaviest_rank([4, 4, 1], phy2log[0].tolist(), 2) == Fraction(9, 2)


def test_rebalancing_from_the_placement_in_use_keeps_what_need_not_move():
    load = [[100, 1, 1, 1, 1, 1, 1, 1]]
    first, _, _ = eplb.rebalance_experts(load, 12, 1, 1, 4)
    again, _, _ = eplb.rebalance_experts(load, 12, 1, 1, 4, current=first)
    assert torch.equal(first, again)
    ranks = eplb.rank_loads(load, first, 4)
    assert eplb.balancedness(ranks) > eplb.balancedness(eplb.rank_loads(load, eplb.default_placement(1, 8, 12), 4))


@settings(max_examples=30, deadline=None)
@given(layouts(), st.randoms(use_true_random=False))
def test_a_relabelled_placement_in_use_moves_nothing(case, rnd):
    load, P, groups, nodes, ranks = case
    first = eplb.rebalance_experts(load, P, groups, nodes, ranks)[0][0].tolist()
    per_node, per_rank = P // nodes, P // ranks
    blocks = [first[n:n + per_node] for n in range(0, P, per_node)]  # shuffle nodes, ranks within, slots within
    rnd.shuffle(blocks)
    relabelled = []
    for node in blocks:
        rs = [node[r:r + per_rank] for r in range(0, per_node, per_rank)]
        rnd.shuffle(rs)
        for r in rs:
            relabelled += rnd.sample(r, len(r))
    again = eplb.rebalance_experts(load, P, groups, nodes, ranks, current=[relabelled])[0][0].tolist()
    assert again == relabelled


def test_balancedness():
    assert eplb.balancedness(torch.tensor([[2.0, 2.0], [1.0, 3.0]])) == pytest.approx((2 + 2) / (2 + 3))
    assert eplb.balancedness(torch.zeros(2, 4)) == 1.0
    assert eplb.rank_loads([4, 2], [0, 1, 0, 0], 2).tolist() == [[4 / 3 + 2, 8 / 3]]


@pytest.mark.parametrize("args, match", [
    ((8, 12, 1, 1, 5), "num_replicas=12 physical slots do not divide over num_ranks=5"),
    ((8, 6, 1, 1, 2), "num_replicas=6 is fewer than the 8 logical experts"),
    ((8, 8, 1, 3, 4), "num_ranks=4 is not a multiple of num_nodes=3"),
    ((8, 8, 3, 1, 2), "num_groups=3 does not divide the 8 experts"),
    ((8, 8, 1, 0, 2), "num_nodes=0 is invalid"),
])
def test_bad_layouts_name_the_value(args, match):
    E, *rest = args
    with pytest.raises(ValueError, match=match):
        eplb.rebalance_experts([1] * E, *rest)


def test_bad_loads_are_refused():
    with pytest.raises(ValueError, match="finite and >= 0"):
        eplb.rebalance_experts([1, -1], 2, 1, 1, 1)
    with pytest.raises(ValueError, match=r"current placement has shape \(1, 3\)"):
        eplb.rebalance_experts([1, 1], 2, 1, 1, 1, current=[[0, 1, 1]])
    with pytest.raises(ValueError, match="logical expert 1 has no physical slot"):
        eplb.rebalance_experts([1, 1], 2, 1, 1, 1, current=[[0, 0]])


# ------------------------------------------------------------------------------------------ a block on slots


def _block(E=6, k=2, seed=0) -> MoEBlock:
    g = torch.Generator().manual_seed(seed)
    b = MoEBlock(16, 8, E, k, ReferenceOps("cpu"), layer=0)
    for p in b.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    return b.requires_grad_(False)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=6), st.integers(1, 9), st.integers(0, 2**16))
def test_block_on_replicated_slots_computes_the_same(extra, T, seed):
    block = _block(seed=seed % 7)
    x = torch.randn(T, 16, generator=torch.Generator().manual_seed(seed))
    want = block(x)
    phy2log = [int(v) for v in torch.randperm(6 + len(extra), generator=torch.Generator().manual_seed(seed))]
    phy2log = [(list(range(6)) + extra)[i] for i in phy2log]  # each expert once, plus the extra replicas, shuffled
    ExpertPlacement(phy2log, 6, "cpu").attach(block)
    assert block.w13.shape[0] == len(phy2log)
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-6)
    block.impl = "dense"
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)


def test_replicas_share_an_experts_tokens_to_within_one():
    place = ExpertPlacement([0, 1, 0, 2, 0, 1], 3, "cpu")  # expert 0: 3 replicas, expert 1: 2, expert 2: 1
    ids = torch.tensor([[0, 1]] * 7 + [[2, 0]] * 4)  # [11, 2]: expert 0 chosen 11 times, 1 seven, 2 four
    slots = place.physical_ids(ids)
    assert torch.equal(torch.tensor([0, 1, 0, 2, 0, 1])[slots], ids)  # each choice lands on its expert's copy
    per_slot = torch.bincount(slots.reshape(-1), minlength=6).tolist()
    assert sorted(per_slot[p] for p in (0, 2, 4)) == [3, 4, 4] and sorted(per_slot[p] for p in (1, 5)) == [3, 4]
    assert per_slot[3] == 4


def test_moved_slots_hold_their_experts_weights():
    block = _block()
    logical = block.w13.detach().clone(), block.w2.detach().clone()
    place = ExpertPlacement([0, 1, 2, 3, 4, 5, 0, 1], 6, "cpu")
    place.attach(block)
    new = [5, 5, 4, 3, 2, 1, 0, 5]
    assert place.move(block, new) == 6  # slots 3 and 6 keep their experts
    for p, e in enumerate(new):
        assert torch.equal(block.w13[p], logical[0][e]) and torch.equal(block.w2[p], logical[1][e])
    assert torch.equal(block.checkpoint_tensors()["experts.0.down_proj.weight"], logical[1][0])


def test_fp8_experts_move_with_their_block_scales():
    block = MoEBlock(16, 128, 4, 2, ReferenceOps("cpu"), layer=0)  # an expert width of 128: servable as FP8
    g = torch.Generator().manual_seed(3)
    for p in block.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    assert store_experts_fp8(block, (128, 128)) == [""]
    for name in ("w13", "w2"):
        w, scale = getattr(block, name), getattr(block, name + "_scale_inv")
        for e in range(4):  # per-expert scales that differ: a slot moved without its scale would be wrong
            q, s = quantize_fp8_block(torch.randn(w.shape[1:], generator=g) * (e + 1))
            w.data[e], scale.data[e] = q, s
    block.requires_grad_(False)
    x = torch.randn(9, 16, generator=g)
    want = block(x)
    place = ExpertPlacement([0, 1, 2, 3, 3, 0], 4, "cpu")
    place.attach(block)
    assert block.w13.dtype == FP8 and block.w2_scale_inv.shape[0] == 6
    place.move(block, [3, 2, 1, 0, 3, 3])
    torch.testing.assert_close(block(x), want, rtol=1e-4, atol=1e-4)  # other matmul sizes: rounding only


# ------------------------------------------------------------------------------------------ serving

ARCHS = ["mixtral", "qwen3-moe", "deepseek_v3"]
PROMPTS = [[7, 11, 13, 17, 19], [23, 29, 31, 37, 41, 43, 47, 53], [59, 61]]


_CKPTS: dict = {}


def _ckpt(name: str, factory) -> tuple:
    if name not in _CKPTS:
        path = factory.mktemp(name)
        build_tiny_hf_model(path, name, init_range=0.3)
        _CKPTS[name] = name, str(path)
    return _CKPTS[name]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    return _ckpt(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _ckpt("mixtral", tmp_path_factory)


def _greedy(path: str, **kw):
    llm = LLM(model=path, num_kv_blocks=64, max_model_len=128, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_rebalancing_mid_generation_keeps_greedy_tokens(tiny):
    name, path = tiny
    _, want = _greedy(path)
    nodes = 2 if name == "deepseek_v3" else 1  # DeepSeek-V3's 4 router groups on 2 nodes: the hierarchical policy
    llm, got = _greedy(path, enable_eplb=True, eplb_config={"window_size": 4, "step_interval": 3,
                                                            "num_redundant_experts": 4, "num_ranks": 4,
                                                            "num_nodes": nodes})
    stats = llm.eplb_stats()
    assert stats["rebalances"] >= 3 and stats["num_physical_experts"] == 12
    load = llm.expert_load()  # still per logical expert, over EPLB's window
    assert load["window"] == 4 and all(len(counts) == 8 for counts in load["layers"].values())
    assert sum(r["moved_slots"] for r in stats["history"]) > 0  # weights did move while generating
    if nodes == 1:  # the global policy never makes the placement in use worse on the window it rebalances from
        assert all(r["after"] >= r["before"] - 1e-12 for r in stats["history"])
    assert got == want


@pytest.fixture(scope="module")
def ced(tmp_path_factory):
    path = tmp_path_factory.mktemp("eplb_ced") / "ced"
    build_ced_checkpoint(path, seed=3, **{**REPLAY_CONFIG, "n_routed_experts": 8})
    return str(path)


def test_ced_rebalancing_mid_generation_keeps_greedy_tokens(ced):
    """CED's layers route through the same placement: replicas' slots, load per logical expert, moves."""
    plain, want = _greedy(ced, dtype="float32")
    llm, got = _greedy(ced, dtype="float32", enable_eplb=True,
                       eplb_config={"window_size": 4, "step_interval": 3, "num_redundant_experts": 4, "num_ranks": 4})
    stats = llm.eplb_stats()
    assert stats["rebalances"] >= 3 and stats["num_physical_experts"] == 12
    assert sum(r["moved_slots"] for r in stats["history"]) > 0
    assert all(r["after"] >= r["before"] - 1e-12 for r in stats["history"])
    assert all(len(counts) == 8 for counts in llm.expert_load()["layers"].values())  # per logical expert
    for layer, ref in zip(llm.engine.model.layers, plain.engine.model.layers):
        phy2log = layer.placement.phy2log_host
        assert layer.w13.shape[0] == 12 and phy2log != list(range(8)) + list(range(4))
        assert torch.equal(layer.w13, ref.w13[phy2log]) and torch.equal(layer.w2, ref.w2[phy2log])
    assert torch.equal(llm.engine.model.hf_state_dict()["layers.0.w13"], plain.engine.model.layers[0].w13)
    assert got == want


def test_eplb_on_a_model_without_experts(tmp_path):
    build_tiny_hf_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="enable_eplb needs a mixture-of-experts model"):
        LLM(model=str(tmp_path), num_kv_blocks=8, enable_eplb=True)


@pytest.mark.parametrize("cfg, match", [
    ({"num_redundant_experts": -1}, r"eplb_config\['num_redundant_experts'\]=-1 is invalid"),
    ({"window_size": 0}, r"eplb_config\['window_size'\]=0 is invalid"),
    ({"step_interval": 1.5}, r"eplb_config\['step_interval'\]=1.5 is invalid"),
    ({"num_ranks": 4, "num_nodes": 3}, r"num_ranks'\]=4 is not a multiple of eplb_config\['num_nodes'\]=3"),
    ({"window": 3}, r"unknown key\(s\) \['window'\]"),
])
def test_bad_eplb_config_names_the_value(cfg, match):
    with pytest.raises(ValueError, match=match):
        EplbConfig.from_dict(cfg)


def test_bad_layout_for_the_model_names_the_value(mixtral):
    _, path = mixtral
    with pytest.raises(ValueError, match="num_replicas=9 physical slots do not divide over num_ranks=2"):
        LLM(model=path, num_kv_blocks=8, enable_eplb=True, eplb_config={"num_redundant_experts": 1, "num_ranks": 2})
    with pytest.raises(ValueError, match=r"eplb_config\['num_ranks'\]=0 is invalid"):
        LLM(model=path, num_kv_blocks=8, eplb_config={"num_ranks": 0})  # checked even while EPLB is off


def test_eplb_from_a_recipe_file(mixtral, tmp_path):
    recipe = tmp_path / "eplb.toml"
    recipe.write_text(Path(__file__).parents[1].joinpath("recipes", "default.toml").read_text()
                      + "\n[engine]\nenable_eplb = true\n[engine.eplb_config]\nnum_redundant_experts = 4\n"
                        "num_ranks = 4\nstep_interval = 2\n")
    llm = LLM(model=mixtral[1], recipe=str(recipe), num_kv_blocks=16)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    stats = llm.eplb_stats()
    assert stats["num_physical_experts"] == 12 and stats["num_ranks"] == 4 and stats["rebalances"] >= 1
