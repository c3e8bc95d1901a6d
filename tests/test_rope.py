"""RoPE: config normalisation, inverse frequencies and rotation checked against transformers."""

import math

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

from deepinfer.models.rope import RotaryEmbedding, rope_parameters

HEAD_DIM = 64
MAX_POS = 16384

# transformers-5 style rope_parameters for each supported scaling type.
HF_ROPE = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 2048,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
             "original_max_position_embeddings": 4096},
    # DeepSeek-V3 style: mscale ratio, explicit betas, non-truncated ramp.
    "yarn_deepseek": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707,
        "beta_fast": 32, "beta_slow": 1, "truncate": False,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
        "original_max_position_embeddings": 8192, "attention_factor": 0.8, "beta_fast": 16.0,
    },
}


def llama_config(rope: dict, head_dim: int = HEAD_DIM, **extra) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
        max_position_embeddings=MAX_POS, rope_parameters=dict(rope), **extra,
    )


def phi_rotary(rope: dict, head_dim: int, partial: float) -> PhiRotaryEmbedding:
    """HF rotary module that honours partial_rotary_factor for every rope type (Llama's doesn't)."""
    cfg = transformers.PhiConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=MAX_POS,
        partial_rotary_factor=partial, rope_parameters=dict(rope),
    )
    return PhiRotaryEmbedding(cfg)


