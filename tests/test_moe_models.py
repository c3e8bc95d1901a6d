"""The MoE members of the Llama family (Mixtral, Qwen2-MoE, Qwen3-MoE) and their MoEBlock.

* Parity with transformers on tiny random checkpoints (float32): prefill logits of both paths, greedy
  tokens for one prompt and a batch of four, with chunked prefill.
* Dense vs routed experts: the same function at the block level (hypothesis) and the same greedy tokens
  at the engine level.
* Expert load: counts per MoE layer add up to the tokens the engine pushed through the model times top_k,
  over the window; per-expert counts equal the routing of a full-sequence pass; JSONL dump.
* Checkpoints: per-expert and fused (transformers 5) layouts, round trip, FP8 block-quantized experts
  (dequantized at load; KL to the original reported), malformed checkpoints named in the error.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.models.base import WeightError
from deepinfer.models.expert_load import ExpertLoad
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.loader import CheckpointError, iter_weights
from deepinfer.models.moe import MoEBlock
from deepinfer.models.quant import FP8, dequantize_fp8_block, quantize_fp8_block
from deepinfer.testing.compare import MODEL_FACTOR, assert_greedy_matches, assert_logits_close, hf_greedy
from deepinfer.testing.engine import paged_prefill_logits as _paged_prefill_logits
from deepinfer.testing.models import TINY, build_tiny_hf_model

ARCHS = ["mixtral", "qwen2-moe", "qwen3-moe"]
NEW_TOKENS = 32
PROMPT_LENS = [13, 2, 27, 40]  # the batch of 4; mixtral's window (24) is shorter than the long ones
INIT_RANGE = 0.3  # peaked next-token distributions (mean top-1 probability about 0.2-0.3, vocab 512)
# One MoE block (router, top-k, experts, shared expert) against transformers' or the dense oracle, float32: the worst
# seen is 5 eps of the row's largest |output|; 32 leaves 6x (MODEL_FACTOR is for whole models).
BLOCK_FACTOR = 32
OPS = ReferenceOps("cpu")


class Tiny:
    def __init__(self, name, path, hf):
        self.name, self.path, self.hf = name, str(path), hf
        g = torch.Generator().manual_seed(4321)
        self.prompts = [torch.randint(5, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
        with torch.no_grad():
            self.hf_logits = [hf(torch.tensor([p])).logits[0].float() for p in self.prompts]
        self.hf_greedy, self.hf_scores = map(list, zip(*(hf_greedy(hf, p, NEW_TOKENS) for p in self.prompts)))


_CACHE: dict = {}


def tiny_ckpt(name: str, factory) -> Tiny:
    if name not in _CACHE:
        path = factory.mktemp(name)
        hf = build_tiny_hf_model(path, name, init_range=INIT_RANGE, random_norms_and_biases=True)
        hf.generation_config.eos_token_id = None  # we use ignore_eos; HF must not stop either
        _CACHE[name] = Tiny(name, path, hf)
    return _CACHE[name]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> Tiny:
    return tiny_ckpt(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Tiny:
    return tiny_ckpt("mixtral", tmp_path_factory)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def run(llm: LLM, prompts: list, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        assert o.error is None and o.finished and o.outputs[0].finish_reason == "length"
    return [o.outputs[0].token_ids for o in outs]


def paged_prefill_logits(net, prompts: list, block_size: int, chunk: int) -> list:
    """All prompts in one batch through the engine forward (scattered blocks seeded by chunk)."""
    return _paged_prefill_logits(net, prompts, block_size, chunk, seed=chunk, spare_blocks=0)


def moe_blocks(net) -> list:
    return [m for m in net.modules() if isinstance(m, MoEBlock)]


# ------------------------------------------------------------------------------------------ parity with HF


def test_sparse_layers_match_hf(tiny):
    """Which layers are MoE (decoder_sparse_step, mlp_only_layers) and their shapes, as transformers builds them."""
    net = LLM(tiny.path, num_kv_blocks=32, block_size=4).engine.model
    hf_sparse = [i for i, layer in enumerate(tiny.hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert net.moe_layers == hf_sparse == [b.layer for b in moe_blocks(net)]
    assert 0 < len(hf_sparse) <= len(tiny.hf.model.layers)
    if tiny.name != "mixtral":
        assert len(hf_sparse) < len(tiny.hf.model.layers)  # a dense layer too
    spec = TINY[tiny.name]
    for b in moe_blocks(net):
        assert b.num_experts == spec.get("num_experts", spec.get("num_local_experts"))
        assert b.top_k == spec["num_experts_per_tok"]
        assert (b.shared_size > 0) == (tiny.name == "qwen2-moe") == b.has_shared_gate
    assert net.expert_load.layers == hf_sparse


def test_forward_full_matches_hf(tiny):
    net = LLM(tiny.path, num_kv_blocks=32, block_size=4).engine.model
    for p, ref in zip(tiny.prompts, tiny.hf_logits):
        with torch.no_grad():
            ours = net.forward_full(torch.tensor(p))
        assert_logits_close(ours, ref, factor=MODEL_FACTOR, what=f"{tiny.name}, prompt of {len(p)}")


@pytest.mark.parametrize("block_size,chunk", [(4, 64), (3, 7)])
def test_engine_prefill_matches_hf(tiny, block_size, chunk):
    net = LLM(tiny.path, num_kv_blocks=32, block_size=4).engine.model
    for p, got, ref in zip(tiny.prompts, paged_prefill_logits(net, tiny.prompts, block_size, chunk), tiny.hf_logits):
        assert_logits_close(got, ref, factor=MODEL_FACTOR, what=f"{tiny.name}, prompt of {len(p)}")


def test_greedy_single_prompt(tiny):
    llm = LLM(tiny.path, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    assert_greedy_matches(run(llm, [tiny.prompts[3]], greedy()), [tiny.hf_greedy[3]], [tiny.hf_scores[3]])


@pytest.mark.parametrize("setting", [dict(num_kv_blocks=128, block_size=16),
                                     dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=7)],
                         ids=["default", "chunked"])
def test_greedy_batch(tiny, setting):
    llm = LLM(tiny.path, **setting)
    got = run(llm, tiny.prompts, greedy())
    assert_greedy_matches(got, tiny.hf_greedy, tiny.hf_scores, what=tiny.name)


def test_dense_experts_give_the_same_greedy_tokens(tiny):
    """Every MoE block on the dense oracle (via the config key moe_impl) reproduces the routed engine."""
    llm = LLM(tiny.path, num_kv_blocks=128, block_size=4, max_num_batched_tokens=7, hf_overrides={"moe_impl": "dense"})
    blocks = moe_blocks(llm.engine.model)
    assert blocks and all(b.impl == "dense" for b in blocks)
    assert_greedy_matches(run(llm, tiny.prompts, greedy()), tiny.hf_greedy, tiny.hf_scores, what="dense")
    llm.engine.model.set_moe_impl("routed")
    assert all(b.impl == "routed" for b in blocks)
    assert_greedy_matches(run(llm, tiny.prompts[:2], greedy()), tiny.hf_greedy[:2], tiny.hf_scores[:2], what="routed")
    with pytest.raises(ValueError, match="impl"):
        llm.engine.model.set_moe_impl("grouped")


# ----------------------------------------------------------------------------- the block against transformers


def _hf_block(name: str, seed: int):
    import transformers

    spec = dict(TINY[name])
    arch = spec.pop("arch")
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(vocab_size=300, **spec)
    mod = {"mixtral": "mixtral", "qwen2-moe": "qwen2_moe", "qwen3-moe": "qwen3_moe"}[name]
    cls = {"mixtral": "MixtralSparseMoeBlock", "qwen2-moe": "Qwen2MoeSparseMoeBlock",
           "qwen3-moe": "Qwen3MoeSparseMoeBlock"}[name]
    block = getattr(getattr(transformers.models, mod), f"modeling_{mod}").__dict__[cls](cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block.eval(), cfg


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("impl", ["routed", "dense"])
def test_block_matches_hf_block_fused_layout(name, impl):
    """Weights handed over in transformers 5's in-memory (fused) names; same output as HF's sparse block."""
    hf, cfg = _hf_block(name, seed=7)
    naming = "mixtral" if name == "mixtral" else "qwen"
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) if name == "qwen2-moe" else 0
    ours = MoEBlock(cfg.hidden_size, cfg.intermediate_size if name == "mixtral" else cfg.moe_intermediate_size,
                    cfg.num_experts, cfg.num_experts_per_tok, OPS, layer=0, naming=naming,
                    renormalize=name == "mixtral" or cfg.norm_topk_prob, shared_size=shared, shared_gate=shared > 0,
                    impl=impl)
    fused_names = set()
    for n, p in hf.named_parameters():
        ours.load_checkpoint_tensor(n, p.detach(), full_name=f"blk.{n}")
        fused_names.add(n)
    assert "experts.gate_up_proj" in fused_names and "experts.down_proj" in fused_names
    assert ours.missing_checkpoint_tensors() == []
    x = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x).reshape(18, -1)
        got = ours(x.reshape(18, -1))
    assert_logits_close(got, ref, factor=BLOCK_FACTOR, what=f"{name} {impl}")


# ------------------------------------------------------------------------------- dense vs routed (property)


@st.composite
def block_cases(draw):
    grouped = draw(st.booleans())
    if grouped:
        n_group = draw(st.integers(1, 4))
        gsize = draw(st.integers(2, 4))
        E, topk_group = n_group * gsize, draw(st.integers(1, n_group))
        top_k = draw(st.integers(1, topk_group * gsize))
        group_score = draw(st.sampled_from(["max", "top2sum"]))
    else:
        n_group = topk_group = None
        E = draw(st.integers(1, 12))
        top_k, group_score = draw(st.integers(1, E)), "max"
    shared = draw(st.sampled_from([0, 0, 8]))
    return dict(T=draw(st.integers(0, 24)), E=E, top_k=top_k, n_group=n_group, topk_group=topk_group,
                group_score=group_score, scoring=draw(st.sampled_from(["softmax", "sigmoid", "sqrt_softplus"])),
                renormalize=draw(st.booleans()), scaling=draw(st.sampled_from([1.0, 2.5])),
                correction_bias=draw(st.booleans()), shared_size=shared,
                shared_gate=shared > 0 and draw(st.booleans()), clamp=draw(st.sampled_from([None, 0.5])),
                d=draw(st.sampled_from([8, 16])), F=draw(st.sampled_from([4, 12])),
                seed=draw(st.integers(0, 2**31 - 1)))


def _random_block(c: dict, impl: str, expert_load=None) -> MoEBlock:
    kw = {k: c[k] for k in ("scoring", "renormalize", "scaling", "n_group", "topk_group", "group_score",
                            "correction_bias", "shared_size", "shared_gate", "clamp")}
    b = MoEBlock(c["d"], c["F"], c["E"], c["top_k"], OPS, layer=3, naming="deepseek", impl=impl,
                 expert_load=expert_load, **kw)
    g = torch.Generator().manual_seed(c["seed"])
    with torch.no_grad():
        for p in b.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return b


@settings(max_examples=60, deadline=None)
@given(block_cases())
def test_block_dense_matches_routed(c):
    routed = _random_block(c, "routed", ExpertLoad([3], c["E"], window=2))
    dense = _random_block(c, "dense")
    x = torch.randn(c["T"], c["d"], generator=torch.Generator().manual_seed(c["seed"] + 1))
    with torch.no_grad():
        a, b = routed(x), dense(x)
    assert a.shape == b.shape == (c["T"], c["d"])
    assert_logits_close(a, b, factor=BLOCK_FACTOR)
    # the block recorded each token's top_k choices
    routed.expert_load.end_step()
    assert routed.expert_load.totals().sum().item() == c["T"] * c["top_k"]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 6), st.integers(0, 5), st.lists(st.integers(1, 9), min_size=1, max_size=6),
       st.integers(2, 12), st.booleans(), st.integers(0, 2**31 - 1))
def test_batched_expert_load_counts_as_per_call_records(n_layers, first, token_counts, E, nested, seed):
    """ExpertLoad.batched counts what the same records count one at a time (per-expert counts built here with
    bincount): consecutive rows of one token count (the one-scatter path), other orders and ragged counts (the
    fallback), and a nested hold."""
    layers = list(range(10, 10 + first + n_layers + 2))
    g = torch.Generator().manual_seed(seed)
    order = list(range(first, first + n_layers))
    if len(token_counts) > 1:  # ragged token counts, and a shuffled layer order: the fallback
        order = [order[i] for i in torch.randperm(n_layers, generator=g).tolist()]
    calls = [(layers[r], torch.randint(0, E, (token_counts[i % len(token_counts)], 3), generator=g))
             for i, r in enumerate(order)]
    held = ExpertLoad(layers, E, window=1)
    with held.batched():
        with held.batched() if nested else torch.no_grad():
            for layer, ids in calls:
                held.record(layer, ids)
        assert held.current is None or held.current.sum() == 0  # nothing counted before the hold ends
    expected = torch.zeros(len(layers), E, dtype=torch.long)
    for layer, ids in calls:
        expected[layers.index(layer)] += torch.bincount(ids.reshape(-1), minlength=E)
    assert torch.equal(held.current, expected)
    held.record(layers[0], calls[0][1])  # after the hold: counted at once again
    expected[0] += torch.bincount(calls[0][1].reshape(-1), minlength=E)
    assert torch.equal(held.current, expected)


def test_block_output_depends_on_routing():
    """Not a vacuous match: a different top_k (another routing) changes the output."""
    c = dict(T=6, E=8, top_k=2, n_group=None, topk_group=None, group_score="max", scoring="softmax",
             renormalize=True, scaling=1.0, correction_bias=False, shared_size=0, shared_gate=False, clamp=None,
             d=16, F=12, seed=3)
    x = torch.randn(6, 16)
    with torch.no_grad():
        a = _random_block(c, "routed")(x)
        b = _random_block({**c, "top_k": 3}, "routed")(x)
    assert (a - b).abs().max() > 1e-3


def test_block_rejects_bad_settings():
    with pytest.raises(ValueError, match="naming"):
        MoEBlock(8, 4, 4, 2, OPS, layer=0, naming="llama")
    with pytest.raises(ValueError, match="impl"):
        MoEBlock(8, 4, 4, 2, OPS, layer=0, impl="sparse")
    with pytest.raises(ValueError, match="top_k"):
        MoEBlock(8, 4, 4, 5, OPS, layer=0)
    with pytest.raises(ValueError, match="n_group"):
        MoEBlock(8, 4, 6, 2, OPS, layer=0, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="shared_gate"):
        MoEBlock(8, 4, 4, 2, OPS, layer=0, shared_gate=True)


# ------------------------------------------------------------------------------------------------ expert load


def _count_forward_tokens(llm) -> list:
    """Wrap the model: returns a list that gets, per engine step, the tokens all its forwards processed."""
    net, steps, cur = llm.engine.model, [], [0]
    fwd, end = net.forward, net.end_step

    def forward(input_ids, meta, kv):
        cur[0] += int(input_ids.shape[0])
        return fwd(input_ids, meta, kv)

    def end_step():
        steps.append(cur[0])
        cur[0] = 0
        end()

    net.forward, net.end_step = forward, end_step
    return steps


@pytest.mark.parametrize("setting,window,preempt", [
    (dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=7), 1000, False),
    (dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=7), 5, False),
    (dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=16), 1000, True),
], ids=["chunked", "window5", "preempted"])
def test_expert_load_counts_every_forward_token(tiny, setting, window, preempt):
    llm = LLM(tiny.path, hf_overrides={"expert_load_window": window}, **setting)
    k = TINY[tiny.name]["num_experts_per_tok"]
    steps = _count_forward_tokens(llm)
    outs = run(llm, tiny.prompts, greedy())
    assert_greedy_matches(outs, tiny.hf_greedy, tiny.hf_scores)
    assert (llm.engine.scheduler.num_preemptions > 0) == preempt
    load = llm.expert_load()
    net = llm.engine.model
    assert load["window"] == window and list(load["layers"]) == net.moe_layers
    assert load["steps_recorded"] == min(len(steps), window) and len(steps) == llm.engine.stats["steps"]
    # Tokens that went through a forward: every prompt token and every output token but the last, plus
    # whatever preemption made the engine recompute.
    no_recompute = sum(len(p) + NEW_TOKENS - 1 for p in tiny.prompts)
    if preempt:
        assert sum(steps) > no_recompute
    else:
        assert sum(steps) == no_recompute
    assert sum(steps) == llm.engine.stats["forward_tokens"]
    E = TINY[tiny.name].get("num_experts", TINY[tiny.name].get("num_local_experts"))
    for layer, counts in load["layers"].items():
        assert len(counts) == E and min(counts) >= 0
        assert sum(counts) == sum(steps[-window:]) * k, f"layer {layer}"
    if window < len(steps):
        assert sum(steps[-window:]) < sum(steps)  # the window really dropped old steps


def test_expert_load_counts_match_full_pass_routing(tiny, tmp_path):
    """One prompt, no chunking: the engine's per-expert counts equal the routing of one full-sequence pass over
    the tokens it processed (prompt + outputs but the last); the oracle path itself records nothing."""
    llm = LLM(tiny.path, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    (out,) = run(llm, [tiny.prompts[2]], greedy())
    net = llm.engine.model
    seq = torch.tensor(tiny.prompts[2] + out[:-1])
    before = llm.expert_load()
    with torch.no_grad():
        net.forward_full(seq)
    assert llm.expert_load() == before and net.expert_load.current.sum() == 0  # forward_full not counted
    oracle = ExpertLoad(net.moe_layers, net.expert_load.num_experts, window=1)
    for b in moe_blocks(net):
        b.expert_load = oracle
    with torch.no_grad():
        LlamaForCausalLM.forward_full(net, seq)  # the plain full-sequence pass, which the override silences
    oracle.end_step()
    expected = oracle.as_dict()["layers"]
    assert before["layers"] == expected
    # dump_expert_load: one JSONL row per MoE layer with its counts and the settings passed in
    path = tmp_path / "load.jsonl"
    llm.dump_expert_load(path, run="t1")
    llm.dump_expert_load(path, run="t2")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2 * len(net.moe_layers)
    for r in rows[:len(net.moe_layers)]:
        assert r["run"] == "t1" and r["model"] == tiny.path
        assert r["counts"] == before["layers"][r["layer"]]
        assert r["window"] == 64 and r["steps_recorded"] == before["steps_recorded"]
    assert [r["layer"] for r in rows] == net.moe_layers * 2


def test_expert_load_needs_a_moe_model(tmp_path):
    build_tiny_hf_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="no experts"):
        llm.expert_load()


# -------------------------------------------------------------------------------------------------- checkpoints


def _copy(src, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(d: Path, fn) -> None:
    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"))


def _logits(path, prompt, **kw):
    net = LLM(str(path), num_kv_blocks=32, block_size=4, **kw).engine.model
    with torch.no_grad():
        return net.forward_full(torch.tensor(prompt))


def test_round_trip_and_fused_layout(tiny, tmp_path):
    """hf_state_dict writes the per-expert on-disk names; a checkpoint in transformers 5's fused layout loads too."""
    llm = LLM(tiny.path, num_kv_blocks=32, block_size=4)
    sd = llm.engine.model.hf_state_dict()
    disk = load_file(str(Path(tiny.path) / "model.safetensors"))
    assert set(sd) == set(disk)
    for n, t in disk.items():
        assert torch.equal(sd[n], t), n
    # fused: per layer, experts.{e}.(gate|up|down) -> experts.gate_up_proj [E, 2F, d] / experts.down_proj [E, d, F]
    net = llm.engine.model
    fused = {n: t for n, t in disk.items() if ".experts." not in n}
    for b in moe_blocks(net):
        prefix = f"model.layers.{b.layer}.mlp"  # transformers 5 in-memory name, also for Mixtral
        fused[f"{prefix}.experts.gate_up_proj"] = b.w13.detach().clone()
        fused[f"{prefix}.experts.down_proj"] = b.w2.detach().clone()
        if tiny.name == "mixtral":  # the router too, under the in-memory block name
            fused[f"{prefix}.gate.weight"] = fused.pop(f"model.layers.{b.layer}.block_sparse_moe.gate.weight")
    d = _copy(tiny.path, tmp_path / "fused")
    save_file(fused, str(d / "model.safetensors"))
    assert_logits_close(_logits(d, tiny.prompts[0]), tiny.hf_logits[0], factor=MODEL_FACTOR, what="fused layout")


