"""Tests of the reference MoE kernels: routing against a slow per-token oracle and transformers' own
routers, and the routed experts against the dense oracle (and transformers' expert modules)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepinfer.backends.reference.moe import expert_counts, experts_dense, experts_routed, route

FAST = settings(max_examples=80, deadline=None)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- routing


def slow_route(logits, top_k, scoring, renormalize, scaling, n_group, topk_group, group_score, bias):
    """Per-token oracle with Python sorting. Scores come from torch so that selection is compared bit-exactly."""
    T, E = logits.shape
    fn = {"softmax": lambda r: torch.softmax(r, -1), "sigmoid": torch.sigmoid,
          "sqrt_softplus": lambda r: torch.nn.functional.softplus(r).sqrt()}[scoring]
    W, I = [], []
    for t in range(T):
        s = fn(logits[t].float()).tolist()
        c = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        cand = list(range(E))
        if n_group is not None:
            G = E // n_group
            gscore = []
            for g in range(n_group):
                members = sorted((c[e] for e in range(g * G, (g + 1) * G)), reverse=True)
                gscore.append(members[0] if group_score == "max" else members[0] + members[1])
            kept = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
            cand = [e for e in cand if e // G in kept]
        ids = sorted(cand, key=lambda e: -c[e])[:top_k]
        w = [s[e] for e in ids]
        if renormalize:
            den = sum(w) + (1e-20 if scoring != "softmax" else 0.0)
            w = [v / den for v in w]
        W.append([v * scaling for v in w])
        I.append(ids)
    return torch.tensor(W, dtype=torch.float32).reshape(T, top_k), torch.tensor(I, dtype=torch.int64).reshape(T, top_k)


@st.composite
def route_cases(draw):
    grouped = draw(st.booleans())
    scoring = draw(st.sampled_from(["softmax", "sigmoid", "sqrt_softplus"]))
    if grouped:
        n_group = draw(st.integers(1, 4))
        gsize = draw(st.integers(1, 5))
        E = n_group * gsize
        group_score = draw(st.sampled_from(["max", "top2sum"] if gsize >= 2 else ["max"]))
        topk_group = draw(st.integers(1, n_group))
        top_k = draw(st.integers(1, topk_group * gsize))
    else:
        n_group = topk_group = None
        group_score = "max"
        E = draw(st.integers(1, 12))
        top_k = draw(st.integers(1, E))
    return dict(
        T=draw(st.integers(0, 6)), E=E, top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
        group_score=group_score, renormalize=draw(st.booleans()), scaling=draw(st.sampled_from([1.0, 2.5])),
        use_bias=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
    )


@FAST
@given(route_cases())
def test_route_matches_slow_oracle(case):
    g = gen(case["seed"])
    logits = torch.randn(case["T"], case["E"], generator=g) * 2
    bias = torch.randn(case["E"], generator=g) * 0.3 if case["use_bias"] else None
    kw = dict(scoring=case["scoring"], renormalize=case["renormalize"], scaling=case["scaling"],
              n_group=case["n_group"], topk_group=case["topk_group"], group_score=case["group_score"], bias=bias)
    w, ids = route(logits, case["top_k"], **kw)
    w_ref, ids_ref = slow_route(logits, case["top_k"], case["scoring"], case["renormalize"], case["scaling"],
                                case["n_group"], case["topk_group"], case["group_score"], bias)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert w.shape == ids.shape == (case["T"], case["top_k"])
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrt_softplus"])
def test_scoring_formulas(scoring):
    logits = torch.randn(5, 6, generator=gen(1), dtype=torch.float64) * 3
    w, ids = route(logits, 6, scoring=scoring, renormalize=False)
    if scoring == "softmax":
        ref = logits.exp() / logits.exp().sum(-1, keepdim=True)
    elif scoring == "sigmoid":
        ref = 1 / (1 + (-logits).exp())
    else:
        ref = torch.log1p(logits.exp()).sqrt()
    torch.testing.assert_close(w.double(), ref.gather(1, ids), atol=1e-6, rtol=1e-5)
    # ids come sorted by descending score
    assert torch.all(w[:, :-1] >= w[:, 1:])


def test_route_low_precision_logits_computed_in_float32():
    logits = torch.randn(7, 8, generator=gen(2)).bfloat16()
    w, ids = route(logits, 3, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2sum")
    w_ref, ids_ref = route(logits.float(), 3, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2sum")
    assert w.dtype == torch.float32
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


@FAST
@given(st.integers(1, 6), st.sampled_from(["softmax", "sigmoid", "sqrt_softplus"]), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_bias_moves_selection_not_weights(T, scoring, renormalize, seed):
    g = gen(seed)
    E, k = 8, 2
    logits = torch.randn(T, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.5
    bias[5] = 100.0  # forces expert 5 into every token's selection
    w, ids = route(logits, k, scoring=scoring, renormalize=renormalize, bias=bias)
    assert torch.all(ids[:, 0] == 5)
    # weights are the unbiased scores of whatever was selected
    scores = {"softmax": torch.softmax(logits, -1), "sigmoid": torch.sigmoid(logits),
              "sqrt_softplus": torch.nn.functional.softplus(logits).sqrt()}[scoring]
    ref = scores.gather(1, ids)
    if renormalize:
        ref = ref / (ref.sum(-1, keepdim=True) + (1e-20 if scoring != "softmax" else 0.0))
    torch.testing.assert_close(w, ref, atol=1e-7, rtol=1e-6)


def test_grouping_restricts_to_kept_groups():
    # group 0 holds the best single expert, group 1 the best pair: "max" keeps 0, "top2sum" keeps 1
    logits = torch.tensor([[5.0, -5.0, 3.0, 3.0]])
    _, ids_max = route(logits, 2, scoring="sigmoid", n_group=2, topk_group=1, group_score="max")
    _, ids_sum = route(logits, 2, scoring="sigmoid", n_group=2, topk_group=1, group_score="top2sum")
    assert sorted(ids_max[0].tolist()) == [0, 1]
    assert sorted(ids_sum[0].tolist()) == [2, 3]
    _, ids_free = route(logits, 2, scoring="sigmoid")
    assert sorted(ids_free[0].tolist()) == [0, 2] or sorted(ids_free[0].tolist()) == [0, 3]


# ------------------------------------------------------- transformers parity


def _by_id(w, ids):
    """Rows reordered by expert id: HF's DeepSeek routers use topk(sorted=False)."""
    ids_s, perm = ids.sort(dim=-1)
    return w.gather(1, perm), ids_s


