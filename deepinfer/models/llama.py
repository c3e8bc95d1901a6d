"""The Llama family: Llama, Mistral, Qwen2 (qkv bias, sliding-window layers), Qwen3 (q/k norm).

One module, flags for the differences. Weights keep the checkpoint's names,
with q/k/v and gate/up fused on load (one matmul each instead of three/two).
"""

from __future__ import annotations

import logging

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from .base import CausalLM, hf_get
from .rope import RotaryEmbedding, rope_parameters
from .weights import FusedCheckpoint

log = logging.getLogger(__name__)


@attrs.frozen
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    windows: tuple  # per layer: None (full attention) or the sliding window size
    rope: dict

    @classmethod
    def from_hf(cls, hf: dict, arch: str) -> "LlamaConfig":
        try:
            hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
            n_layers = hf["num_hidden_layers"]
            vocab, inter = hf["vocab_size"], hf["intermediate_size"]
        except KeyError as exc:
            raise ValueError(f"config.json for {arch} lacks required field {exc.args[0]!r}") from None
        head_dim = hf_get(hf, "head_dim", default=hidden // heads)
        kv_heads = hf_get(hf, "num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        qwen = arch.startswith("Qwen")
        attn_bias = bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window")
        types = hf.get("layer_types")
        if types is not None:
            if len(types) != n_layers:
                raise ValueError(f"config.json: layer_types has {len(types)} entries for num_hidden_layers={n_layers}")
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        elif qwen:
            use = hf.get("use_sliding_window", False) and window is not None
            mwl = hf.get("max_window_layers", n_layers)
            windows = tuple(window if use and i >= mwl else None for i in range(n_layers))
        else:  # Mistral: every layer slides when sliding_window is set
            windows = (window,) * n_layers
        return cls(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=n_layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, rms_eps=hf_get(hf, "rms_norm_eps", default=1e-6),
            max_position=hf_get(hf, "max_position_embeddings", default=4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attn_bias, o_bias=attn_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=arch == "Qwen3ForCausalLM",
            windows=windows, rope=_full_head_rope(hf, head_dim, arch),
        )


def _full_head_rope(hf: dict, head_dim: int, arch: str) -> dict:
    """rope_parameters over the whole head: transformers' Llama-family attention rotates every channel and its
    default RoPE ignores partial_rotary_factor (Phi, GLM, NeoX-style models honour it; they are not served here),
    so the factor is dropped, with a warning, rather than rotating fewer channels than transformers does."""
    key = "partial_rotary_factor"

    def drop(d):
        return {k: drop(v) if isinstance(v, dict) else v for k, v in d.items() if k != key}

    def has(d):
        return isinstance(d, dict) and (d.get(key) not in (None, 1, 1.0) or any(has(v) for v in d.values()))

    if has(hf):
        log.warning("deepinfer: %s config.json sets %s; this architecture rotates the whole head in transformers, "
                    "so it is ignored", arch, key)
        hf = drop(hf)
    return rope_parameters(hf, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x, residual=None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig, layer: int, rotary: RotaryEmbedding, ops):
        super().__init__()
        self.h, self.hk, self.d = c.num_heads, c.num_kv_heads, c.head_dim
        self.layer, self.window, self.ops, self.rotary = layer, c.windows[layer], ops, rotary
        self.scale = self.d ** -0.5
        self.qkv_proj = nn.Linear(c.hidden_size, (self.h + 2 * self.hk) * self.d, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.d, c.rms_eps, ops)
            self.k_norm = RMSNorm(self.d, c.rms_eps, ops)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, positions, attend):
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.h * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        q, k, v = q.view(T, self.h, self.d), k.view(T, self.hk, self.d), v.view(T, self.hk, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = attend(self.layer, q, k, v, self.scale, self.window)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig, ops):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig, layer: int, rotary, ops, mlp_factory=None):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps, ops)
        self.self_attn = Attention(c, layer, rotary, ops)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps, ops)
        mlp = mlp_factory(layer) if mlp_factory is not None else None
        self.mlp = mlp if mlp is not None else MLP(c, ops)  # a factory returns None for a dense layer

    def forward(self, x, residual, positions, attend):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, attend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, c: LlamaConfig, ops, mlp_factory=None):
        super().__init__()
        rotary = RotaryEmbedding(c.rope, max_position=c.max_position, device=ops.device, ops=ops)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i, rotary, ops, mlp_factory) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps, ops)

    def forward(self, input_ids, positions, attend):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, attend)
        return self.norm(x, residual)[0]


# Checkpoint names fused on load: (fused param, checkpoint name, shard index).
_FUSED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
          ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


class LlamaForCausalLM(FusedCheckpoint, CausalLM):
    FUSED = _FUSED

    def __init__(self, hf_config: dict, ops, arch: str = "LlamaForCausalLM", mlp_factory=None):
        super().__init__()
        self.config = c = LlamaConfig.from_hf(hf_config, arch)
        self.arch, self.ops = arch, ops
        self.vocab_size, self.max_position = c.vocab_size, c.max_position
        self.model = Backbone(c, ops, mlp_factory)  # mlp_factory(layer) -> module or None (dense MLP)
        # Dense decode has no host sync once positions are reserved; routed MoE reads expert counts on the host.
        self.supports_cuda_graphs = mlp_factory is None
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)


    def reserve_positions(self, n: int) -> None:
        """The engine never asks for a position >= n (max_model_len): size RoPE once, drop its checks."""
        self.model.layers[0].self_attn.rotary.reserve(n)

    # Engine path.
    def allocate_kv_cache(self, num_slots, dtype, device, **_):
        c = self.config
        shape = (c.num_layers, num_slots, c.num_kv_heads, c.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def kv_bytes_per_token(self, dtype):
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty(0, dtype=dtype).element_size()

    def forward(self, input_ids, meta, kv_cache):
        kc, vc = kv_cache
        ops = self.ops

        def attend(layer, q, k, v, scale, window):
            ops.write_kv(kc[layer], vc[layer], k, v, meta.slot_mapping)
            return ops.paged_attention(q, kc[layer], vc[layer], meta, scale, window)

        return self.model(input_ids, meta.positions, attend)

    def compute_logits(self, hidden):
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w).float()

    # Oracle path.
    def forward_full(self, input_ids):
        ops = self.ops

        def attend(layer, q, k, v, scale, window):
            return ops.dense_attention(q, k, v, scale, window)

        pos = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.compute_logits(self.model(input_ids, pos, attend))

    # Weights.
    def _fused_splits(self, fused: str) -> list:
        c = self.config
        if fused == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]


def factory(arch: str):
    def make(hf_config: dict, ops):
        return LlamaForCausalLM(hf_config, ops, arch=arch)
    return make


ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