def _expert_name(tiny, expert=3, part="down"):
    """The on-disk name of one expert tensor in the last MoE layer."""
    layer = [i for i, blk in enumerate(tiny.hf.model.layers) if hasattr(blk.mlp, "experts")][-1]
    if tiny.name == "mixtral":
        w = {"gate": "w1", "up": "w3", "down": "w2"}[part]
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"


def test_missing_expert_tensor_is_named(tiny, tmp_path):
    name = _expert_name(tiny, expert=3, part="down")
    d = _copy(tiny.path, tmp_path / "m")
    _edit(d, lambda sd: sd.pop(name))
    with pytest.raises(WeightError, match=re.escape(name)):
        LLM(str(d), num_kv_blocks=16, block_size=4)


@pytest.mark.parametrize("part", ["gate", "up", "down"])
def test_wrong_shape_expert_tensor_is_named(mixtral, tmp_path, part):
    name = _expert_name(mixtral, expert=5, part=part)
    d = _copy(mixtral.path, tmp_path / "w")
    _edit(d, lambda sd: sd.__setitem__(name, torch.zeros(sd[name].shape[0] + 1, sd[name].shape[1])))
    with pytest.raises(WeightError, match=re.escape(name) + r".*shape"):
        LLM(str(d), num_kv_blocks=16, block_size=4)


