"""FP8 block-scaled experts served as FP8 (issue 12.2), and CED's MoE through the backend's ops.

* Ops.moe_experts with float8_e4m3fn weights and their 128x128 block scales: the reference dequantizes, and
  equals the same experts on the dequantized weights (routed and dense, exactly); bad scales name the argument.
* CEDLayer.moe through the model's ops equals the computation it replaced, written here with the reference moe
  module itself (route + experts_routed + the clamped shared expert), bf16 and float32, with FP8 experts too.
* Tiny FP8 checkpoints (experts of width 128, per-expert tensors on disk; the attention and dense weights FP8
  as well, and dequantized) of DeepSeek-V3, Qwen3-MoE, Mixtral and CED: served with FP8 experts, the logits
  of forward_full and the engine's greedy tokens equal those of fp8_experts="dequantize" (on the CPU both do
  the same float32 arithmetic once a weight is dequantized, so they agree exactly); the experts take half
  the bytes of bf16; the fused transformers-5 spelling on disk loads the same model; a non-FP8 expert tensor
  in such a checkpoint is refused with the way out; 32x32 blocks (which the kernel cannot take) stay
  dequantized.
* On CUDA: the same DeepSeek-V3 checkpoint through the fused Triton kernel (tests/test_triton_moe.py holds
  the kernel's own FP8 tests, run under TRITON_INTERPRET=1 without CUDA).
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.backends.reference import moe as ref_moe
from deepinfer.backends.reference.ops import ReferenceOps
from deepinfer.models.ced.config import CEDConfig
from deepinfer.models.ced.model import CEDForCausalLM
from deepinfer.models.loader import CheckpointError
from deepinfer.models.quant import FP8, quantize_fp8_block, store_experts_fp8
from deepinfer.testing.ced import build_ced_checkpoint
from deepinfer.testing.models import build_tiny_hf_model, write_fp8_checkpoint

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
FAST = settings(max_examples=25, deadline=None)
PROMPTS = [[5, 17, 9, 33, 2, 41, 8], [12, 3, 60, 61, 7, 7, 19, 100, 4, 5, 6, 88, 30], [70, 1]]
NEW_TOKENS = 12
# Expert width 128 (a multiple of the 128x128 blocks, as every real FP8 MoE checkpoint's) for each family.
HF_ARCHS = {"deepseek_v3": dict(moe_intermediate_size=128), "qwen3-moe": dict(moe_intermediate_size=128),
            "mixtral": dict(intermediate_size=128)}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_experts(g, E, rows, cols):
    """Random experts [E, rows, cols] quantized per expert in 128x128 blocks -> (fp8, scales, dequantized)."""
    w = torch.randn(E, rows, cols, generator=g) * cols ** -0.5
    q, s = map(torch.stack, zip(*(quantize_fp8_block(m) for m in w)))
    return q, s, ref_moe.dequantize_fp8_blocks(q, s)


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------- reference op
@FAST
@given(T=st.integers(0, 20), E=st.integers(1, 6), k=st.integers(1, 3), d=st.sampled_from([40, 136]),
       F=st.sampled_from([24, 130]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       impl=st.sampled_from(["routed", "dense"]), seed=st.integers(0, 2**16))
def test_reference_fp8_experts_equal_the_dequantized_weights(T, E, k, d, F, dtype, impl, seed):
    g = gen(seed)
    k = min(k, E)
    q13, s13, w13 = fp8_experts(g, E, 2 * F, d)
    q2, s2, w2 = fp8_experts(g, E, d, F)
    x = torch.randn(T, d, generator=g).to(dtype)
    weights, ids = ref_moe.route(torch.randn(T, E, generator=g), k, scoring="sqrt_softplus")
    ops = ReferenceOps()
    got = ops.moe_experts(x, q13, q2, weights, ids, clamp=2.0, impl=impl, w13_scale=s13, w2_scale=s2)
    want = ops.moe_experts(x, w13, w2, weights, ids, clamp=2.0, impl=impl)  # float32 weights (routed: cast per expert)
    assert got.dtype == dtype and torch.equal(got, want)


def test_reference_fp8_scales_are_checked():
    g = gen(0)
    q13, s13, w13 = fp8_experts(g, 2, 256, 64)
    q2, s2, w2 = fp8_experts(g, 2, 64, 128)
    x = torch.randn(3, 64, generator=g)
    weights, ids = ref_moe.route(torch.randn(3, 2, generator=g), 1)
    ops = ReferenceOps()
    for kw, msg in [(dict(), "need w13_scale"), (dict(w13_scale=s13), "given together"),
                    (dict(w13_scale=s13[:, :1], w2_scale=s2), r"w13_scale must have shape \(2, 2, 1\)"),
                    (dict(w13_scale=s13, w2_scale=s2.double()), "w2_scale must be float32")]:
        for impl in ("routed", "dense"):
            with pytest.raises(ValueError, match=msg):
                ops.moe_experts(x, q13, q2, weights, ids, impl=impl, **kw)
    with pytest.raises(ValueError, match="for float8_e4m3fn weights"):
        ops.moe_experts(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)


# ------------------------------------------------------------------------------------------- CED MoE via ops
def ced_model(ops=None, seed=0, **cfg) -> CEDForCausalLM:
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_encoder_layers=1, layer_modes=("swa", "full"),
                num_heads=2, head_dim=32, rope_dim=8, q_lora_rank=32, out_group_dim=32, index_heads=2, index_topk=4,
                pool_block=2, pool_blocks=2, n_win=4, swa_allowance=1, max_position_embeddings=256)
    model = CEDForCausalLM(CEDConfig(**{**base, **cfg}), ops)
    model.init_weights(seed, std=0.3)
    with torch.no_grad():
        for layer in model.layers:  # a selection bias of the scores' size, so it really changes the choice
            layer.gate_bias.copy_(torch.randn(layer.gate_bias.shape, generator=gen(seed + 1)) * 0.3)
    return model


def old_ced_moe(layer, x, w13=None, w2=None):
    """What CEDLayer.moe computed before it went through ops: the reference moe module directly."""
    c = layer.c
    weights, ids = ref_moe.route(F.linear(x.float(), layer.gate.float()), c.num_experts_per_tok,
                                 scoring="sqrt_softplus", renormalize=True, scaling=c.routed_scaling_factor,
                                 bias=layer.gate_bias)
    y = ref_moe.experts_routed(x, layer.w13 if w13 is None else w13, layer.w2 if w2 is None else w2, weights, ids,
                               clamp=c.swiglu_limit)
    if layer.shared_w13 is not None:
        g, u = F.linear(x, layer.shared_w13).chunk(2, dim=-1)
        lim = c.swiglu_limit
        y = y + F.linear(F.silu(g.clamp(max=lim)) * u.clamp(-lim, lim), layer.shared_w2)
    return y, ids


ced_moe_cases = dict(T=st.integers(0, 24), E=st.integers(1, 8), k=st.integers(1, 3), shared=st.integers(0, 2),
                     scaling=st.sampled_from([1.0, 1.5, 2.5]), limit=st.sampled_from([0.5, 10.0]),
                     seed=st.integers(0, 2**16))


def draw_ced(E, k, shared, scaling, limit, seed, ops=None, F=32):
    return ced_model(ops, seed, n_routed_experts=E, num_experts_per_tok=min(k, E), n_shared_experts=shared,
                     routed_scaling_factor=scaling, swiglu_limit=limit, moe_intermediate_size=F)


@FAST
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), **ced_moe_cases)
def test_ced_moe_through_ops_equals_the_reference_module(T, E, k, shared, scaling, limit, seed, dtype):
    model = draw_ced(E, k, shared, scaling, limit, seed, ReferenceOps()).to(dtype)
    layer = model.layers[seed % 2]
    x = torch.randn(T, 32, generator=gen(seed + 2)).to(dtype)
    with torch.no_grad():
        y, ids = layer.moe(x)
        want, want_ids = old_ced_moe(layer, x)
    assert torch.equal(ids, want_ids) and torch.equal(y, want)


def test_ced_moe_reads_the_model_ops_at_call_time():
    calls = []

    class Counting(ReferenceOps):
        def moe_route(self, *a, **kw):
            calls.append("route")
            return super().moe_route(*a, **kw)

        def moe_experts(self, *a, **kw):
            calls.append((kw["impl"], kw["clamp"]))
            return super().moe_experts(*a, **kw)

    model = ced_model(swiglu_limit=3.0)  # built without ops: the reference ops run
    x = torch.randn(5, 32, generator=gen(0))
    with torch.no_grad():
        before = model.layers[0].moe(x)
        model.ops = Counting()  # as the engine path does when the model has none
        after = model.layers[0].moe(x)
    assert calls == ["route", ("routed", 3.0)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert isinstance(model.layers[0].owner, weakref.ref)  # no reference cycle through the layers


@FAST
@given(**ced_moe_cases)
def test_ced_fp8_experts_equal_the_dequantized_weights(T, E, k, shared, scaling, limit, seed):
    model = draw_ced(E, k, shared, scaling, limit, seed, ReferenceOps(), F=128)
    layer = model.layers[0]
    w13, w2 = layer.w13.detach().clone(), layer.w2.detach().clone()
    assert store_experts_fp8(model, (128, 128)) == ["layers.0", "layers.1"]
    with torch.no_grad():
        for w, src in (("w13", w13), ("w2", w2)):
            q, s = map(torch.stack, zip(*(quantize_fp8_block(m) for m in src)))
            getattr(layer, w).copy_(q)
            getattr(layer, w + "_scale_inv").copy_(s)
        x = torch.randn(T, 32, generator=gen(seed + 2))
        y, ids = layer.moe(x)
        want, want_ids = old_ced_moe(layer, x, ref_moe.dequantize_fp8_blocks(layer.w13, layer.w13_scale_inv),
                                     ref_moe.dequantize_fp8_blocks(layer.w2, layer.w2_scale_inv))
    assert layer.w13.dtype == FP8 and torch.equal(ids, want_ids) and torch.equal(y, want)


def test_only_servable_expert_modules_are_converted():
    model = ced_model(moe_intermediate_size=96)  # 96: gate and up of one expert would share scale blocks
    assert store_experts_fp8(model, (128, 128)) == []
    model = ced_model(moe_intermediate_size=128)
    assert store_experts_fp8(model, (64, 64)) == []  # the kernel's blocks are 128x128
    assert model.layers[0].w13.dtype == torch.float32


# ------------------------------------------------------------------------------------------- checkpoints
def quantizable(name: str, t) -> bool:
    """Every expert and every attention / dense projection (DeepSeek-V3 ships those FP8 too); not the router,
    embeddings, head or norms."""
    parts = name.split(".")
    return ".experts." in name or (len(parts) > 1 and "proj" in parts[-2]) \
        or parts[-1] in ("w13", "w2", "shared_w13", "shared_w2", "wq_a", "wo_b")


class Ckpt:
    def __init__(self, name: str, root):
        self.src, self.path = root / "bf", root / "fp8"
        if name == "ced":
            build_ced_checkpoint(self.src, seed=3, std=0.2, vocab_size=300, moe_intermediate_size=128,
                                 n_routed_experts=4, num_experts_per_tok=2, hidden_size=64, num_layers=3,
                                 num_encoder_layers=2, layer_modes=("swa", "full", "full"), n_win=4,
                                 index_topk=4, pool_block=2, pool_blocks=2, max_position_embeddings=256)
        else:
            build_tiny_hf_model(self.src, name, init_range=0.3, **HF_ARCHS[name])
        self.quant = write_fp8_checkpoint(self.src, self.path, quantizable)  # {name: (fp8, scale)}


_CKPT: dict = {}


def fp8_ckpt(name: str, tmp_path_factory) -> Ckpt:
    """The FP8 checkpoint of one architecture, built once."""
    if name not in _CKPT:
        _CKPT[name] = Ckpt(name, tmp_path_factory.mktemp(name.replace("-", "_")))
    return _CKPT[name]


def llm(path, **kw) -> LLM:
    """On the CPU (the reference backend, float32) unless asked otherwise: where both paths agree exactly."""
    kw.setdefault("device", "cpu")
    return LLM(str(path), num_kv_blocks=64, block_size=4, **kw)


def expert_params(net) -> dict:
    return {n: p for n, p in net.named_parameters() if n.split(".")[-1] in ("w13", "w2") or "_scale_inv" in n}


def greedy(net_llm: LLM) -> list:
    outs = net_llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", [*HF_ARCHS, "ced"])
def test_fp8_checkpoint_served_in_fp8_matches_the_dequantized_path(name, tmp_path_factory):
    ck = fp8_ckpt(name, tmp_path_factory)
    path, quant = ck.path, ck.quant
    fp8, deq = llm(path), llm(path, fp8_experts="dequantize")
    got, ref = expert_params(fp8.engine.model), expert_params(deq.engine.model)
    stacked = [n for n in got if n.endswith(("w13", "w2"))]
    assert stacked and all(got[n].dtype == FP8 for n in stacked) and all(got[n + "_scale_inv"].dtype == torch.float32
                                                                         for n in stacked)
    assert all(p.dtype == torch.float32 for p in ref.values()) and not any("_scale_inv" in n for n in ref)
    for n in stacked:  # the stored FP8 values, dequantized, are the dequantized path's weights
        assert torch.equal(ref_moe.dequantize_fp8_blocks(got[n], got[n + "_scale_inv"]), ref[n]), n
    with torch.no_grad():
        for p in PROMPTS:
            a = fp8.engine.model.forward_full(torch.tensor(p))
            b = deq.engine.model.forward_full(torch.tensor(p))
            assert torch.equal(a, b)
    assert greedy(fp8) == greedy(deq)
    # The checkpoint round trip writes the FP8 experts back as they came (values and scales).
    sd = fp8.engine.model.hf_state_dict()
    for n, (q, s) in quant.items():
        if n in sd and sd[n].dtype == FP8:
            assert torch.equal(sd[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sd[n + "_scale_inv"], s)


def test_fp8_experts_take_half_the_bytes_of_bf16(tmp_path_factory):
    path = fp8_ckpt("deepseek_v3", tmp_path_factory).path
    fp8 = expert_params(llm(path, dtype="bfloat16").engine.model)
    bf16 = expert_params(llm(path, dtype="bfloat16", fp8_experts="dequantize").engine.model)
    nbytes = lambda ps, pick: sum(p.numel() * p.element_size() for n, p in ps.items() if pick(n))  # noqa: E731
    weights = lambda n: "_scale_inv" not in n  # noqa: E731
    assert nbytes(fp8, weights) * 2 == nbytes(bf16, weights)
    assert nbytes(fp8, lambda n: True) <= 0.51 * nbytes(bf16, lambda n: True)  # scales: 4 bytes per 16384 values


def test_fused_expert_tensors_on_disk_load_the_same(tmp_path_factory, tmp_path):
    """transformers 5's fused spelling: experts.gate_up_proj [E, 2F, d] and experts.down_proj [E, d, F], each
    with its _scale_inv [E, ...] beside it."""
    path = fp8_ckpt("deepseek_v3", tmp_path_factory).path
    import shutil

    shutil.copytree(path, tmp_path / "fused")
    sd = load_file(str(tmp_path / "fused" / "model.safetensors"))
    E = 8
    for layer in (1, 2):
        pre = f"model.layers.{layer}.mlp.experts"
        for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            for suffix in ("", "_scale_inv"):
                sd[f"{pre}.{fused}{suffix}"] = torch.stack([
                    torch.cat([sd.pop(f"{pre}.{e}.{p}.weight{suffix}") for p in parts]) for e in range(E)])
    save_file(sd, str(tmp_path / "fused" / "model.safetensors"))
    a, b = llm(path).engine.model, llm(tmp_path / "fused").engine.model
    assert b.model.layers[1].mlp.w13.dtype == FP8
    for (n, p), (m, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n == m and torch.equal(p.view(torch.uint8) if p.dtype == FP8 else p,
                                      q.view(torch.uint8) if q.dtype == FP8 else q), n


def test_non_fp8_expert_tensor_is_refused_with_the_way_out(tmp_path_factory, tmp_path):
    path = fp8_ckpt("qwen3-moe", tmp_path_factory).path
    import shutil

    shutil.copytree(path, tmp_path / "mixed")
    sd = load_file(str(tmp_path / "mixed" / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    sd[name] = ref_moe.dequantize_fp8_blocks(sd[name], sd.pop(name + "_scale_inv"))
    save_file(sd, str(tmp_path / "mixed" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', chr(92) + '.')}.*fp8_experts='dequantize'"):
        llm(tmp_path / "mixed")
    net = llm(tmp_path / "mixed", fp8_experts="dequantize").engine.model
    assert net.model.layers[1].mlp.w13.dtype == torch.float32


def test_blocks_the_kernel_cannot_take_stay_dequantized(tmp_path_factory, tmp_path):
    write_fp8_checkpoint(fp8_ckpt("mixtral", tmp_path_factory).src, tmp_path / "b32", quantizable, block=(32, 32))
    net = llm(tmp_path / "b32").engine.model
    assert all(p.dtype == torch.float32 for p in expert_params(net).values())
    assert not any("_scale_inv" in n for n, _ in net.named_parameters())


def test_fp8_experts_setting_is_validated(tmp_path_factory):
    path = fp8_ckpt("qwen3-moe", tmp_path_factory).path
    with pytest.raises(ValueError, match=r"EngineConfig\.fp8_experts='bf16' is invalid"):
        llm(path, fp8_experts="bf16")


def test_dummy_weights_of_an_fp8_checkpoint(tmp_path_factory):
    path = fp8_ckpt("qwen3-moe", tmp_path_factory).path
    net = llm(path, load_format="dummy").engine.model
    mlp = net.model.layers[1].mlp
    assert mlp.w13.dtype == FP8 and torch.all(mlp.w13_scale_inv == 0.02)
    with torch.no_grad():
        assert torch.isfinite(net.forward_full(torch.tensor(PROMPTS[0]))).all()


# ------------------------------------------------------------------------------------------- the fused kernel
@pytest.fixture
def kernel_ops():
    """NvidiaOps whose MoE runs the fused Triton kernel: on CUDA, or in Triton's interpreter on the CPU
    (TRITON_INTERPRET=1, which tests/conftest.py sets without CUDA)."""
    pytest.importorskip("triton")
    from deepinfer.backends.nvidia.ops import INTERPRET, NvidiaOps

    if not HAS_CUDA and not INTERPRET:
        pytest.skip("no CUDA and the kernels were not built for Triton's interpreter")
    return NvidiaOps(DEV)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("E,k,shared,T", [(4, 2, 1, 9), (3, 1, 0, 17)])
def test_ced_moe_through_the_fused_kernel(kernel_ops, fp8, E, k, shared, T):
    """Tiny CED layers (float32) through the kernel, FP8 experts or not, against the reference module."""
    model = draw_ced(E, k, shared, 1.5, 0.5, T, kernel_ops, F=128 if fp8 else 32)
    layer = model.layers[1]
    if fp8:
        store_experts_fp8(model, (128, 128))
        g = gen(T)
        with torch.no_grad():
            for w, (E_, R, C) in (("w13", (E, 256, 32)), ("w2", (E, 32, 128))):
                q, s, _ = fp8_experts(g, E_, R, C)
                getattr(layer, w).copy_(q)
                getattr(layer, w + "_scale_inv").copy_(s)
    model.to(DEV)
    x = torch.randn(T, 32, generator=gen(T + 1)).to(DEV)
    with torch.no_grad():
        y, ids = layer.moe(x)
        deq = [ref_moe.dequantize_fp8_blocks(getattr(layer, w), getattr(layer, w + "_scale_inv")) if fp8 else None
               for w in ("w13", "w2")]
        want, want_ids = old_ced_moe(layer, x, *deq)
    assert kernel_ops.kernel_calls["fused_moe"] == 1
    assert torch.equal(ids, want_ids) and rel_err(y, want) < 1e-5


def test_deepseek_v3_fp8_checkpoint_through_the_fused_kernel(kernel_ops, tmp_path_factory):
    """The served FP8 experts of a checkpoint, their MoE blocks on the kernel, against the dequantized path."""
    path = fp8_ckpt("deepseek_v3", tmp_path_factory).path
    fp8 = llm(path, backend="reference", device=str(DEV)).engine.model
    deq = llm(path, backend="reference", device=str(DEV), fp8_experts="dequantize").engine.model
    for block in fp8.moe_blocks():
        block.ops = kernel_ops
    with torch.no_grad():
        ids = torch.tensor(PROMPTS[1], device=DEV)
        assert rel_err(fp8.forward_full(ids), deq.forward_full(ids)) < 1e-5
    assert kernel_ops.kernel_calls["fused_moe"] == 2  # the two MoE layers


# ------------------------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_deepseek_v3_fp8_experts_through_the_fused_kernel(tmp_path_factory):
    """bf16 activations: the kernel scales float32 block products (w8a16) where the dequantized path rounds
    weight x scale to bf16 first, so logits agree to bf16 rounding and greedy tokens part only at near-ties
    (of the dequantized run's own logprobs)."""
    from deepinfer.testing.compare import NEAR_TIE, assert_greedy_matches

    path = fp8_ckpt("deepseek_v3", tmp_path_factory).path
    fp8 = llm(path, dtype="bfloat16", device="cuda")
    deq = llm(path, dtype="bfloat16", device="cuda", fp8_experts="dequantize")
    assert fp8.engine.model.model.layers[1].mlp.w13.dtype == FP8
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor(p, device="cuda")
            assert rel_err(fp8.engine.model.forward_full(ids), deq.engine.model.forward_full(ids)) < 2e-2
    calls = fp8.engine.ops.kernel_calls
    before = calls["fused_moe"]
    tokens = greedy(fp8)
    assert calls["fused_moe"] > before  # decode replays CUDA graphs, which count no call; prefill runs eagerly
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in deq.generate(PROMPTS, params, use_tqdm=False)]
    assert_greedy_matches(tokens, [o.token_ids for o in outs], [o.logprobs for o in outs],
                          bound=NEAR_TIE["bfloat16"], what="FP8 experts vs dequantized bf16")