def _router(cls, config, T=11, seed=0):
    torch.manual_seed(seed)
    r = cls(config).eval()
    with torch.no_grad():
        r.weight.copy_(torch.randn_like(r.weight))
    x = torch.randn(T, config.hidden_size, generator=gen(seed + 1))
    with torch.no_grad():
        logits, w, ids = r(x)
    return r, logits, w, ids


def test_route_matches_hf_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = MixtralConfig(hidden_size=16, num_attention_heads=4, num_local_experts=8, num_experts_per_tok=2)
    _, logits, w_hf, ids_hf = _router(MixtralTopKRouter, cfg)
    w, ids = route(logits, 2, scoring="softmax", renormalize=True)
    assert torch.equal(ids, ids_hf)
    torch.testing.assert_close(w, w_hf, atol=0, rtol=0)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_route_matches_hf_qwen_moe(family, norm):
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig as Cfg
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter as Router
    else:
        from transformers import Qwen3MoeConfig as Cfg
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router
    cfg = Cfg(hidden_size=16, num_attention_heads=4, num_experts=12, num_experts_per_tok=4, norm_topk_prob=norm)
    _, logits, w_hf, ids_hf = _router(Router, cfg)
    w, ids = route(logits, 4, scoring="softmax", renormalize=norm)
    assert torch.equal(ids, ids_hf)
    torch.testing.assert_close(w, w_hf, atol=0, rtol=0)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_route_matches_hf_deepseek_v3(norm, seed):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                           n_group=4, topk_group=2, norm_topk_prob=norm, routed_scaling_factor=2.5)
    torch.manual_seed(seed)
    r = DeepseekV3TopkRouter(cfg).eval()
    with torch.no_grad():
        r.weight.copy_(torch.randn_like(r.weight))
        r.e_score_correction_bias.copy_(torch.randn(16, generator=gen(seed)) * 0.5)
        logits, w_hf, ids_hf = r(torch.randn(13, 16, generator=gen(seed + 7)))
    w, ids = route(logits, 4, scoring="sigmoid", renormalize=norm, scaling=2.5, n_group=4, topk_group=2,
                   group_score="top2sum", bias=r.e_score_correction_bias)
    w, ids = _by_id(w, ids)
    w_hf, ids_hf = _by_id(w_hf, ids_hf)
    assert torch.equal(ids, ids_hf)
    torch.testing.assert_close(w, w_hf, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_route_matches_hf_deepseek_v2(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    grouped = method == "group_limited_greedy"
    cfg = DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=3,
                           topk_method=method, n_group=4 if grouped else None, topk_group=2 if grouped else None,
                           routed_scaling_factor=16.0)
    _, logits, w_hf, ids_hf = _router(DeepseekV2TopkRouter, cfg)
    kw = dict(n_group=4, topk_group=2, group_score="max") if grouped else {}
    w, ids = route(logits, 3, scoring="softmax", renormalize=False, scaling=16.0, **kw)
    w, ids = _by_id(w, ids)
    w_hf, ids_hf = _by_id(w_hf, ids_hf)
    assert torch.equal(ids, ids_hf)
    torch.testing.assert_close(w, w_hf, atol=1e-7, rtol=1e-6)


def test_route_matches_hf_deepseek_v4():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    cfg = DeepseekV4Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                           routed_scaling_factor=1.5)
    r = DeepseekV4TopKRouter(cfg).eval()
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=gen(3)))
        r.e_score_correction_bias.copy_(torch.randn(16, generator=gen(4)) * 0.5)
        logits, w_hf, ids_hf = r(torch.randn(9, 16, generator=gen(5)))
    w, ids = route(logits, 4, scoring="sqrt_softplus", scaling=1.5, bias=r.e_score_correction_bias)
    w, ids = _by_id(w, ids)
    w_hf, ids_hf = _by_id(w_hf, ids_hf)
    assert torch.equal(ids, ids_hf)
    torch.testing.assert_close(w, w_hf, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v4"])
def test_experts_match_hf(family):
    if family == "mixtral":
        from transformers import MixtralConfig as Cfg
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts
        cfg = Cfg(hidden_size=16, num_attention_heads=4, intermediate_size=8, num_local_experts=6,
                  num_experts_per_tok=2)
        clamp = None
    else:
        from transformers import DeepseekV4Config as Cfg
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts as Experts
        cfg = Cfg(hidden_size=16, num_attention_heads=4, moe_intermediate_size=8, n_routed_experts=6,
                  num_experts_per_tok=2, swiglu_limit=0.5)
        clamp = 0.5
    m = Experts(cfg).eval()
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=gen(0)))
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=gen(1)) / 3)
    x = torch.randn(10, 16, generator=gen(2))
    w, ids = route(torch.randn(10, 6, generator=gen(3)), 2)
    with torch.no_grad():
        y_hf = m(x, ids, w)
    for fn in (experts_dense, experts_routed):
        torch.testing.assert_close(fn(x, m.gate_up_proj, m.down_proj, w, ids, clamp=clamp), y_hf,
                                   atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- experts


def _experts_case(T, E, k, Fd, d, seed, dtype, replace):
    g = gen(seed)
    x = torch.randn(T, d, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * Fd, d, generator=g) / math.sqrt(d)).to(dtype)
    w2 = (torch.randn(E, d, Fd, generator=g) / math.sqrt(Fd)).to(dtype)
    if replace:
        ids = torch.randint(0, E, (T, k), generator=g)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    ids = ids.long()
    weights = torch.rand(T, k, generator=g)
    return x, w13, w2, weights, ids


