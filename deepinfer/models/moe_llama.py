"""Mixture-of-experts members of the Llama family: Mixtral, Qwen2-MoE, Qwen3-MoE.

Each is LlamaForCausalLM (attention, norms, rotary, KV cache, both paths) with an ``mlp_factory`` that
puts a MoEBlock in the sparse layers. The model owns an ExpertLoad over its MoE layers (window: the
config key ``expert_load_window``, default 64 steps) and closes it after every engine step
(``end_step``). The config key ``moe_impl`` ("routed" | "dense") picks the experts' implementation.

What transformers 5.24 does, and we reproduce:
  * Mixtral: every layer sparse (``block_sparse_moe``: w1/w3/w2), softmax top-k, renormalised.
  * Qwen2-MoE: layer i is sparse when i not in ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0
    (else a dense MLP of ``intermediate_size``); experts of ``moe_intermediate_size``; softmax top-k,
    renormalised when ``norm_topk_prob``; plus a shared expert of ``shared_expert_intermediate_size``
    scaled by sigmoid(``shared_expert_gate``(x)). q/k/v carry a bias (``qkv_bias``).
  * Qwen3-MoE: the same sparse-layer rule and router, no shared expert; Qwen3 attention (q/k norm).
"""

from __future__ import annotations

from typing import Iterable

from .base import hf_get
from .expert_load import ExpertLoad
from .llama import LlamaForCausalLM
from .moe import MoEBlock, MoEModel


def _expert_load_window(hf: dict) -> int:
    return int(hf.get("expert_load_window") or 64)


class _MoELlama(MoEModel, LlamaForCausalLM):
    """Shared by the three: ``spec(hf)`` gives (base Llama-family arch, per-layer MoEBlock kwargs or None)."""

    ARCH = ""
    BASE = ""  # the dense architecture whose attention this one uses
    NAMING = "qwen"
    BLOCK_NAME = "mlp"  # the checkpoint's name for the sparse block

    def __init__(self, hf_config: dict, ops):
        n_layers = hf_config.get("num_hidden_layers")
        if n_layers is None:
            raise ValueError(f"config.json for {self.ARCH} lacks required field 'num_hidden_layers'")
        E = hf_get(hf_config, "num_experts", "num_local_experts")
        if E is None:
            raise ValueError(f"config.json for {self.ARCH} lacks required field 'num_experts' (or num_local_experts)")
        top_k = hf_get(hf_config, "num_experts_per_tok")
        if top_k is None:
            raise ValueError(f"config.json for {self.ARCH} lacks required field 'num_experts_per_tok'")
        moe_layers = [i for i in range(n_layers) if self.is_sparse(hf_config, i, E)]
        load = ExpertLoad(moe_layers, E, window=_expert_load_window(hf_config))
        impl = hf_config.get("moe_impl") or "routed"
        block_kw = self.block_kwargs(hf_config)

        def mlp_factory(layer: int):
            if layer not in moe_layers:
                return None
            return MoEBlock(hf_config["hidden_size"], top_k=top_k, num_experts=E, ops=ops, layer=layer,
                            naming=self.NAMING, checkpoint_prefix=f"model.layers.{layer}.{self.BLOCK_NAME}",
                            expert_load=load, impl=impl, **block_kw)

        types = None if hf_config.get("layer_types") is not None else self.layer_types(hf_config, n_layers)
        if types is not None:  # the MoE architecture's own sliding rule, in the base's terms
            hf_config = {**hf_config, "layer_types": types}
        super().__init__(hf_config, ops, arch=self.BASE, mlp_factory=mlp_factory)
        self.arch = self.ARCH
        self.moe_layers = moe_layers
        # Routed experts on a backend whose MoE kernels never sync can be captured in CUDA graphs.
        self.supports_cuda_graphs = not moe_layers or (impl == "routed" and getattr(ops, "moe_capture_safe", False))
        self.expert_load = load

    # Per architecture.
    @staticmethod
    def is_sparse(hf: dict, layer: int, num_experts: int) -> bool:
        only = hf.get("mlp_only_layers") or []
        step = hf.get("decoder_sparse_step") or 1
        return layer not in only and num_experts > 0 and (layer + 1) % step == 0

    def block_kwargs(self, hf: dict) -> dict:
        raise NotImplementedError

    @staticmethod
    def layer_types(hf: dict, n_layers: int):
        """Which layers slide when config.json has no ``layer_types``, where this architecture's rule differs from
        its base's (transformers' configuration_*.py); None: the base's rule (llama.LlamaConfig.from_hf)."""
        return None

    # Engine hooks.
    def forward_full(self, input_ids):
        """The oracle path; its routing is not engine work, so it is not counted in the expert load."""
        blocks = self.moe_blocks()
        saved = [m.expert_load for m in blocks]
        for m in blocks:
            m.expert_load = None
        try:
            return super().forward_full(input_ids)
        finally:
            for m, load in zip(blocks, saved):
                m.expert_load = load


