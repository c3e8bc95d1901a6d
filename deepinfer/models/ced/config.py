"""The CED (causal encoder-decoder, DeepSeek-V4.1-Flash) configuration: every size and choice configurable.

config.json carries ``"architectures": ["CEDForCausalLM"]`` and the fields below
under their own names. Layer modes are a list with one entry per layer:
``swa`` (sliding window only), ``full`` (own compressed KV, indexer K and Q, fresh
top-K), ``reindex`` (reuses the latest full layer's KV and indexer K, own indexer
Q, fresh top-K) and ``reuse`` (reuses KV and the latest top-K; no indexer).
"""

from __future__ import annotations

import attrs

from ...backends.reference.lowbit import group_size

MODES = ("swa", "full", "reindex", "reuse")
KV_FORMATS = ("fp4_e2m1_e4m3", "mxfp4", "fp8_e4m3_pow2", "bf16", "fp32")
ARCH = "CEDForCausalLM"


class CEDConfigError(ValueError):
    """An inconsistent CED configuration; the message names the field."""


def _err(field, value, why):
    raise CEDConfigError(f"CED config {field}={value!r} is invalid: {why}")


@attrs.frozen
class CEDConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 8
    num_encoder_layers: int = 4  # the first layers; the rest are the decoder
    num_heads: int = 4
    head_dim: int = 64  # the shared MQA latent (K = V)
    rope_dim: int = 16  # rotary on the last rope_dim channels, adjacent pairs
    rope_theta: float = 10000.0
    q_lora_rank: int = 128  # query latent: W_qa -> RMSNorm -> W_qb
    out_groups: int = 2  # grouped output projection
    out_group_dim: int = 128  # width of each group's projection
    n_win: int = 16
    swa_allowance: int = 4  # extra ring slots for rejected speculative tokens
    layer_modes: tuple = ("swa", "full", "reuse", "reuse", "full", "reuse", "reindex", "reuse")
    encoder_ratio: int = 2  # compression ratio m of encoder full layers
    decoder_ratio: int = 1
    index_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 16
    pool_block: int = 4  # decoder hierarchical indexer: positions per candidate block
    pool_blocks: int = 8  # candidate blocks kept per query
    use_sink: bool = True
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    global_kv_format: str = "fp4_e2m1_e4m3"
    index_k_format: str = "mxfp4"
    swa_kv_format: str = "fp8_e4m3_pow2"
    fake_quant: bool = True  # quantize-dequantize KV in the full-sequence path too, so both paths agree
    replay_mode: str = "bounded"  # bounded: decoder prefill over the last n_win prompt tokens; exact: all of them

    def __attrs_post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank", "out_groups",
                     "out_group_dim", "index_heads", "index_head_dim", "n_routed_experts", "moe_intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _err(name, v, "must be an int >= 1")
        if not isinstance(self.n_shared_experts, int) or self.n_shared_experts < 0:
            _err("n_shared_experts", self.n_shared_experts, "must be an int >= 0")
        L, E = self.num_layers, self.num_encoder_layers
        if not 1 <= E < L:
            _err("num_encoder_layers", E, f"must be in [1, num_layers={L})")
        if len(self.layer_modes) != L:
            _err("layer_modes", self.layer_modes, f"needs {L} entries (num_layers), has {len(self.layer_modes)}")
        for i, m in enumerate(self.layer_modes):
            if m not in MODES:
                _err(f"layer_modes[{i}]", m, f"expected one of {MODES}")
        for lo, hi, part in ((0, E, "encoder"), (E, L, "decoder")):
            seen_full = False
            for i in range(lo, hi):
                m = self.layer_modes[i]
                if m in ("reindex", "reuse") and not seen_full:
                    _err(f"layer_modes[{i}]", m, f"a {m} layer needs an earlier full layer in the {part}")
                seen_full |= m == "full"
        extra = [i for i in range(E + 1, L) if self.layer_modes[i] == "full"]
        if extra:
            _err(f"layer_modes[{extra[0]}]", "full", "only the first decoder layer may be full (decoder global KV "
                 "covers every prompt token, but later decoder layers only see the replayed ones); use reindex")
        if self.layer_modes[E] != "full":
            _err(f"layer_modes[{E}]", self.layer_modes[E], "the first decoder layer must be full: it projects the "
                 "decoder's global KV from the final encoder state")
        if self.num_heads % self.out_groups:
            _err("out_groups", self.out_groups, f"must divide num_heads={self.num_heads}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            _err("rope_dim", self.rope_dim, f"must be even and in (0, head_dim={self.head_dim}]")
        for name in ("encoder_ratio", "decoder_ratio", "n_win", "index_topk", "pool_block", "pool_blocks"):
            if getattr(self, name) < 1:
                _err(name, getattr(self, name), "must be >= 1")
        if self.swa_allowance < 0:
            _err("swa_allowance", self.swa_allowance, "must be >= 0")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            _err("num_experts_per_tok", self.num_experts_per_tok, f"must be in [1, n_routed_experts={self.n_routed_experts}]")
        if self.replay_mode not in ("bounded", "exact"):
            _err("replay_mode", self.replay_mode, "expected 'bounded' or 'exact'")
        for name in ("global_kv_format", "index_k_format", "swa_kv_format"):
            if getattr(self, name) not in KV_FORMATS:
                _err(name, getattr(self, name), f"expected one of {KV_FORMATS}")
        for dim, fmt in (("head_dim", "global_kv_format"), ("head_dim", "swa_kv_format"),
                         ("index_head_dim", "index_k_format")):
            g = group_size(getattr(self, fmt))
            if getattr(self, dim) % g:
                _err(dim, getattr(self, dim), f"must be a multiple of {g}, the scale group of {fmt}="
                     f"{getattr(self, fmt)!r} (its cache rows are quantized in groups of {g} channels)")

    @property
    def decoder_start(self) -> int:
        return self.num_encoder_layers

    def ratio(self, layer: int) -> int:
        return self.encoder_ratio if layer < self.num_encoder_layers else self.decoder_ratio

    def source_full(self, layer: int):
        """The full layer whose KV (and indexer K) a reindex/reuse layer reads; None for swa layers."""
        mode = self.layer_modes[layer]
        if mode == "swa":
            return None
        lo = 0 if layer < self.num_encoder_layers else self.num_encoder_layers
        for i in range(layer, lo - 1, -1):
            if self.layer_modes[i] == "full":
                return i
        return None

    def source_topk(self, layer: int):
        """The layer whose top-K indices a reuse layer reads (latest full or reindex layer)."""
        lo = 0 if layer < self.num_encoder_layers else self.num_encoder_layers
        for i in range(layer - 1, lo - 1, -1):
            if self.layer_modes[i] in ("full", "reindex"):
                return i
        return None

    @property
    def ring_size(self) -> int:
        return self.n_win + self.swa_allowance

    @classmethod
    def from_hf(cls, hf: dict) -> "CEDConfig":
        names = {f.name for f in attrs.fields(cls)}
        kw = {k: v for k, v in hf.items() if k in names}
        if "layer_modes" in kw:
            kw["layer_modes"] = tuple(kw["layer_modes"])
        if "num_hidden_layers" in hf and "num_layers" not in hf:
            kw["num_layers"] = hf["num_hidden_layers"]
        return cls(**kw)

    def to_hf(self) -> dict:
        d = attrs.asdict(self)
        d["layer_modes"] = list(self.layer_modes)
        return {"architectures": [ARCH], "model_type": "ced", "num_hidden_layers": self.num_layers, **d}


SIZES = {
    "toy": {},
    "small": dict(hidden_size=512, num_heads=8, head_dim=128, rope_dim=32, q_lora_rank=256, out_groups=4,
                  out_group_dim=256, n_win=64, swa_allowance=8, n_routed_experts=16, moe_intermediate_size=256,
                  index_topk=64, pool_block=8, pool_blocks=32),
    "bench": dict(hidden_size=2048, num_layers=16, num_encoder_layers=8, num_heads=16, head_dim=512, rope_dim=64,
                  q_lora_rank=1024, out_groups=8, out_group_dim=1024, n_win=128, swa_allowance=12,
                  layer_modes=("swa", "swa", "full", "reuse", "reuse", "full", "reuse", "reuse",
                               "full", "reuse", "reuse", "reuse", "reindex", "reuse", "reuse", "reuse"),
                  index_heads=16, index_head_dim=128, index_topk=512, pool_block=8, pool_blocks=256,
                  n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                  max_position_embeddings=65536),
}
