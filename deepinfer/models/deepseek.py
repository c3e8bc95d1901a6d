"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and DeepSeekMoE.

MLA. Per token, ``kv_a_proj_with_mqa`` gives a compressed latent ``c_kv`` [kv_lora_rank] (then RMS-normed by
``kv_a_layernorm``) and one rotary key ``k_pe`` [qk_rope_head_dim] shared by all heads; ``kv_b_proj`` expands
``c_kv`` into per-head ``k_nope`` [qk_nope_head_dim] and ``v`` [v_head_dim]. Queries come from ``q_proj``, or
from ``q_a_proj -> q_a_layernorm -> q_b_proj`` when ``q_lora_rank`` is set, and split into ``q_nope`` and
``q_pe``. A head's score is ``q_nope . k_nope + q_pe . k_pe``.

Two paths over the same weights:
  * engine (``forward``): the absorbed form. The paged cache holds only ``[c_kv, k_pe]`` per token
    (``kv_lora_rank + qk_rope_head_dim`` values per layer, one tensor [layers, slots, 1, r + rope]).
    ``q_nope`` is carried into the latent space through W_UK (``q_lat = q_nope @ W_UK``), so
    ``score = q_lat . c_kv + q_pe . k_pe``: multi-query attention with one KV head whose key is the whole
    cache row and whose value is its first ``r`` entries. The latent output ``P @ c_kv`` goes through W_UV,
    then ``o_proj``.
  * oracle (``forward_full``): the unabsorbed form, as transformers computes it: per-head K and V
    materialised from ``kv_b_proj``, causal mask over the whole sequence.

Rotary: DeepSeek-V2 rotates adjacent pairs (interleaved); DeepSeek-V3 does so when ``rope_interleave`` (the
default), else rotates halves. YaRN scales cos/sin by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
and, as DeepSeek does, the softmax scale by ``mscale(factor, mscale_all_dim) ** 2``.

MoE layers (layer i is sparse when ``n_routed_experts`` and i >= ``first_k_dense_replace`` and
i % ``moe_layer_freq`` == 0; the rest use a dense SwiGLU MLP of ``intermediate_size``): a MoEBlock with
``n_shared_experts x moe_intermediate_size`` shared experts. Routers, as transformers 5.24 computes them:
  * V2: softmax scores; ``topk_method`` "greedy" or "group_limited_greedy" (``n_group`` groups scored by
    their best expert, ``topk_group`` kept); weights times ``routed_scaling_factor``, never renormalised
    (transformers ignores ``norm_topk_prob`` for V2).
  * V3 (``noaux_tc``): sigmoid scores; ``e_score_correction_bias`` added for selection only; groups scored by
    the sum of their top-2; weights renormalised when ``norm_topk_prob``; times ``routed_scaling_factor``.

