"""The Triton rotary-embedding kernel against the reference op (models.rope.rotate).

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)
on tiny shapes; the GPU-only tests use Llama-3.1-8B and DeepSeek-V3 shapes and a CUDA-graph capture.
The kernel does the reference's float32 operations with FMA fusion off, so outputs must be bit-identical
in float32, bfloat16 and float16 (stronger than the 1-ulp / 1e-6 bounds asked of it). A compile test
builds the rope and KV-write kernels for sm_90 (no GPU needed), since CPU CI never runs compiled code.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from deepinfer.testing.kernels import (DEV, HAS_CUDA, capture_graph, examples, gen, gpu, run_compile_script,
                                       skip_module_without_kernels)

skip_module_without_kernels()

from deepinfer.backends.nvidia import triton_rope  # noqa: E402
from deepinfer.backends.nvidia.ops import NvidiaOps  # noqa: E402
from deepinfer.backends.reference.ops import ReferenceOps  # noqa: E402
from deepinfer.models.rope import RotaryEmbedding, rope_parameters, rotate  # noqa: E402

FAST = examples(25)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN_DSV3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def cache_for(rope: dict, head_dim: int, rotary_dim: int, max_pos: int) -> torch.Tensor:
    cfg = {"rope_parameters": rope, "partial_rotary_factor": rotary_dim / head_dim, "max_position_embeddings": 131072}
    return RotaryEmbedding(rope_parameters(cfg, head_dim), max_pos, device=DEV).cos_sin_cache


def qk_views(g, T, H, Hk, Dq, Dk, dtype, strided: bool):
    """q [T, H, Dq], k [T, Hk, Dk]: contiguous, or strided views out of one fused projection row."""
    if not strided:
        return ((torch.randn(T, H, Dq, generator=g) * 3).to(DEV, dtype),
                (torch.randn(T, Hk, Dk, generator=g) * 3).to(DEV, dtype))
    fused = (torch.randn(T, H * Dq + Hk * Dk + 5, generator=g) * 3).to(DEV, dtype)
    return fused[:, :H * Dq].view(T, H, Dq), fused[:, H * Dq:H * Dq + Hk * Dk].view(T, Hk, Dk)


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out, ref), f"max diff {(out.double() - ref.double()).abs().max().item():.3g}"


@FAST
@given(T=st.integers(0, 6), H=st.integers(1, 5), Hk=st.integers(1, 3), D=st.sampled_from([8, 16, 24, 64]),
       partial=st.sampled_from([1.0, 0.5, 0.25]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       interleaved=st.booleans(), strided=st.booleans(), pos32=st.booleans(), seed=st.integers(0, 2**16))
def test_rotary_matches_reference_bit_for_bit(T, H, Hk, D, partial, dtype, interleaved, strided, pos32, seed):
    g = gen(seed)
    R = max(2, int(D * partial) // 2 * 2)
    cs = cache_for(LLAMA3 if seed % 2 else YARN_DSV3, D, R, 300)
    q, k = qk_views(g, T, H, Hk, D, D, dtype, strided)
    pos = torch.randint(0, 300, (T,), generator=g).to(DEV, torch.int32 if pos32 else torch.int64)
    q0, k0 = q.clone(), k.clone()
    qo, ko = triton_rope.apply_rotary(q, k, pos, cs, interleaved)
    qr, kr = rotate(q, k, pos, cs, interleaved)
    assert torch.equal(q, q0) and torch.equal(k, k0), "inputs must not be modified"
    assert_same_bits(qo, qr)
    assert_same_bits(ko, kr)
    assert qo.is_contiguous() and ko.is_contiguous()


def test_q_and_k_of_different_head_dims_and_deepseek_views():
    """MLA: q_pe is the last 8 channels of each [nope + rope] head, k_pe a slice of the latent row."""
    g = gen(1)
    T, H, nope, rope_d, r = 5, 4, 16, 8, 24
    q = torch.randn(T, H, nope + rope_d, generator=g).to(DEV)
    kv = torch.randn(T, r + rope_d, generator=g).to(DEV)
    q_pe = q.split([nope, rope_d], dim=-1)[1]
    k_pe = kv.split([r, rope_d], dim=-1)[1].reshape(T, 1, rope_d)
    assert not q_pe.is_contiguous() and not k_pe.is_contiguous()
    cs = cache_for(YARN_DSV3, rope_d, rope_d, 64)
    pos = torch.tensor([0, 3, 63, 3, 10], device=DEV)
    for interleaved in (True, False):
        got = triton_rope.apply_rotary(q_pe, k_pe, pos, cs, interleaved)
        for a, b in zip(got, rotate(q_pe, k_pe, pos, cs, interleaved)):
            assert_same_bits(a, b)
    # Different head dims for q and k, with pass-through channels on both.
    qq, kk = torch.randn(T, 3, 32, generator=g).to(DEV), torch.randn(T, 2, 24, generator=g).to(DEV, torch.bfloat16)
    cs16 = cache_for(LLAMA3, 32, 16, 64)
    for a, b in zip(triton_rope.apply_rotary(qq, kk, pos, cs16, False), rotate(qq, kk, pos, cs16, False)):
        assert_same_bits(a, b)


def test_rotary_embedding_routes_through_ops():
    ops = NvidiaOps(DEV)
    for rope, neox in ((LLAMA3, True), (YARN_DSV3, False)):
        params = rope_parameters({"rope_parameters": rope, "max_position_embeddings": 131072}, 32)
        plain = RotaryEmbedding(params, 64, device=DEV, is_neox_style=neox)
        via_ops = RotaryEmbedding(params, 64, device=DEV, is_neox_style=neox, ops=ops)
        pos = torch.tensor([1, 2, 100], device=DEV)  # 100 grows both caches
        q = torch.randn(3, 4, 32, generator=gen(2)).to(DEV, torch.bfloat16)
        k = torch.randn(3, 2, 32, generator=gen(3)).to(DEV, torch.bfloat16)
        for a, b in zip(via_ops(pos, q, k), plain(pos, q, k)):
            assert_same_bits(a, b)
    assert ops.kernel_calls["apply_rotary"] == 2
    # A bfloat16 cache rounds every step: the reference op serves it.
    low = RotaryEmbedding(params, 64, dtype=torch.bfloat16, device=DEV, is_neox_style=neox, ops=ops)
    ref = RotaryEmbedding(params, 64, dtype=torch.bfloat16, device=DEV, is_neox_style=neox, ops=ReferenceOps(DEV))
    for a, b in zip(low(pos, q, k), ref(pos, q, k)):
        assert_same_bits(a, b)
    assert ops.kernel_calls["apply_rotary"] == 2


def test_bad_inputs_name_the_argument():
    q, k = torch.randn(3, 2, 16, device=DEV), torch.randn(3, 1, 16, device=DEV)
    cs = cache_for(LLAMA3, 16, 16, 8)
    pos = torch.arange(3, device=DEV)
    with pytest.raises(ValueError, match="positions"):
        triton_rope.apply_rotary(q, k, pos.float(), cs, False)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        triton_rope.apply_rotary(q, k, pos, cs.double(), False)
    with pytest.raises(ValueError, match="k has 2 tokens, q has 3"):
        triton_rope.apply_rotary(q, k[:2], pos, cs, False)
    with pytest.raises(ValueError, match="q must be"):
        triton_rope.apply_rotary(q.double(), k, pos, cs, False)
    with pytest.raises(ValueError, match="cos_sin_cache's rotary dim 16"):
        triton_rope.apply_rotary(q[..., :8], k[..., :8], pos, cs, False)  # rotary dim 16 > head dim 8


@pytest.mark.skipif(HAS_CUDA, reason="drives the engine forward on the CPU, through Triton's interpreter")
def test_llama_engine_forward_runs_the_rope_and_kv_write_kernels():
    from deepinfer.models.llama import LlamaForCausalLM
    from deepinfer.testing.engine import paged_prefill_logits

    hf = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=97, max_position_embeddings=256,
              rope_scaling=dict(LLAMA3, original_max_position_embeddings=64))
    torch.manual_seed(0)
    ref_net = LlamaForCausalLM(hf, ReferenceOps("cpu"))
    ops = NvidiaOps("cpu")
    net = LlamaForCausalLM(hf, ops)
    net.load_state_dict(ref_net.state_dict())
    prompts = [[1, 5, 9, 3, 7, 11, 2], [2, 4, 6]]
    for got, want in zip(paged_prefill_logits(net, prompts, 4, 3), paged_prefill_logits(ref_net, prompts, 4, 3)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert ops.kernel_calls["apply_rotary"] > 0 and ops.kernel_calls["write_kv"] > 0


# ------------------------------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.parametrize("T", [1, 256, 8192])
def test_gpu_llama8b_and_deepseek_v3_shapes(T):
    g = gen(T)
    pos = torch.randint(0, 131072, (T,), generator=g).to(DEV)
    cs = cache_for(LLAMA3, 128, 128, 131072)
    qkv = torch.randn(T, (32 + 2 * 8) * 128, generator=g).to(DEV, torch.bfloat16)  # Llama-3.1-8B: 32 q, 8 kv heads
    q, k = qkv[:, :4096].view(T, 32, 128), qkv[:, 4096:5120].view(T, 8, 128)
    for a, b in zip(triton_rope.apply_rotary(q, k, pos, cs, False), rotate(q, k, pos, cs, False)):
        assert_same_bits(a, b)
    # DeepSeek-V3: 128 heads of nope 128 + rope 64; the shared k_pe sits after the 512-wide latent.
    cs = cache_for(YARN_DSV3, 64, 64, 163840)
    pos = torch.randint(0, 163840, (T,), generator=g).to(DEV)
    qf = torch.randn(T, 128, 192, generator=g).to(DEV, torch.bfloat16)
    kv = torch.randn(T, 576, generator=g).to(DEV, torch.bfloat16)
    q_pe, k_pe = qf[..., 128:], kv[:, 512:].reshape(T, 1, 64)
    for a, b in zip(triton_rope.apply_rotary(q_pe, k_pe, pos, cs, True), rotate(q_pe, k_pe, pos, cs, True)):
        assert_same_bits(a, b)
    q32, k32 = q.float(), k.float()
    cs = cache_for(LLAMA3, 128, 128, 131072)
    pos = pos % 131072
    for a, b in zip(triton_rope.apply_rotary(q32, k32, pos, cs, False), rotate(q32, k32, pos, cs, False)):
        assert (a - b).abs().max().item() <= 1e-6  # the asked-for bound; bit-identical is expected
        assert_same_bits(a, b)


@gpu
def test_gpu_rotary_in_cuda_graph():
    T = 64
    g = gen(5)
    cs = cache_for(LLAMA3, 128, 128, 8192)
    q = torch.randn(T, 32, 128, generator=g).to(DEV, torch.bfloat16)
    k = torch.randn(T, 8, 128, generator=g).to(DEV, torch.bfloat16)
    pos = torch.randint(0, 8192, (T,), generator=g).to(DEV)

    def run():
        return triton_rope.apply_rotary(q, k, pos, cs, False)

    graph, (qo, ko) = capture_graph(run)
    for _ in range(3):
        q.copy_(torch.randn(q.shape, generator=g).to(q))
        k.copy_(torch.randn(k.shape, generator=g).to(k))
        pos.copy_(torch.randint(0, 8192, (T,), generator=g).to(DEV))
        graph.replay()
        torch.cuda.synchronize()
        qr, kr = rotate(q, k, pos, cs, False)
        assert_same_bits(qo, qr)
        assert_same_bits(ko, kr)


# ------------------------------------------------------------------------------------------- compiled path
_COMPILE_SCRIPT = r'''
import json
from deepinfer.backends.nvidia import triton_kv_write as kw, triton_rope as tr
from deepinfer.testing.kernels import compile_sm90, sass_row

assert not tr.INTERPRET
report = {}


def compile_(fn, name, sig, const, div16=(), **opts):
    k = compile_sm90(fn, sig, const, div16, **opts)
    report[name] = sass_row(k, r"\b(LDG\.E\.128|STG\.E\.128|STL|LDL)\b", ffma="fma.rn" in k.asm["ptx"])


ints = lambda names: {n: "i32" for n in names.split()}
rope_ints = ("stride_qt stride_qh stride_kt stride_kh stride_qot stride_qoh stride_kot stride_koh stride_pos stride_cs "
             "H HK DQ DK HALF NQT")
kv_ints = "stride_kt stride_kh stride_vt stride_vh stride_kcs stride_kch stride_vcs stride_vch stride_slot HK DK DV"
for dt in ("bf16", "fp32"):
    p = "*" + dt
    for interleaved in (False, True):
        cfg = tr.launch_config(32, 8, 64, 128, 128, 128)
        compile_(tr._rope_kernel, f"rope_{dt}_{'gptj' if interleaved else 'neox'}",
                 dict(q_ptr=p, k_ptr=p, qo_ptr=p, ko_ptr=p, pos_ptr="*i64", cs_ptr="*fp32", **ints(rope_ints)),
                 dict(BLOCK_H=cfg["BLOCK_H"], BLOCK_R=cfg["BLOCK_R"], BLOCK_PQ=0, BLOCK_PK=0, INTERLEAVED=interleaved),
                 div16=[n for n in rope_ints.split() if n not in ("stride_pos", "H", "HK", "NQT")],
                 num_warps=cfg["num_warps"], enable_fp_fusion=False)
    compile_(tr._rope_kernel, f"rope_{dt}_partial",
             dict(q_ptr=p, k_ptr=p, qo_ptr=p, ko_ptr=p, pos_ptr="*i32", cs_ptr="*fp32", **ints(rope_ints)),
             dict(BLOCK_H=16, BLOCK_R=16, BLOCK_PQ=64, BLOCK_PK=64, INTERLEAVED=False),
             num_warps=4, enable_fp_fusion=False)
    for cache in ("bf16", "fp32"):
        cfg = kw.launch_config(8, 128, 128)
        compile_(kw._write_kv_kernel, f"kv_{dt}_to_{cache}",
                 dict(k_ptr=p, v_ptr=p, kc_ptr="*" + cache, vc_ptr="*" + cache, slot_ptr="*i64", **ints(kv_ints)),
                 dict(BLOCK_H=cfg["BLOCK_H"], BLOCK_DK=128, BLOCK_DV=128),
                 div16=[n for n in kv_ints.split() if n not in ("stride_slot", "HK")], num_warps=cfg["num_warps"])
print(json.dumps(report))
'''


def test_rope_and_kv_write_compile_for_hopper():
    """Both kernels compile for sm_90; rope has no FMA (rounding as the reference); the Llama-sized launches
    use 16-byte loads and stores; nothing spills."""
    report = run_compile_script(_COMPILE_SCRIPT)
    assert len(report) == 2 * (3 + 2)
    for name, row in report.items():
        if name.startswith("rope"):
            assert not row["ffma"], f"{name}: FMA contraction would change the rounding"
        sass = row.get("sass")
        if sass is None:
            continue  # no cuobjdump in this triton install
        assert sass.get("STL", 0) == 0 and sass.get("LDL", 0) == 0, f"{name}: local-memory spills: {sass}"
        if "partial" not in name:
            assert sass.get("LDG.E.128", 0) > 0 and sass.get("STG.E.128", 0) > 0, (name, sass)