@st.composite
def expert_cases(draw):
    E = draw(st.integers(1, 6))
    return dict(T=draw(st.sampled_from([0, 1]) | st.integers(0, 12)), E=E, k=draw(st.integers(1, E)),
                Fd=draw(st.integers(1, 8)), d=draw(st.integers(1, 8)), seed=draw(st.integers(0, 2**31 - 1)),
                clamp=draw(st.none() | st.sampled_from([0.3, 1.0, 7.0])), replace=draw(st.booleans()))


@FAST
@given(expert_cases())
def test_routed_matches_dense_float32(c):
    x, w13, w2, w, ids = _experts_case(c["T"], c["E"], c["k"], c["Fd"], c["d"], c["seed"], torch.float32, c["replace"])
    out = experts_routed(x, w13, w2, w, ids, clamp=c["clamp"])
    ref = experts_dense(x, w13, w2, w, ids, clamp=c["clamp"])
    assert out.shape == (c["T"], c["d"]) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@FAST
@given(expert_cases())
def test_routed_matches_dense_bfloat16(c):
    x, w13, w2, w, ids = _experts_case(c["T"], c["E"], c["k"], c["Fd"], c["d"], c["seed"], torch.bfloat16,
                                       c["replace"])
    out = experts_routed(x, w13, w2, w, ids, clamp=c["clamp"])
    ref = experts_dense(x, w13, w2, w, ids, clamp=c["clamp"])
    assert out.dtype == torch.bfloat16
    # routed rounds the SwiGLU output and matmul results to bf16; dense stays in float32
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_dense_oracle_by_hand():
    x, w13, w2, w, ids = _experts_case(4, 5, 2, 3, 6, 0, torch.float64, False)
    ref = torch.zeros(4, 6, dtype=torch.float64)
    for t in range(4):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            gate, up = gate.clamp(max=0.5), up.clamp(-0.5, 0.5)
            ref[t] += float(w[t, j]) * (w2[e] @ (gate * torch.sigmoid(gate) * up))
    torch.testing.assert_close(experts_dense(x, w13, w2, w, ids, clamp=0.5), ref)
    torch.testing.assert_close(experts_routed(x, w13, w2, w, ids, clamp=0.5), ref)