DeepSeek-V3 checkpoints also carry ``num_nextn_predict_layers`` multi-token-prediction (MTP) layers stored as
``model.layers.{num_hidden_layers + j}``; the target skips them on load (with one info line), and the ``mtp``
draft stage loads them for itself (models/deepseek_mtp.py).
"""

from __future__ import annotations

import logging
import math
import re
from typing import Iterable, Optional

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from .base import CausalLM, WeightError, hf_get
from .expert_load import ExpertLoad
from .llama import RMSNorm
from .moe import MoEBlock, MoEModel
from .rope import RotaryEmbedding, rope_parameters
from .weights import FusedCheckpoint

log = logging.getLogger(__name__)

# transformers (and DeepSeek's own code) build q_a_layernorm / kv_a_layernorm with the default eps, not
# rms_norm_eps.
LATENT_NORM_EPS = 1e-6
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


@attrs.frozen
class DeepseekConfig:
    version: int  # 2 or 3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: dict
    rope_interleave: bool
    softmax_scale: float
    moe_layers: tuple  # layer indices with a MoE block
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int
    router: dict  # MoEBlock routing kwargs
    num_mtp_layers: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict, arch: str) -> "DeepseekConfig":
        version = 3 if arch == "DeepseekV3ForCausalLM" else 2
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for key in required:
            if hf.get(key) is None:
                raise ValueError(f"config.json for {arch} lacks required field {key!r}")
        n_layers, rope_dim = hf["num_hidden_layers"], hf["qk_rope_head_dim"]
        rope = rope_parameters(hf, rope_dim)
        if rope["rotary_dim"] != rope_dim:
            raise ValueError(f"config.json: partial_rotary_factor is not supported by {arch} "
                             f"(rotary dim {rope['rotary_dim']} != qk_rope_head_dim {rope_dim})")
        qk_head_dim = hf["qk_nope_head_dim"] + rope_dim
        scale = qk_head_dim ** -0.5
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            m = _mscale(rope["factor"], rope["mscale_all_dim"])
            scale *= m * m
        interleave = True if version == 2 else bool(hf.get("rope_interleave", True))

        E = hf_get(hf, "n_routed_experts", "num_local_experts", "num_experts")
        first_dense = int(hf.get("first_k_dense_replace") or 0)
        freq = int(hf.get("moe_layer_freq") or 1)
        moe_layers = tuple(i for i in range(n_layers) if E and i >= first_dense and i % freq == 0)
        top_k = hf_get(hf, "num_experts_per_tok", default=0)
        router: dict = {}
        if moe_layers:
            for key in ("moe_intermediate_size", "num_experts_per_tok"):
                if hf.get(key) is None:
                    raise ValueError(f"config.json for {arch} lacks required field {key!r} (it has MoE layers)")
            if hf.get("mlp_bias"):
                raise ValueError(f"{arch}: mlp_bias=true is not supported in MoE layers")
            router = cls._router(hf, arch, version)
        mtp = hf_get(hf, "num_nextn_predict_layers", "num_mtp_layers", default=1 if version == 3 else 0)
        return cls(
            version=version, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=n_layers, num_heads=hf["num_attention_heads"],
            q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=rope_dim, v_head_dim=hf["v_head_dim"],
            rms_eps=hf_get(hf, "rms_norm_eps", default=1e-6),
            max_position=hf_get(hf, "max_position_embeddings", default=4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
            rope=rope, rope_interleave=interleave, softmax_scale=scale, moe_layers=moe_layers,
            num_experts=int(E or 0), top_k=int(top_k or 0),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            n_shared_experts=int(hf.get("n_shared_experts") or 0), router=router, num_mtp_layers=int(mtp),
        )

    @staticmethod
    def _router(hf: dict, arch: str, version: int) -> dict:
        n_group, topk_group = hf.get("n_group"), hf.get("topk_group")
        scaling = float(hf_get(hf, "routed_scaling_factor", default=1.0))
        if version == 2:
            scoring = hf.get("scoring_func") or "softmax"
            if scoring != "softmax":
                raise ValueError(f"{arch}: scoring_func={scoring!r} is not supported (DeepSeek-V2 uses softmax)")
            method = hf.get("topk_method") or "greedy"
            if method == "greedy":
                n_group = topk_group = None
            elif method != "group_limited_greedy":
                raise ValueError(f"{arch}: topk_method={method!r} is not supported; expected 'greedy' or "
                                 "'group_limited_greedy'")
            elif n_group is None or topk_group is None:
                raise ValueError(f"{arch}: topk_method='group_limited_greedy' needs n_group and topk_group")
            return dict(scoring="softmax", renormalize=False, scaling=scaling, n_group=n_group,
                        topk_group=topk_group, group_score="max", correction_bias=False)
        scoring = hf.get("scoring_func") or "sigmoid"
        if scoring != "sigmoid":
            raise ValueError(f"{arch}: scoring_func={scoring!r} is not supported (DeepSeek-V3 uses sigmoid)")
        method = hf.get("topk_method") or "noaux_tc"
        if method != "noaux_tc":
            raise ValueError(f"{arch}: topk_method={method!r} is not supported; DeepSeek-V3 routes with 'noaux_tc'")
        if n_group in (None, 1):  # one group: the group filter keeps every expert
            n_group = topk_group = None
        return dict(scoring="sigmoid", renormalize=bool(hf.get("norm_topk_prob", True)), scaling=scaling,
                    n_group=n_group, topk_group=topk_group, group_score="top2sum", correction_bias=True)


class MLAttention(nn.Module):
    """Multi-head latent attention. ``absorbed`` is the engine path, ``unabsorbed`` the oracle."""

    def __init__(self, c: DeepseekConfig, layer: int, rotary: RotaryEmbedding, ops):
        super().__init__()
        self.layer, self.ops, self.rotary = layer, ops, rotary
        self.h, self.r = c.num_heads, c.kv_lora_rank
        self.nope, self.rope, self.dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.scale = c.softmax_scale
        d, qd = c.hidden_size, c.num_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(d, qd, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = nn.Linear(c.q_lora_rank, qd, bias=False)
        self.q_lora = c.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(d, self.r + self.rope, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.r, LATENT_NORM_EPS, ops)
        self.kv_b_proj = nn.Linear(self.r, self.h * (self.nope + self.dv), bias=False)
        self.o_proj = nn.Linear(self.h * self.dv, d, bias=c.attention_bias)

    def _project(self, x, positions):
        """x [T, d] -> q_nope [T, H, nope], q_pe [T, H, rope] (rotated), c_kv [T, r] (normed), k_pe [T, 1, rope]."""
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(T, self.h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.r, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.reshape(T, 1, self.rope))
        return q_nope, q_pe, c_kv, k_pe

    def latent(self, x, positions) -> tuple:
        """The absorbed form's query [T, H, r + rope] (q_nope carried into the latent space through W_UK, beside
        q_pe) and cache rows [T, r + rope] (c_kv, k_pe) of x [T, d]."""
        T = x.shape[0]
        q_nope, q_pe, c_kv, k_pe = self._project(x, positions)
        w_uk = self.kv_b_proj.weight.view(self.h, self.nope + self.dv, self.r)[:, :self.nope]  # [H, nope, r]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, r]
        return torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1), torch.cat([c_kv, k_pe.reshape(T, self.rope)], dim=-1)

    def latent_out(self, o_lat):
        """Attention's latent output P @ c_kv [T, H, r] through W_UV and o_proj: [T, d]."""
        w_uv = self.kv_b_proj.weight.view(self.h, self.nope + self.dv, self.r)[:, self.nope:]  # [H, dv, r]
        o = torch.einsum("thr,hvr->thv", o_lat.to(w_uv.dtype), w_uv)  # [T, H, dv]
        return self.o_proj(o.reshape(o.shape[0], self.h * self.dv))

    def absorbed(self, x, positions, cache, meta):
        """Engine path. cache: this layer's [slots, 1, r + rope] rows of (c_kv, k_pe)."""
        q, row = self.latent(x, positions)
        cache.index_copy_(0, meta.slot_mapping, row.unsqueeze(1).to(cache.dtype))
        # MQA over the latent cache: one KV head, key = the whole row, value = its c_kv part.
        return self.latent_out(self.ops.paged_attention(q, cache, cache[..., :self.r], meta, self.scale))

    def unabsorbed(self, x, positions):
        """Oracle path over one whole sequence: per-head K and V materialised from kv_b_proj, causal mask."""
        L = x.shape[0]
        q_nope, q_pe, c_kv, k_pe = self._project(x, positions)
        kv = self.kv_b_proj(c_kv).view(L, self.h, self.nope + self.dv)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(L, self.h, self.rope)], dim=-1)  # [L, H, nope + rope]
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = self.ops.dense_attention(q, k, v, self.scale)  # [L, H, dv]
        return self.o_proj(o.reshape(L, self.h * self.dv))