def test_unknown_expert_and_bad_fused_shape_are_named(mixtral, tmp_path):
    extra = "model.layers.0.block_sparse_moe.experts.8.w1.weight"  # 8 experts: 0..7
    d = _copy(mixtral.path, tmp_path / "u")
    _edit(d, lambda sd: sd.__setitem__(extra, torch.zeros(48, 64)))
    with pytest.raises(WeightError, match=re.escape(extra)):
        LLM(str(d), num_kv_blocks=16, block_size=4)
    fused = "model.layers.1.block_sparse_moe.experts.down_proj"
    d = _copy(mixtral.path, tmp_path / "f")
    _edit(d, lambda sd: sd.__setitem__(fused, torch.zeros(8, 48, 64)))  # transposed: [E, F, d]
    with pytest.raises(WeightError, match=re.escape(fused) + r".*shape \(8, 48, 64\), expected \(8, 64, 48\)"):
        LLM(str(d), num_kv_blocks=16, block_size=4)


# ------------------------------------------------------------------------------------------------------- FP8


def _quantize_experts(src: Path, dst: Path, block: tuple, quant_config: dict) -> dict:
    """Copy a checkpoint with every expert weight FP8 block-quantized (+ weight_scale_inv); the scales go to a
    second shard with an index, so loading must pair tensors across shards. Returns {name: (fp8, scale)}."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    scales, quant = {}, {}
    for n in [n for n in sd if ".experts." in n]:
        q, s = quantize_fp8_block(sd[n], block)
        sd[n], scales[n + "_scale_inv"] = q, s
        quant[n] = (q, s)
    save_file(sd, str(dst / "model-00001-of-00002.safetensors"))
    save_file(scales, str(dst / "model-00002-of-00002.safetensors"))
    index = {n: "model-00001-of-00002.safetensors" for n in sd}
    index.update({n: "model-00002-of-00002.safetensors" for n in scales})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return quant


def test_fp8_expert_weights_load_and_stay_close(mixtral, tmp_path):
    d = tmp_path / "fp8"
    quant = _quantize_experts(Path(mixtral.path), d, (32, 32),
                              {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]})
    assert all(q.dtype == FP8 for q, _ in quant.values())
    llm = LLM(str(d), num_kv_blocks=32, block_size=4)
    sd = llm.engine.model.hf_state_dict()
    for n, (q, s) in quant.items():  # exactly the dequantized values, 32x32 blocks (48 rows: a partial block)
        assert torch.equal(sd[n], dequantize_fp8_block(q, s, (32, 32))), n
    orig = load_file(str(Path(mixtral.path) / "model.safetensors"))
    name = next(iter(quant))
    assert not torch.equal(sd[name], orig[name])  # really quantized
    # For scale: the same expert weights merely rounded to bfloat16 (8 bits of mantissa against FP8's 4).
    bf16 = LLM(mixtral.path, num_kv_blocks=32, block_size=4).engine.model
    with torch.no_grad():
        for b in moe_blocks(bf16):
            b.w13.copy_(b.w13.bfloat16().float())
            b.w2.copy_(b.w2.bfloat16().float())

    def compare(net) -> tuple:
        kls, agree = [], []
        for p, ref in zip(mixtral.prompts, mixtral.hf_logits):
            with torch.no_grad():
                got = net.forward_full(torch.tensor(p))
            lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
            kls.append((lp.exp() * (lp - lq)).sum(-1))  # KL(float32 || quantized) per position
            agree.append(ref.argmax(-1) == got.argmax(-1))
        return float(torch.cat(kls).mean()), float(torch.cat(agree).float().mean())

    (kl, top1), (kl_bf16, top1_bf16) = compare(llm.engine.model), compare(bf16)
    print(f"\nquantized experts vs float32, {sum(PROMPT_LENS)} positions of 4 prompts: mean next-token KL "
          f"FP8 e4m3 32x32 blocks {kl:.3e} nats (top-1 agreement {top1:.0%}); "
          f"bfloat16 rounding {kl_bf16:.3e} nats (top-1 agreement {top1_bf16:.0%})")
    assert 0 < kl_bf16 < kl < 0.05
    assert top1 >= 0.8

def test_fp8_block_pairing_across_shards_default_128(tmp_path):
    """iter_weights: 128x128 by default, scale before or after its weight, in another shard; ragged edges."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(200, 300, generator=g), torch.randn(130, 128, generator=g)
    q1, s1 = quantize_fp8_block(w1)
    q2, s2 = quantize_fp8_block(w2)
    plain = torch.randn(5, 7, generator=g)
    save_file({"b.weight_scale_inv": s2, "a.weight": q1}, str(tmp_path / "s1.safetensors"))
    save_file({"a.weight_scale_inv": s1, "b.weight": q2, "c.weight": plain}, str(tmp_path / "s2.safetensors"))
    cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    out = dict(iter_weights(tmp_path, cfg))
    assert set(out) == {"a.weight", "b.weight", "c.weight"}
    assert s1.shape == (2, 3) and s2.shape == (2, 1)
    assert torch.equal(out["a.weight"], dequantize_fp8_block(q1, s1)) and out["a.weight"].dtype == torch.float32
    assert torch.equal(out["b.weight"], dequantize_fp8_block(q2, s2))
    assert torch.equal(out["c.weight"], plain)
    rel = (out["a.weight"] - w1).norm() / w1.norm()
    assert 0 < rel < 0.05


def test_fp8_without_scale_or_with_bad_scale_is_named(tmp_path):
    q, s = quantize_fp8_block(torch.randn(64, 64), (32, 32))
    d1 = tmp_path / "noscale"
    d1.mkdir()
    save_file({"model.layers.0.mlp.experts.1.up_proj.weight": q}, str(d1 / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("'model.layers.0.mlp.experts.1.up_proj.weight'") + ".*scale"):
        list(iter_weights(d1, {}))
    d2 = tmp_path / "badscale"
    d2.mkdir()
    save_file({"x.weight": q, "x.weight_scale_inv": s}, str(d2 / "model.safetensors"))
    # the config says 128x128 blocks: a [2, 2] scale does not fit a 64x64 weight
    with pytest.raises(CheckpointError, match=re.escape("'x.weight'") + r".*\(1, 1\)"):
        list(iter_weights(d2, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    assert torch.equal(dict(iter_weights(d2, {"quantization_config": {"quant_method": "fp8",
                                                                      "weight_block_size": [32, 32]}}))["x.weight"],
                       dequantize_fp8_block(q, s, (32, 32)))
