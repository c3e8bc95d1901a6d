"""DeepSeek-V2 / V3 (multi-head latent attention + DeepSeekMoE) against transformers, float32 on the CPU.

Three tiny random checkpoints (deepinfer.testing.models.TINY): V2 without q LoRA and greedy routing, V2 with
q LoRA and group-limited greedy routing, V3 with q LoRA, noaux_tc grouped sigmoid routing (with a random
e_score_correction_bias, so the bias really changes the choice) and YaRN rope whose mscale_all_dim changes the
softmax scale. For each:

* prefill logits of the oracle (``forward_full``, unabsorbed MLA) and of the engine path (absorbed MLA over the
  latent paged cache, ragged, chunked, shuffled blocks) match transformers;
* 32 greedy tokens equal transformers' ``generate`` for one prompt and for a batch of 4 prompts of different
  lengths, with chunked prefill;
* the absorbed engine path equals ``forward_full`` at every one of 16 greedy decode steps (and, by hypothesis,
  over generated batch mixes, chunk sizes and block sizes);
* the cache holds kv_lora_rank + qk_rope_head_dim values per token per layer, by the engine's accounting and
  by the real cache tensor;
* expert-load counts sum to tokens x top_k per MoE layer.

Plus: MTP layers in a checkpoint are skipped with one log line while a missing backbone or expert tensor fails
naming it; V3 with rope_interleave=false; moe_layer_freq; the checkpoint round trip.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.core.kv_cache import blocks_needed
from deepinfer.core.state import ScheduledBatch, Sequence
from deepinfer.models.base import WeightError
from deepinfer.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from deepinfer.models.moe import MoEBlock
from deepinfer.core.inputs import build_inputs
from deepinfer.testing.compare import MODEL_FACTOR, assert_greedy_matches, assert_logits_close, hf_greedy
from deepinfer.testing.models import TINY, build_tiny_hf_model

ARCHS = ["deepseek_v2", "deepseek_v2-qlora", "deepseek_v3"]
NEW_TOKENS = 32
PROMPT_LENS = [13, 2, 27, 40]  # the batch of 4


def build(path, name: str):
    """The tiny checkpoint; for V3 a random e_score_correction_bias is written (transformers inits it to 0)."""
    hf = build_tiny_hf_model(path, name, random_norms_and_biases=True)
    if name.startswith("deepseek_v3"):
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for layer in hf.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=g)
                                                       * 0.15)
        hf.save_pretrained(path, safe_serialization=True)
    hf.generation_config.eos_token_id = None
    return hf


class Tiny:
    def __init__(self, name, path, hf):
        self.name, self.path, self.hf = name, str(path), hf
        self.spec = TINY[name]
        g = torch.Generator().manual_seed(1234)
        self.prompts = [torch.randint(5, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
        with torch.no_grad():
            self.hf_logits = [hf(torch.tensor([p])).logits[0].float() for p in self.prompts]
        self.hf_greedy, self.hf_scores = map(list, zip(*(hf_greedy(hf, p, NEW_TOKENS) for p in self.prompts)))

    def llm(self, **kw) -> LLM:
        kw.setdefault("num_kv_blocks", 64)
        kw.setdefault("block_size", 4)
        return LLM(self.path, **kw)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> Tiny:
    path = tmp_path_factory.mktemp(request.param)
    return Tiny(request.param, path, build(path, request.param))


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> Tiny:
    path = tmp_path_factory.mktemp("v3-ckpt")
    hf = build(path, "deepseek_v3")
    t = Tiny.__new__(Tiny)
    t.name, t.path, t.hf, t.spec = "deepseek_v3", str(path), hf, TINY["deepseek_v3"]
    return t


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(llm: LLM, prompts: list, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        assert o.error is None and o.finished and o.outputs[0].finish_reason == "length"
    return [o.outputs[0].token_ids for o in outs]


# ------------------------------------------------------------------ driving the engine forward by hand


class Paged:
    """Sequences over a freshly allocated latent cache with shuffled (non-contiguous, interleaved) blocks."""

    def __init__(self, net, seqs: list, block_size: int, capacity: int, seed: int = 0):
        self.net, self.block_size = net, block_size
        per = blocks_needed(capacity, block_size)
        total = per * len(seqs) + 2
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
        self.kv = net.allocate_kv_cache(total * block_size, torch.float32, torch.device("cpu"))
        self.seqs = [Sequence(seq_id=i, request_id=str(i), index=0, token_ids=list(p), num_prompt_tokens=len(p),
                              params=SamplingParams(), arrival=i, block_table=perm[i * per:(i + 1) * per])
                     for i, p in enumerate(seqs)]
        self.done = [0] * len(seqs)

    def step(self, nums: dict) -> dict:
        """nums: seq index -> tokens to compute now (from where it stopped). Returns seq index -> logits [n, V]."""
        rows = sorted(nums)
        batch = ScheduledBatch(seqs=[self.seqs[i] for i in rows], num_tokens=[nums[i] for i in rows],
                               start=[self.done[i] for i in rows], samples=[True] * len(rows))
        ids, meta, qstart = build_inputs(batch, list(range(len(rows))), self.block_size, torch.device("cpu"))
        with torch.no_grad():
            logits = self.net.compute_logits(self.net(ids, meta, self.kv))
        out = {}
        for r, i in enumerate(rows):
            out[i] = logits[qstart[r]:qstart[r + 1]]
            self.done[i] += nums[i]
        return out

    def prefill(self, chunk: int) -> list:
        """Every sequence in one ragged batch per step, ``chunk`` tokens per row per step."""
        pieces = [[] for _ in self.seqs]
        while any(d < s.num_tokens for d, s in zip(self.done, self.seqs)):
            nums = {i: min(chunk, s.num_tokens - self.done[i]) for i, s in enumerate(self.seqs)
                    if self.done[i] < s.num_tokens}
            for i, lg in self.step(nums).items():
                pieces[i].append(lg)
        return [torch.cat(p) for p in pieces]


def full(net, tokens: list) -> torch.Tensor:
    with torch.no_grad():
        return net.forward_full(torch.tensor(tokens))


# ------------------------------------------------------------------ parity with transformers


def test_config_exercises_the_variants(tiny):
    net = tiny.llm().engine.model
    c = net.config
    assert c.moe_layers == (1, 2) and net.moe_layers == [1, 2]
    blocks = net.moe_blocks()
    assert len(blocks) == 2 and all(b.shared_size == tiny.spec["n_shared_experts"] * 32 for b in blocks)
    attn = net.model.layers[0].self_attn
    assert attn.q_lora == (tiny.spec["q_lora_rank"] is not None)
    if tiny.name == "deepseek_v3":
        assert c.router["scoring"] == "sigmoid" and c.router["group_score"] == "top2sum" and c.router["n_group"] == 4
        bias = blocks[0].e_score_correction_bias
        assert bias is not None and bias.abs().min() > 0  # the random bias was loaded
        # YaRN with mscale_all_dim scales the softmax by mscale(4, 0.8) ** 2 (and cos/sin by a ratio != 1).
        m = 0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1.0
        assert c.softmax_scale == pytest.approx((16 + 8) ** -0.5 * m * m)
        assert net.model.layers[0].self_attn.rotary.attention_scaling != pytest.approx(1.0)
        assert c.rope_interleave and not attn.rotary.is_neox_style
    else:
        assert c.router["scoring"] == "softmax" and not c.router["renormalize"]
        assert c.router["scaling"] == tiny.spec["routed_scaling_factor"] != 1.0
        assert c.router["n_group"] == tiny.spec.get("n_group")
        assert c.softmax_scale == pytest.approx((16 + 8) ** -0.5)


def test_forward_full_matches_hf(tiny):
    net = tiny.llm().engine.model
    assert next(net.parameters()).dtype == torch.float32
    for p, ref in zip(tiny.prompts, tiny.hf_logits):
        ours = full(net, p)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        assert_logits_close(ours, ref, factor=MODEL_FACTOR, what=f"{tiny.name}, prompt of {len(p)}")


@pytest.mark.parametrize("block_size,chunk", [(4, 64), (3, 7), (1, 11)])
def test_engine_prefill_matches_hf(tiny, block_size, chunk):
    net = tiny.llm().engine.model
    ours = Paged(net, tiny.prompts, block_size, max(PROMPT_LENS), seed=block_size).prefill(chunk)
    for p, got, ref in zip(tiny.prompts, ours, tiny.hf_logits):
        assert_logits_close(got, ref, factor=MODEL_FACTOR, what=f"{tiny.name}, prompt of {len(p)}")


def test_greedy_single_prompt(tiny):
    llm = tiny.llm(max_num_batched_tokens=8)  # the 40-token prompt is prefilled in 5 chunks
    assert_greedy_matches(run(llm, [tiny.prompts[3]], greedy()), [tiny.hf_greedy[3]], [tiny.hf_scores[3]])


def test_greedy_batch(tiny):
    llm = tiny.llm(max_num_batched_tokens=16, block_size=3)
    assert_greedy_matches(run(llm, tiny.prompts, greedy()), tiny.hf_greedy, tiny.hf_scores)


# ------------------------------------------------------------------ absorbed (engine) vs unabsorbed (oracle)


def test_absorbed_equals_full_every_decode_step(tiny):
    """Two sequences decode together, greedily, for 16 steps; each step's logits equal forward_full's last row."""
    net = tiny.llm().engine.model
    prompts = [tiny.prompts[0], tiny.prompts[2]]
    paged = Paged(net, prompts, block_size=4, capacity=max(map(len, prompts)) + 17, seed=3)
    last = {i: lg[-1] for i, lg in enumerate(paged.prefill(chunk=9))}
    for _ in range(16):
        for i, s in enumerate(paged.seqs):
            assert_logits_close(last[i], full(net, s.token_ids)[-1], factor=MODEL_FACTOR, what=f"sequence {i}")
            s.token_ids.append(int(last[i].argmax()))
        last = {i: lg[-1] for i, lg in paged.step({0: 1, 1: 1}).items()}
    assert all(s.num_tokens == len(p) + 16 for s, p in zip(paged.seqs, prompts))


@pytest.fixture(scope="module")
def qlora_net(tmp_path_factory):
    path = tmp_path_factory.mktemp("v2-qlora-hyp")
    build(path, "deepseek_v2-qlora")
    return LLM(str(path), num_kv_blocks=8, block_size=4).engine.model


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(1, 24), min_size=1, max_size=3), chunk=st.integers(1, 10),
       block_size=st.sampled_from([1, 3, 4, 16]), seed=st.integers(0, 1000))
def test_absorbed_equals_full_on_batch_mixes(qlora_net, lens, chunk, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, qlora_net.vocab_size, (n,), generator=g).tolist() for n in lens]
    got = Paged(qlora_net, seqs, block_size, max(lens), seed=seed).prefill(chunk)
    for s, lg in zip(seqs, got):
        assert_logits_close(lg, full(qlora_net, s), factor=MODEL_FACTOR)


# ------------------------------------------------------------------ the latent cache and expert load


def test_kv_cache_holds_only_the_latent(tiny):
    s = tiny.spec
    per_layer = s["kv_lora_rank"] + s["qk_rope_head_dim"]
    llm = tiny.llm(num_kv_blocks=10, block_size=4)
    engine = llm.engine
    expect = per_layer * 4 * s["num_hidden_layers"]
    assert engine.kv_bytes_per_token == expect
    kv = engine.kv_cache
    assert isinstance(kv, torch.Tensor) and kv.dtype == torch.float32
    assert tuple(kv.shape) == (s["num_hidden_layers"], 10 * 4, 1, per_layer)
    assert kv.element_size() * kv[:, 0].numel() == expect  # bytes one token slot really takes
    assert engine.model.kv_bytes_per_token(torch.bfloat16) == per_layer * 2 * s["num_hidden_layers"]
    # Far below what materialised per-head K and V would take.
    mha = 4 * s["num_hidden_layers"] * s["num_attention_heads"] * (s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
                                                                    + s["v_head_dim"])
    assert expect < mha / 3


def test_expert_load_sums_to_tokens_times_top_k(tiny):
    llm = tiny.llm(max_num_batched_tokens=16)
    run(llm, tiny.prompts, greedy(6))
    load = llm.expert_load()
    steps = llm.engine.stats["steps"]
    assert load["steps_recorded"] == steps <= load["window"]
    tokens = llm.engine.stats["forward_tokens"]
    assert tokens == sum(PROMPT_LENS) + 4 * 5  # the last sampled token is never forwarded
    assert sorted(load["layers"]) == [1, 2]  # layer 0 is dense (first_k_dense_replace=1)
    for layer, counts in load["layers"].items():
        assert len(counts) == tiny.spec["n_routed_experts"] and min(counts) >= 0
        assert sum(counts) == tokens * tiny.spec["num_experts_per_tok"]
        assert sum(c > 0 for c in counts) > 1


# ------------------------------------------------------------------ checkpoints


def _rewrite(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    edit(tensors)
    save_file(tensors, f"{dst}/model.safetensors")


def test_mtp_layers_are_skipped_and_missing_tensors_named(v3, tmp_path, caplog):
    L = v3.spec["num_hidden_layers"]
    d = 64
    fake = {f"model.layers.{L}.{n}": torch.randn(*shape) for n, shape in [
        ("enorm.weight", (d,)), ("hnorm.weight", (d,)), ("eh_proj.weight", (d, 2 * d)),
        ("self_attn.kv_a_proj_with_mqa.weight", (40, d)), ("mlp.experts.0.gate_proj.weight", (32, d)),
        ("mlp.gate.e_score_correction_bias", (8,)), ("shared_head.head.weight", (512, d))]}
    _rewrite(v3.path, tmp_path / "mtp", lambda t: t.update(fake))
    caplog.set_level(logging.INFO, logger="deepinfer.models.deepseek")
    net = LLM(str(tmp_path / "mtp"), num_kv_blocks=16, block_size=4).engine.model
    lines = [r.getMessage() for r in caplog.records if r.name == "deepinfer.models.deepseek"]
    assert len(lines) == 1 and "skipped 7 checkpoint tensor(s) of 1 multi-token-prediction layer" in lines[0]
    assert f"model.layers.{L}" in lines[0] and "num_nextn_predict_layers=1" in lines[0]
    prompt = list(range(5, 30))
    with torch.no_grad():
        ref = v3.hf(torch.tensor([prompt])).logits[0]
    assert_logits_close(full(net, prompt), ref, factor=MODEL_FACTOR)

    # A layer past the MTP layers is not skipped: the config does not match the checkpoint.
    _rewrite(v3.path, tmp_path / "extra", lambda t: t.update({f"model.layers.{L + 1}.enorm.weight": torch.ones(d)}))
    with pytest.raises(WeightError, match=rf"model\.layers\.{L + 1}\.enorm\.weight"):
        LLM(str(tmp_path / "extra"), num_kv_blocks=16, block_size=4)

    for i, name in enumerate(["model.layers.1.self_attn.kv_b_proj.weight", "model.layers.0.mlp.up_proj.weight",
                              "model.layers.2.mlp.experts.5.up_proj.weight",
                              "model.layers.1.mlp.gate.e_score_correction_bias"]):
        dst = tmp_path / f"missing{i}"
        _rewrite(v3.path, dst, lambda t: (t.update(fake), t.pop(name)))
        with pytest.raises(WeightError, match=rf"lacks tensor\(s\) {name.replace('.', chr(92) + '.')}"):
            LLM(str(dst), num_kv_blocks=16, block_size=4)


def test_hf_state_dict_round_trip(v3):
    net = LLM(v3.path, num_kv_blocks=16, block_size=4).engine.model
    on_disk = load_file(f"{v3.path}/model.safetensors")
    ours = net.hf_state_dict()
    assert set(ours) == set(on_disk)
    for k, t in on_disk.items():
        assert torch.equal(ours[k], t), k


def _hf_config_dict(hf) -> dict:
    cfg = json.loads(hf.config.to_json_string())
    cfg["architectures"] = [type(hf).__name__]
    return cfg


def test_v3_half_rotation_and_fused_expert_tensors():
    """rope_interleave=false rotates halves; the weights come from transformers' in-memory (fused) state dict."""
    import transformers

    spec = {k: v for k, v in TINY["deepseek_v3"].items() if k != "arch"}
    cfg = transformers.DeepseekV3Config(vocab_size=128, max_position_embeddings=128, initializer_range=0.1,
                                        rope_interleave=False, **spec)
    torch.manual_seed(3)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    net = DeepseekV3ForCausalLM(_hf_config_dict(hf), ReferenceOps())
    assert net.model.layers[0].self_attn.rotary.is_neox_style
    names = list(hf.state_dict())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    net.load_weights(hf.state_dict().items())
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert_logits_close(full(net, ids.tolist()), ref, factor=MODEL_FACTOR, what="forward_full")
    paged = Paged(net, [ids.tolist()], block_size=4, capacity=30)
    assert_logits_close(paged.prefill(chunk=8)[0], ref, factor=MODEL_FACTOR, what="paged")


def test_moe_layer_selection():
    base = {k: v for k, v in TINY["deepseek_v2"].items() if k != "arch"}
    base.update(vocab_size=64, num_hidden_layers=6, architectures=["DeepseekV2ForCausalLM"])
    with torch.device("meta"):
        net = DeepseekV2ForCausalLM({**base, "first_k_dense_replace": 1, "moe_layer_freq": 2}, ReferenceOps())
        kinds = [isinstance(layer.mlp, MoEBlock) for layer in net.model.layers]
        # DeepSeek's rule: i >= first_k_dense_replace and i % moe_layer_freq == 0.
        assert kinds == [False, False, True, False, True, False] and net.moe_layers == [2, 4]
        assert net.expert_load.layers == [2, 4]
        dense = DeepseekV2ForCausalLM({**base, "n_routed_experts": None}, ReferenceOps())
        assert dense.expert_load is None and not dense.moe_blocks()
        with pytest.raises(ValueError, match="topk_method"):
            DeepseekV2ForCausalLM({**base, "topk_method": "noaux_tc"}, ReferenceOps())
        with pytest.raises(ValueError, match="n_group"):
            DeepseekV2ForCausalLM({**base, "topk_method": "group_limited_greedy"}, ReferenceOps())