class DenseMLP(nn.Module):
    """SwiGLU with gate and up fused on load (checkpoint: gate_proj, up_proj, down_proj)."""

    def __init__(self, hidden: int, inter: int, bias: bool, ops):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, c: DeepseekConfig, layer: int, rotary, ops, expert_load, moe_impl: str):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps, ops)
        self.self_attn = MLAttention(c, layer, rotary, ops)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps, ops)
        if layer in c.moe_layers:
            self.mlp = MoEBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.top_k, ops, layer=layer,
                                shared_size=c.n_shared_experts * c.moe_intermediate_size, naming="deepseek",
                                checkpoint_prefix=f"model.layers.{layer}.mlp", expert_load=expert_load,
                                impl=moe_impl, **c.router)
        else:
            self.mlp = DenseMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, ops)

    def forward(self, x, residual, attend):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = attend(self.self_attn, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, c: DeepseekConfig, ops, expert_load, moe_impl: str):
        super().__init__()
        rotary = RotaryEmbedding(c.rope, max_position=c.max_position, device=ops.device,
                                 is_neox_style=not c.rope_interleave, ops=ops)
        self.rotary = rotary  # shared by every layer
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i, rotary, ops, expert_load, moe_impl)
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps, ops)

    def forward(self, input_ids, attend):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, attend)
        return self.norm(x, residual)[0]