# ---------------------------------------------------------------------------------------------
# inverse frequencies and attention scaling
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HF_ROPE))
def test_inv_freq_matches_transformers(name):
    cfg = llama_config(HF_ROPE[name])
    hf = LlamaRotaryEmbedding(cfg)
    ours = RotaryEmbedding(rope_parameters(cfg.to_dict(), HEAD_DIM), max_position=64)
    assert ours.inv_freq.dtype == torch.float32
    assert ours.inv_freq.shape == (HEAD_DIM // 2,)
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_scaling == pytest.approx(hf.attention_scaling, rel=1e-12)
    if name.startswith("yarn"):
        assert ours.attention_scaling != 1.0  # the test would be vacuous otherwise


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn", "yarn_deepseek"])
@pytest.mark.parametrize("partial", [0.5, 0.25])
def test_inv_freq_partial_rotary_matches_transformers(name, partial):
    rope = dict(HF_ROPE[name], partial_rotary_factor=partial)
    cfg = llama_config(rope)
    hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg)
    params = rope_parameters(cfg.to_dict(), HEAD_DIM)
    assert params["rotary_dim"] == int(HEAD_DIM * partial)
    ours = RotaryEmbedding(params, max_position=8)
    assert ours.inv_freq.shape == (params["rotary_dim"] // 2,)
    torch.testing.assert_close(ours.inv_freq, hf_inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_scaling == pytest.approx(hf_scaling, rel=1e-12)


def test_yarn_factor_inferred_from_max_positions():
    # DeepSeek-style configs may leave factor null: it is max_position / original_max.
    rope = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096,
            "rope_theta": 10000.0}
    cfg = llama_config(rope)
    hf = LlamaRotaryEmbedding(cfg)
    params = rope_parameters(cfg.to_dict(), HEAD_DIM)
    assert params["factor"] == MAX_POS / 4096
    ours = RotaryEmbedding(params, max_position=8)
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_scaling == pytest.approx(hf.attention_scaling)


@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_dynamic_is_static_ntk_at_max_length(factor, partial):
    theta, original_max = 10000.0, 4096
    config = {"max_position_embeddings": original_max, "rope_theta": theta,
              "partial_rotary_factor": partial,
              "rope_scaling": {"type": "dynamic", "factor": factor}}
    params = rope_parameters(config, HEAD_DIM)
    ours = RotaryEmbedding(params, max_position=8)

    # Independent form: NTK base for seq_len = original_max * factor.
    d = int(HEAD_DIM * partial)
    base = theta * (factor * (original_max * factor) / original_max - (factor - 1)) ** (d / (d - 2))
    expected = torch.tensor([1.0 / base ** (2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    torch.testing.assert_close(ours.inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert ours.attention_scaling == 1.0

    # HF's dynamic function, evaluated at that same sequence length, agrees.
    cfg = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 2, num_attention_heads=2, head_dim=HEAD_DIM,
        max_position_embeddings=original_max,
        rope_parameters={"rope_type": "dynamic", "rope_theta": theta, "factor": factor,
                         "partial_rotary_factor": partial},
    )
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, seq_len=original_max * int(factor))
    torch.testing.assert_close(ours.inv_freq, hf_inv_freq, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# rotation
# ---------------------------------------------------------------------------------------------


def hf_rotate(rope, head_dim, partial, positions, q, k):
    """Phi's attention recipe: Llama's apply_rotary_pos_emb on the first rotary_dim channels."""
    emb = phi_rotary(rope, head_dim, partial)
    cos, sin = emb(q, positions[None, :])  # [1, T, rotary_dim]
    rd = cos.shape[-1]
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rd], k[..., :rd], cos[0], sin[0], unsqueeze_dim=1)
    return torch.cat((q_rot, q[..., rd:]), -1), torch.cat((k_rot, k[..., rd:]), -1)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(HF_ROPE)),
    num_tokens=st.integers(1, 12),
    q_heads=st.integers(1, 4),
    kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([8, 16, 32, 64, 80, 128]),
    partial=st.sampled_from([1.0, 0.5, 0.25]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rotation_matches_transformers(name, num_tokens, q_heads, kv_heads, head_dim, partial, seed):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    q = torch.randn(num_tokens, q_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    q_in, k_in = q.clone(), k.clone()

    config = {"max_position_embeddings": MAX_POS, "partial_rotary_factor": partial,
              "rope_parameters": HF_ROPE[name]}
    rope = RotaryEmbedding(rope_parameters(config, head_dim), max_position=4096)
    q_out, k_out = rope(positions, q, k)
    q_ref, k_ref = hf_rotate(HF_ROPE[name], head_dim, partial, positions, q, k)

    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)
    rd = int(head_dim * partial)
    assert torch.equal(q_out[..., rd:], q[..., rd:])  # pass-through channels untouched
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # inputs not modified


@pytest.mark.parametrize("name", ["default", "yarn_deepseek"])
def test_bf16_rotates_in_float32(name):
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4096, (16,), generator=gen)
    q = torch.randn(16, 4, HEAD_DIM, generator=gen).bfloat16()
    k = torch.randn(16, 2, HEAD_DIM, generator=gen).bfloat16()
    rope = RotaryEmbedding(rope_parameters({"rope_parameters": HF_ROPE[name]}, HEAD_DIM), 4096)
    q_out, k_out = rope(positions, q, k)
    assert q_out.dtype == torch.bfloat16 and k_out.dtype == torch.bfloat16

    # Exactly the float32 HF result rounded once to bf16...
    q32, k32 = hf_rotate(HF_ROPE[name], HEAD_DIM, 1.0, positions, q.float(), k.float())
    assert torch.equal(q_out, q32.bfloat16()) and torch.equal(k_out, k32.bfloat16())
    # ...and within bf16 tolerance of HF's own bf16 path (which rounds cos/sin first).
    q16, k16 = hf_rotate(HF_ROPE[name], HEAD_DIM, 1.0, positions, q, k)
    torch.testing.assert_close(q_out, q16, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(k_out, k16, rtol=2e-2, atol=2e-2)


def slow_interleaved(x, positions, inv_freq, scaling, rotary_dim):
    """Reference GPT-J style: channel pair (2i, 2i+1) rotated by angle pos * inv_freq[i]."""
    out = x.clone().double()
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for i in range(rotary_dim // 2):
                angle = float(positions[t]) * float(inv_freq[i])
                c, s = math.cos(angle) * scaling, math.sin(angle) * scaling
                a, b = float(x[t, h, 2 * i]), float(x[t, h, 2 * i + 1])
                out[t, h, 2 * i] = a * c - b * s
                out[t, h, 2 * i + 1] = b * c + a * s
    return out


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(["default", "yarn_deepseek", "llama3"]),
    num_tokens=st.integers(1, 5),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([4, 8, 16]),
    partial=st.sampled_from([1.0, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_interleaved_style_matches_per_pair_formula(name, num_tokens, heads, head_dim, partial, seed):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 300, (num_tokens,), generator=gen)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, 1, head_dim, generator=gen)
    config = {"max_position_embeddings": MAX_POS, "partial_rotary_factor": partial,
              "rope_parameters": HF_ROPE[name]}
    rope = RotaryEmbedding(rope_parameters(config, head_dim), 512, is_neox_style=False)
    q_out, k_out = rope(positions, q, k)
    rd = rope.rotary_dim
    for x, out in ((q, q_out), (k, k_out)):
        expected = slow_interleaved(x, positions, rope.inv_freq, rope.attention_scaling, rd)
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_neox_and_interleaved_differ_only_by_channel_layout():
    params = rope_parameters({"rope_parameters": HF_ROPE["llama3"]}, 16)
    neox = RotaryEmbedding(params, 64)
    gptj = RotaryEmbedding(params, 64, is_neox_style=False)
    positions = torch.tensor([0, 5, 63])
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    # Permute interleaved channels into halves layout: rotating then permuting must commute.
    perm = torch.cat((torch.arange(0, 16, 2), torch.arange(1, 16, 2)))
    q_g, k_g = gptj(positions, q, k)
    q_n, k_n = neox(positions, q[..., perm], k[..., perm])
    torch.testing.assert_close(q_g[..., perm], q_n)
    torch.testing.assert_close(k_g[..., perm], k_n)


def test_positions_past_cache_grow_it():
    params = rope_parameters({"rope_parameters": HF_ROPE["yarn"]}, 32)
    small, big = RotaryEmbedding(params, 16), RotaryEmbedding(params, 1024)
    positions = torch.tensor([3, 15, 16, 700])
    q, k = torch.randn(4, 2, 32), torch.randn(4, 1, 32)
    q_s, k_s = small(positions, q, k)
    q_b, k_b = big(positions, q, k)
    assert small.max_position >= 701
    assert small.cos_sin_cache.shape == (small.max_position, 32)
    torch.testing.assert_close(q_s, q_b, rtol=0, atol=0)
    torch.testing.assert_close(k_s, k_b, rtol=0, atol=0)


def test_empty_batch():
    rope = RotaryEmbedding(rope_parameters({}, 16), 8)
    q_out, k_out = rope(torch.empty(0, dtype=torch.long), torch.empty(0, 2, 16), torch.empty(0, 1, 16))
    assert q_out.shape == (0, 2, 16) and k_out.shape == (0, 1, 16)


def test_position_zero_is_identity_without_scaling():
    rope = RotaryEmbedding(rope_parameters({"rope_theta": 1e6}, 16), 8)
    q, k = torch.randn(2, 3, 16), torch.randn(2, 1, 16)
    q_out, k_out = rope(torch.zeros(2, dtype=torch.long), q, k)
    assert torch.equal(q_out, q) and torch.equal(k_out, k)


def test_call_rejects_bad_shapes():
    rope = RotaryEmbedding(rope_parameters({}, 16), 8)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="positions"):
        rope(pos[None], torch.randn(3, 2, 16), torch.randn(3, 1, 16))
    with pytest.raises(ValueError, match="q must be"):
        rope(pos, torch.randn(4, 2, 16), torch.randn(3, 1, 16))
    with pytest.raises(ValueError, match="k head_dim 8 < rotary_dim 16"):
        rope(pos, torch.randn(3, 2, 16), torch.randn(3, 1, 8))


# ---------------------------------------------------------------------------------------------
# config spellings
# ---------------------------------------------------------------------------------------------


def test_t4_and_t5_spellings_agree():
    t4 = {"rope_theta": 500000.0, "max_position_embeddings": 8192,
          "rope_scaling": {"type": "linear", "factor": 2.0}}
    t5 = {"max_position_embeddings": 8192,
          "rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}}
    p4, p5 = rope_parameters(t4, 64), rope_parameters(t5, 64)
    assert p4 == p5 == {"rope_type": "linear", "rope_theta": 500000.0, "rotary_dim": 64, "factor": 2.0}
    positions = torch.tensor([0, 1, 4000, 9000])
    q, k = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    for a, b in zip(RotaryEmbedding(p4, 8192)(positions, q, k), RotaryEmbedding(p5, 8192)(positions, q, k)):
        assert torch.equal(a, b)


def test_t4_config_object_roundtrip():
    # What a transformers-4 config.json looks like once transformers 5 loads and re-saves it.
    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, rope_theta=500000.0,
                                   rope_scaling={"type": "linear", "factor": 2.0})
    params = rope_parameters(cfg.to_dict(), 64)
    assert params == rope_parameters(
        {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}, 64)
    torch.testing.assert_close(RotaryEmbedding(params, 4).inv_freq, LlamaRotaryEmbedding(cfg).inv_freq)


def test_t4_llama3_uses_rope_type_key_and_top_level_theta():
    config = {"rope_theta": 500000.0, "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    params = rope_parameters(config, 128)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0
    assert params["original_max_position_embeddings"] == 8192


def test_original_max_falls_back_to_max_position_embeddings():
    config = {"max_position_embeddings": 32768,
              "rope_scaling": {"type": "yarn", "factor": 4.0}}
    params = rope_parameters(config, 64)
    assert params["original_max_position_embeddings"] == 32768
    assert params["beta_fast"] == 32.0 and params["beta_slow"] == 1.0 and params["truncate"] is True
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_parameters({"rope_scaling": {"type": "yarn", "factor": 4.0}}, 64)


def test_defaults_without_any_rope_fields():
    assert rope_parameters({}, 128) == {"rope_type": "default", "rope_theta": 10000.0, "rotary_dim": 128}
    assert rope_parameters({"rope_scaling": None, "rope_theta": None}, 128)["rope_theta"] == 10000.0


def test_partial_rotary_factor_either_place():
    top = rope_parameters({"partial_rotary_factor": 0.25}, 128)
    inner = rope_parameters({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}}, 128)
    assert top["rotary_dim"] == inner["rotary_dim"] == 32
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_parameters({"partial_rotary_factor": 0.3}, 10)  # int(3.0) = 3 is odd


def test_nested_per_layer_type():
    config = {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }}
    full = rope_parameters(config, 64, layer_type="full_attention")
    sliding = rope_parameters(config, 64, layer_type="sliding_attention")
    assert full == {"rope_type": "linear", "rope_theta": 1000000.0, "rotary_dim": 64, "factor": 8.0}
    assert sliding == {"rope_type": "default", "rope_theta": 10000.0, "rotary_dim": 64}
    with pytest.raises(ValueError, match="layer_type"):
        rope_parameters(config, 64)
    with pytest.raises(ValueError, match="'chunked'"):
        rope_parameters(config, 64, layer_type="chunked")
    # A flat dict applies to every layer type.
    flat = {"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}
    assert rope_parameters(flat, 8, layer_type="sliding_attention")["rope_theta"] == 5.0


@pytest.mark.parametrize("bad", ["longrope", "mrope", "su"])
def test_unknown_rope_type_names_it(bad):
    with pytest.raises(ValueError, match=rf"'{bad}'.*default, linear, dynamic, llama3, yarn"):
        rope_parameters({"rope_scaling": {"type": bad, "factor": 2.0}}, 64)


def test_missing_required_fields():
    with pytest.raises(ValueError, match="'factor'"):
        rope_parameters({"rope_scaling": {"type": "linear"}}, 64)
    with pytest.raises(ValueError, match="'low_freq_factor'"):
        rope_parameters({"max_position_embeddings": 8192,
                         "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 64)
