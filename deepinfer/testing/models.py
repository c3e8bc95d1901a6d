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
}


def _config_class(arch: str):
    import transformers

    return getattr(transformers, arch.replace("ForCausalLM", "Config"))


def build_tiny_hf_model(out_dir, name: str = "llama", seed: int = 0, vocab_size: int = 512,
                        max_position_embeddings: int = 512, init_range: float = 0.1, dtype: str = "float32"):
    """Write a random-weight checkpoint (config.json, model.safetensors, tokenizer files) and return the HF model."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_test_tokenizer(out, vocab_size=vocab_size)
    spec = dict(TINY[name])
    arch = spec.pop("arch")
    cfg = _config_class(arch)(vocab_size=tok.vocab_size, max_position_embeddings=max_position_embeddings,
                              initializer_range=init_range, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_ids[0], pad_token_id=tok.pad_token_id, **spec)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).to(getattr(torch, dtype)).eval()
    model.save_pretrained(out, safe_serialization=True)
    return model
