"""Tiny random-weight CED checkpoints and a hypothesis strategy of small valid CED configurations, for tests.

``build_ced_checkpoint`` writes a complete checkpoint directory (config.json, model.safetensors and a
test tokenizer) that ``LLM(out_dir)`` loads. ``ced_configs()`` draws keyword overrides of
:class:`~deepinfer.models.ced.config.CEDConfig` that pass its validation and keep every mechanism
(SWA-only layers, full/reindex/reuse layers, compression ratios, the decoder's candidate pool) at
sizes small enough for a CPU test; ``block_sizes_for`` draws engine block sizes the config accepts.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from ..models.ced.config import CEDConfig
from .tokenizers import build_test_tokenizer

# A fixed small config with every layer mode, a window of 6 and a ring of 8: the prefix-cache tests (bounded
# replay, the encoder-SWA pool) build it with block size 4.
REPLAY_CONFIG = dict(hidden_size=48, num_layers=6, num_encoder_layers=3, num_heads=2, head_dim=32, rope_dim=8,
                     q_lora_rank=32, out_groups=2, out_group_dim=32, n_win=6, swa_allowance=2,
                     layer_modes=("swa", "full", "reuse", "full", "reindex", "reuse"), encoder_ratio=2,
                     index_topk=4, pool_block=2, pool_blocks=2, index_heads=2, index_head_dim=32, n_routed_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                     max_position_embeddings=512)

# Dimensions shared by every drawn config that the strategy does not vary.
_FIXED = dict(index_head_dim=32, index_heads=2, q_lora_rank=32, out_group_dim=32, moe_intermediate_size=32,
              n_routed_experts=4, n_shared_experts=1, decoder_ratio=1, max_position_embeddings=512)


def build_ced_checkpoint(out_dir, seed: int = 0, std: float = 0.1, vocab_size: int = 512,
                         **config_overrides) -> CEDConfig:
    """Write a random-weight CED checkpoint to ``out_dir`` and return its config.

    The tokenizer is built first (``build_test_tokenizer(out_dir, vocab_size)``) and the model's vocab is the
    tokenizer's (at most ``vocab_size``). Weights come from ``CEDForCausalLM.init_weights(seed, std)``
    (norms 1, sinks and gate biases 0, matrices N(0, min(std, fan_in ** -0.5))).
    """
    import torch
    from safetensors.torch import save_file

    from ..models.ced.model import CEDForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_test_tokenizer(out, vocab_size=vocab_size)
    cfg = CEDConfig(**config_overrides, vocab_size=tok.vocab_size)
    with torch.device("cpu"):
        model = CEDForCausalLM(cfg.to_hf())
    model.init_weights(seed, std=std)
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    save_file(model.hf_state_dict(), str(out / "model.safetensors"))
    return cfg


def _st():
    from hypothesis import strategies as st

    return st


def ced_configs():
    """A hypothesis strategy of small, valid CEDConfig keyword overrides (a dict, without vocab_size).

    Layer modes: the encoder has optional leading swa layers, then (if any layers are left) a full layer
    followed by full/reuse/reindex/swa layers; the decoder starts with its full layer, followed by
    reuse/reindex layers (and now and then a swa layer, which the config also accepts).
    """
    st = _st()

    @st.composite
    def draw_config(draw) -> dict:
        L = draw(st.integers(3, 6))
        E = draw(st.integers(1, L - 1))
        n_swa = draw(st.integers(0, E))
        enc = ["swa"] * n_swa
        if n_swa < E:
            enc.append("full")
            enc += draw(st.lists(st.sampled_from(["full", "reuse", "reindex", "reuse", "swa"]),
                                 min_size=E - n_swa - 1, max_size=E - n_swa - 1))
        dec = ["full"] + draw(st.lists(st.sampled_from(["reuse", "reindex", "reuse", "reindex", "swa"]),
                                       min_size=L - E - 1, max_size=L - E - 1))
        heads = draw(st.integers(2, 4))
        out_groups = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
        head_dim = draw(st.sampled_from([32, 64]))
        experts_per_tok = draw(st.integers(1, 2))
        cfg = dict(_FIXED, num_layers=L, num_encoder_layers=E, layer_modes=tuple(enc + dec),
                   hidden_size=draw(st.sampled_from([32, 48, 64])), num_heads=heads, out_groups=out_groups,
                   head_dim=head_dim, rope_dim=draw(st.sampled_from([8, 16])),
                   n_win=draw(st.integers(3, 10)), swa_allowance=draw(st.integers(0, 3)),
                   encoder_ratio=draw(st.integers(1, 3)), index_topk=draw(st.integers(2, 8)),
                   pool_block=draw(st.integers(1, 4)), pool_blocks=draw(st.integers(1, 4)),
                   num_experts_per_tok=experts_per_tok, use_sink=draw(st.booleans()),
                   rope_theta=draw(st.sampled_from([10000.0, 100.0])))
        CEDConfig(**cfg)  # every drawn config must validate
        return cfg

    return draw_config()


def block_sizes_for(overrides: dict, max_blocks_of_ratio: int = 4):
    """A strategy of engine block sizes valid for the config: multiples of every compression ratio."""
    st = _st()
    c = CEDConfig(**overrides)
    m = math.lcm(c.encoder_ratio, c.decoder_ratio)
    return st.integers(1, max_blocks_of_ratio).map(lambda k: k * m)


@contextlib.contextmanager
def as_on_cuda():
    """CPU tensors dispatched as CUDA ones are (for the nvidia backend under Triton's interpreter): CEDLayer._kernels
    returns the model's ops, and functional's fused ops and fake quantisation take them. Used to count or check
    the CUDA dispatch's launches and copies on the CPU (benchmarks/ced_decode_op_count.py,
    tests/test_ced_prefill_step.py)."""
    from ..models.ced import functional as fn, model as ced_model

    kernels, fused, fake = ced_model.CEDLayer._kernels, fn._fused, fn.fake

    def fake_on_cuda(x, fmt, on, ops=None):
        if on and ops is not None:
            return ops.dequantize_kv(*ops.quantize_kv(x, fmt), fmt, dtype=x.dtype)
        return fake(x, fmt, on, ops)

    ced_model.CEDLayer._kernels = lambda self, x: ced_model.ops_of(self, x.device)
    fn._fused = lambda ops, name, *ts: getattr(ops, name, None) if ops is not None else None
    fn.fake = fake_on_cuda
    try:
        yield
    finally:
        ced_model.CEDLayer._kernels, fn._fused, fn.fake = kernels, fused, fake