def test_clamp_changes_result():
    x, w13, w2, w, ids = _experts_case(6, 4, 2, 4, 8, 1, torch.float32, False)
    x = x * 10
    assert not torch.allclose(experts_routed(x, w13, w2, w, ids), experts_routed(x, w13, w2, w, ids, clamp=0.1))


@FAST
@given(st.integers(0, 20), st.integers(1, 8), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_expert_counts(T, E, k, seed):
    ids = torch.randint(0, E, (T, k), generator=gen(seed))
    counts = expert_counts(ids, E)
    assert counts.dtype == torch.int64 and counts.shape == (E,)
    assert int(counts.sum()) == T * k
    ref = Counter(ids.reshape(-1).tolist())
    assert counts.tolist() == [ref[e] for e in range(E)]


# ---------------------------------------------------------------- invalid arguments


@pytest.mark.parametrize("kwargs, arg", [
    (dict(top_k=0), "top_k"),
    (dict(top_k=9), "top_k"),
    (dict(top_k=2, scoring="relu"), "scoring"),
    (dict(top_k=2, group_score="mean", n_group=2, topk_group=1), "group_score"),
    (dict(top_k=2, n_group=3, topk_group=1), "n_group"),
    (dict(top_k=2, n_group=0, topk_group=1), "n_group"),
    (dict(top_k=2, n_group=2, topk_group=3), "topk_group"),
    (dict(top_k=2, n_group=2, topk_group=0), "topk_group"),
    (dict(top_k=2, n_group=2), "topk_group"),
    (dict(top_k=2, topk_group=1), "n_group"),
    (dict(top_k=5, n_group=2, topk_group=1), "top_k"),
    (dict(top_k=2, n_group=8, topk_group=4, group_score="top2sum"), "group_score"),
    (dict(top_k=2, bias=torch.zeros(7)), "bias"),
])
def test_route_invalid(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        route(torch.randn(3, 8), **kwargs)


def test_route_invalid_logits_shape():
    with pytest.raises(ValueError, match="router_logits"):
        route(torch.randn(8), 2)


def _good():
    return _experts_case(3, 4, 2, 5, 6, 0, torch.float32, False)


@pytest.mark.parametrize("fn", [experts_dense, experts_routed])
@pytest.mark.parametrize("patch, arg", [
    (lambda a: {**a, "x": a["x"][0]}, "x"),
    (lambda a: {**a, "w13": a["w13"][:, :-1]}, "w13"),
    (lambda a: {**a, "w13": a["w13"][..., :-1]}, "w13"),
    (lambda a: {**a, "w2": a["w2"][..., :-1]}, "w2"),
    (lambda a: {**a, "ids": a["ids"][:-1]}, "ids"),
    (lambda a: {**a, "ids": a["ids"].float()}, "ids"),
    (lambda a: {**a, "ids": a["ids"] + 4}, "ids"),
    (lambda a: {**a, "ids": a["ids"] - 4}, "ids"),
    (lambda a: {**a, "weights": a["weights"][:, :1]}, "weights"),
    (lambda a: {**a, "clamp": 0.0}, "clamp"),
])
def test_experts_invalid(fn, patch, arg):
    x, w13, w2, w, ids = _good()
    a = patch(dict(x=x, w13=w13, w2=w2, weights=w, ids=ids, clamp=None))
    with pytest.raises(ValueError, match=arg):
        fn(a["x"], a["w13"], a["w2"], a["weights"], a["ids"], clamp=a["clamp"])


def test_expert_counts_invalid():
    with pytest.raises(ValueError, match="num_experts"):
        expert_counts(torch.zeros(2, 2, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="ids"):
        expert_counts(torch.zeros(2, 2), 4)