class DeepseekForCausalLM(MoEModel, FusedCheckpoint, CausalLM):
    ARCH = ""

    def __init__(self, hf_config: dict, ops):
        super().__init__()
        self.config = c = DeepseekConfig.from_hf(hf_config, self.ARCH)
        self.arch, self.ops = self.ARCH, ops
        self.vocab_size, self.max_position = c.vocab_size, c.max_position
        self.moe_layers = list(c.moe_layers)
        self.expert_load = ExpertLoad(self.moe_layers, c.num_experts, window=int(hf_config.get("expert_load_window")
                                                                                  or 64)) if c.moe_layers else None
        impl = hf_config.get("moe_impl") or "routed"
        self.model = Backbone(c, ops, self.expert_load, impl)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        # Decode can be captured when nothing in it reads the host: routed experts on a backend whose MoE
        # kernels never sync (the reference's routed path reads expert counts back).
        self.supports_cuda_graphs = not c.moe_layers or (impl == "routed" and getattr(ops, "moe_capture_safe", False))

    def reserve_positions(self, n: int) -> None:
        """The engine never asks for a position >= n (max_model_len): size RoPE once, drop its checks."""
        self.model.rotary.reserve(n)

    # Engine path.
    def allocate_kv_cache(self, num_slots, dtype, device, **_):
        """One tensor [layers, slots, 1, kv_lora_rank + qk_rope_head_dim]: each token's (c_kv, k_pe) per layer."""
        c = self.config
        return torch.zeros(c.num_layers, num_slots, 1, c.kv_lora_rank + c.qk_rope_head_dim, dtype=dtype,
                           device=device)

    def kv_bytes_per_token(self, dtype):
        c = self.config
        return (c.kv_lora_rank + c.qk_rope_head_dim) * torch.empty(0, dtype=dtype).element_size() * c.num_layers

    def forward(self, input_ids, meta, kv_cache):
        positions = meta.positions

        def attend(attn, x):
            return attn.absorbed(x, positions, kv_cache[attn.layer], meta)

        return self.model(input_ids, attend)

    def compute_logits(self, hidden):
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w).float()

    # Oracle path.
    def forward_full(self, input_ids):
        pos = torch.arange(input_ids.shape[0], device=input_ids.device)

        def attend(attn, x):
            return attn.unabsorbed(x, pos)

        return self.compute_logits(self.model(input_ids, attend))

    # Weights.
    FUSED = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))  # the dense MLPs

    def _fused_splits(self, fused: str) -> list:
        return [self.config.intermediate_size] * 2

    def load_weights(self, weights: Iterable) -> None:
        """The backbone's tensors; those of the multi-token-prediction layers beyond num_hidden_layers are
        skipped with one log line (the mtp draft stage reads them itself)."""
        c = self.config
        mtp_layers: list = []

        def backbone():
            for name, tensor in weights:
                m = _LAYER.match(name)
                if m and int(m.group(1)) >= c.num_layers:
                    i = int(m.group(1))
                    if i >= c.num_layers + c.num_mtp_layers:
                        raise WeightError(f"checkpoint tensor {name!r} does not belong to {self.arch} (config: "
                                          f"{c.num_layers} layers + {c.num_mtp_layers} MTP layer(s))")
                    mtp_layers.append(i)
                    continue
                yield name, tensor

        super().load_weights(backbone())
        if mtp_layers:
            log.info("%s: skipped %d checkpoint tensor(s) of %d multi-token-prediction layer(s) (model.layers.%s; "
                     "num_nextn_predict_layers=%d): speculative_config method 'mtp' loads them for drafting",
                     self.arch, len(mtp_layers), len(set(mtp_layers)), ",".join(map(str, sorted(set(mtp_layers)))),
                     c.num_mtp_layers)

class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    ARCH = "DeepseekV2ForCausalLM"


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    ARCH = "DeepseekV3ForCausalLM"


MODELS = {cls.ARCH: cls for cls in (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)}