class MixtralForCausalLM(_MoELlama):
    ARCH, BASE, NAMING, BLOCK_NAME = "MixtralForCausalLM", "MistralForCausalLM", "mixtral", "block_sparse_moe"

    @staticmethod
    def is_sparse(hf: dict, layer: int, num_experts: int) -> bool:
        return True

    def block_kwargs(self, hf: dict) -> dict:
        return dict(expert_size=hf["intermediate_size"], scoring="softmax", renormalize=True)

    def load_weights(self, weights: Iterable) -> None:
        # transformers 5 names the block "mlp" in memory (and writes "block_sparse_moe" back); accept both.
        def renamed():
            for name, t in weights:
                if name.startswith("model.layers.") and ".mlp." in name:
                    name = name.replace(".mlp.", ".block_sparse_moe.", 1)
                yield name, t

        super().load_weights(renamed())


class Qwen2MoeForCausalLM(_MoELlama):
    ARCH, BASE = "Qwen2MoeForCausalLM", "Qwen2ForCausalLM"

    def __init__(self, hf_config: dict, ops):
        if not hf_config.get("qkv_bias", True):
            raise ValueError("Qwen2MoeForCausalLM: qkv_bias=false is not supported (every released Qwen2-MoE "
                             "checkpoint has q/k/v biases)")
        super().__init__(hf_config, ops)

    def block_kwargs(self, hf: dict) -> dict:
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        return dict(expert_size=hf["moe_intermediate_size"], scoring="softmax",
                    renormalize=bool(hf.get("norm_topk_prob", False)), shared_size=shared, shared_gate=shared > 0)

    @staticmethod
    def layer_types(hf: dict, n_layers: int):
        # transformers 5 (configuration_qwen2_moe.py) fills layer_types with every other layer below
        # max_window_layers, not Qwen2's "from max_window_layers on".
        use = bool(hf.get("use_sliding_window", False)) and hf.get("sliding_window") is not None
        mwl = hf.get("max_window_layers", n_layers)
        return ["sliding_attention" if use and (i + 1) % 2 and i < mwl else "full_attention" for i in range(n_layers)]


class Qwen3MoeForCausalLM(_MoELlama):
    ARCH, BASE = "Qwen3MoeForCausalLM", "Qwen3ForCausalLM"

    def block_kwargs(self, hf: dict) -> dict:
        return dict(expert_size=hf["moe_intermediate_size"], scoring="softmax",
                    renormalize=bool(hf.get("norm_topk_prob", False)))

    @staticmethod
    def layer_types(hf: dict, n_layers: int):
        # transformers' Qwen3-MoE has no max_window_layers: with use_sliding_window every layer slides.
        use = bool(hf.get("use_sliding_window", False)) and hf.get("sliding_window") is not None
        return ["sliding_attention" if use else "full_attention"] * n_layers


MODELS = {cls.ARCH: cls for cls in (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)}
