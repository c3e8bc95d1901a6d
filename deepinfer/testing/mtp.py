"""DeepSeek-V3 multi-token-prediction (MTP) layers for tests: write one into a tiny checkpoint, and an independent
float64 oracle of the module over a whole sequence.

The oracle is plain dense math over the checkpoint's tensors (RMS norms, MLA unabsorbed with interleaved rotary
at the default rope, noaux_tc routing with every expert computed densely); it shares no code with
models/deepseek.py or models/deepseek_mtp.py. It supports the default rope only (no YaRN): enough to check the
module's wiring, which is what it is for.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F


def add_mtp_layer(path, seed: int = 0, std: float = 0.1) -> None:
    """Write MTP module 0 into the one-file checkpoint at ``path``: its block a fresh random copy of the last
    layer's shapes (MoE when that layer is), enorm, hnorm, eh_proj, shared_head.{norm,head}, and the embedding
    stored again (as DeepSeek-V3 ships it); config.json's num_nextn_predict_layers = 1."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    L, d, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)

    def draw(name: str, shape) -> torch.Tensor:
        noise = torch.randn(shape, generator=g)
        if "norm" in name:
            return 1 + 0.2 * noise
        return (0.1 if name.endswith("e_score_correction_bias") else std) * noise

    src, dst = f"model.layers.{L - 1}.", f"model.layers.{L}."
    new = {dst + n[len(src):]: draw(n, t.shape) for n, t in tensors.items() if n.startswith(src)}
    for name, shape in [("enorm.weight", (d,)), ("hnorm.weight", (d,)), ("eh_proj.weight", (d, 2 * d)),
                        ("shared_head.norm.weight", (d,)), ("shared_head.head.weight", (V, d))]:
        new[dst + name] = draw(name, shape)
    new[dst + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors.update(new)
    save_file(tensors, str(path / "model.safetensors"))
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate_pairs(x, theta: float):
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [n, ..., rope] at positions 0..n-1 by angle pos * theta^(-2i/rope)."""
    n, rope = x.shape[0], x.shape[-1]
    freq = theta ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * freq[None, :]  # [n, rope/2]
    shape = (n,) + (1,) * (x.dim() - 2) + (rope // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def _mla(x, W, cfg):
    n, H = x.shape[0], cfg["num_attention_heads"]
    nope, rope, dv, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    if cfg.get("q_lora_rank"):
        q = _rms(x @ W("self_attn.q_a_proj.weight").T, W("self_attn.q_a_layernorm.weight"), 1e-6) \
            @ W("self_attn.q_b_proj.weight").T
    else:
        q = x @ W("self_attn.q_proj.weight").T
    q = q.view(n, H, nope + rope)
    a = x @ W("self_attn.kv_a_proj_with_mqa.weight").T
    c_kv, k_pe = _rms(a[:, :r], W("self_attn.kv_a_layernorm.weight"), 1e-6), a[:, r:]
    kv = (c_kv @ W("self_attn.kv_b_proj.weight").T).view(n, H, nope + dv)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    q_pe, k_pe = _rotate_pairs(q[..., nope:], theta), _rotate_pairs(k_pe, theta)  # [n, H, rope], [n, rope]
    scores = (torch.einsum("thc,shc->hts", q[..., :nope], kv[..., :nope])
              + torch.einsum("thc,sc->hts", q_pe, k_pe)) * (nope + rope) ** -0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shv->thv", scores.softmax(-1), kv[..., nope:])
    return o.reshape(n, H * dv) @ W("self_attn.o_proj.weight").T


def _swiglu(x, W, prefix):
    return (F.silu(x @ W(prefix + "gate_proj.weight").T) * (x @ W(prefix + "up_proj.weight").T)) \
        @ W(prefix + "down_proj.weight").T


def _moe(x, W, cfg):
    """noaux_tc: sigmoid scores, bias for the choice only, groups scored by their top-2 sum, every expert dense."""
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    s = torch.sigmoid(x @ W("mlp.gate.weight").T)  # [n, E]
    choice = s + W("mlp.gate.e_score_correction_bias")
    G, keep = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    group = choice.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)  # [n, G]
    kept = torch.zeros_like(group, dtype=torch.bool).scatter(1, group.topk(keep, dim=-1).indices, True)
    choice = choice.masked_fill(~kept.repeat_interleave(E // G, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices  # [n, k]
    w = s.gather(1, ids)
    if cfg.get("norm_topk_prob", True):
        w = w / w.sum(-1, keepdim=True)
    w = w * cfg.get("routed_scaling_factor", 1.0)
    out = _swiglu(x, W, "mlp.shared_experts.") if cfg.get("n_shared_experts") else torch.zeros_like(x)
    for e in range(E):
        weight = (w * (ids == e)).sum(-1, keepdim=True)  # [n, 1]
        out = out + weight * _swiglu(x, W, f"mlp.experts.{e}.")
    return out


def mtp_logits_oracle(tensors: dict, cfg: dict, tokens: list, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP module's logits [n, V] (float64) over a whole sequence: row t (t = 0..n-1) from the target's final
    hidden state hidden[t] and the token after it, tokens[t + 1] (so it predicts tokens[t + 2]); n = len(tokens) - 1.
    tensors: the checkpoint's tensors by name; cfg: its config.json."""
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    p = f"model.layers.{L}."

    def W(name):
        return tensors[p + name].double()

    n = len(tokens) - 1
    embed = tensors["model.embed_tokens.weight"].double()[torch.tensor(tokens[1:])]
    z = torch.cat([_rms(embed, W("enorm.weight"), eps), _rms(hidden[:n].double(), W("hnorm.weight"), eps)], -1) \
        @ W("eh_proj.weight").T
    h = z + _mla(_rms(z, W("input_layernorm.weight"), eps), W, cfg)
    y = _rms(h, W("post_attention_layernorm.weight"), eps)
    h = h + (_moe(y, W, cfg) if p + "mlp.gate.weight" in tensors else _swiglu(y, W, "mlp."))
    return _rms(h, W("shared_head.norm.weight"), eps) @ W("shared_head.head.weight").T
