"""Tiny random-weight Hugging Face checkpoints for tests and benchmarks (needs transformers, a test extra).

Weights are drawn with a larger init range than real models so that the
next-token distribution is peaked: greedy parity with transformers is then not
at the mercy of near-ties.
"""

from __future__ import annotations

from pathlib import Path

from .tokenizers import build_test_tokenizer

# Small configurations that exercise each architecture's distinctive parts.
TINY = {
    "llama": dict(arch="LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False),
    "llama-tied": dict(arch="LlamaForCausalLM", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(arch="MistralForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, sliding_window=12, head_dim=16),
    "qwen2": dict(arch="Qwen2ForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=10,
                  max_window_layers=1, tie_word_embeddings=True),
    "qwen3": dict(arch="Qwen3ForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    # Mixture of experts: every Mixtral layer sparse (and sliding); Qwen2-MoE sparse at layers 1 and 3
    # (decoder_sparse_step=2) with a gated shared expert; Qwen3-MoE dense at layer 0 (mlp_only_layers).
    "mixtral": dict(arch="MixtralForCausalLM", hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=24),
    "qwen2-moe": dict(arch="Qwen2MoeForCausalLM", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=2,
                      norm_topk_prob=False, tie_word_embeddings=True),
    "qwen3-moe": dict(arch="Qwen3MoeForCausalLM", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                      num_experts_per_tok=3, moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True),
    # DeepSeek MLA + DeepSeekMoE (layer 0 dense, then MoE with shared experts). V2: no q LoRA, greedy softmax
    # routing scaled by routed_scaling_factor; V2 "qlora": q LoRA and group-limited greedy routing; V3: q LoRA,
    # sigmoid noaux_tc routing in groups (top-2 sum) and YaRN rope whose mscale_all_dim changes the softmax scale.
    "deepseek_v2": dict(arch="DeepseekV2ForCausalLM", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        topk_method="greedy", routed_scaling_factor=2.0),
    "deepseek_v2-qlora": dict(arch="DeepseekV2ForCausalLM", hidden_size=64, intermediate_size=96,
                              num_hidden_layers=3, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8,
                              num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=32,
                              first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
                              topk_group=2, routed_scaling_factor=1.5),
    "deepseek_v3": dict(arch="DeepseekV3ForCausalLM", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=4,
                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "mscale": 1.0,
                                         "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}),
}


def _config_class(arch: str):
    import transformers

    return getattr(transformers, arch.replace("ForCausalLM", "Config"))


def build_tiny_hf_model(out_dir, name: str = "llama", seed: int = 0, vocab_size: int = 512,
                        max_position_embeddings: int = 512, init_range: float = 0.1, dtype: str = "float32",
                        random_norms_and_biases: bool = False, **overrides):
    """Write a random-weight checkpoint (config.json, model.safetensors, tokenizer files) and return the HF model.
    ``random_norms_and_biases``: norm weights 1 + N(0, 0.2^2) and biases N(0, init_range^2) instead of transformers'
    ones and zeros, which a model that drops a norm weight or a bias would still match. ``overrides``: config
    fields that replace TINY[name]'s (e.g. an expert width of 128 for FP8 experts)."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_test_tokenizer(out, vocab_size=vocab_size)
    spec = {**TINY[name], **overrides}
    arch = spec.pop("arch")
    cfg = _config_class(arch)(vocab_size=tok.vocab_size, max_position_embeddings=max_position_embeddings,
                              initializer_range=init_range, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_ids[0], pad_token_id=tok.pad_token_id, **spec)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).to(getattr(torch, dtype)).eval()
    if random_norms_and_biases:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n or n.endswith(".bias"):
                    noise = torch.randn(p.shape, generator=g).to(p.dtype)
                    p.copy_(1 + 0.2 * noise if "norm" in n else init_range * noise)
    model.save_pretrained(out, safe_serialization=True)
    return model


def write_fp8_checkpoint(src, dst, pick, block=(128, 128)) -> dict:
    """Copy the checkpoint directory ``src`` (one model.safetensors) to ``dst`` with the tensors ``pick(name,
    tensor)`` chooses block-quantized to float8_e4m3fn as DeepSeek-V3 ships them: ``name + "_scale_inv"`` beside
    each (2-D: [cdiv(R, br), cdiv(C, bc)]; 3-D stacked experts: per expert, stacked), and config.json's
    quantization_config set to FP8 with ``block``. Returns {name: (fp8 tensor, scale)}."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from ..models.quant import quantize_fp8_block

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    quant = {}
    for name, t in list(tensors.items()):
        if t.dim() in (2, 3) and pick(name, t):
            q, s = map(torch.stack, zip(*(quantize_fp8_block(m, block) for m in t.reshape(-1, *t.shape[-2:]))))
            q, s = q.reshape(t.shape), s.reshape(*t.shape[:-2], *s.shape[-2:])
            tensors[name], tensors[name + "_scale_inv"] = q, s
            quant[name] = (q, s)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return quant
