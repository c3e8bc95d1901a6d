"""Write a random-weight checkpoint in Hugging Face format, without transformers.

``deepinfer init-model --arch llama --size tiny --out DIR`` writes config.json
(HF spelling), model.safetensors (the model's own ``hf_state_dict()`` after a
seeded random init) and a small byte-level BPE tokenizer (tokenizers only), so
benchmarks and tests get a real checkpoint directory that DeepInfer and
transformers both load.

Architectures plug in through ``ARCHS``: an :class:`ArchSpec` says how to make
the config.json dict for a size and how to build the module that owns the
weights. A new family (for instance CED) adds one entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import attrs
import torch

DEFAULT_INIT_STD = 0.02


@attrs.frozen
class ArchSpec:
    """One architecture init-model can write.

    config: (size, vocab_size, special token ids) -> config.json dict.
    build: config.json dict -> module with ``named_parameters()`` and ``hf_state_dict()``.
    """

    name: str
    sizes: dict  # size name -> dict of shape fields, read by ``config``
    config: Callable[[str, int, dict], dict]
    build: Callable[[dict], torch.nn.Module]
    default_vocab: int = 1024
    init: Optional[Callable] = None  # (model, seed, std) -> None; default random_init_


# --- the Llama family ------------------------------------------------------------------------------

_LLAMA_SIZES = {
    # tiny: the size the throughput benchmark uses.
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=2048),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
}

# Per-family differences from the plain Llama config.json.
_LLAMA_FAMILY = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0,
                  attention_bias=False, mlp_bias=False, tie_word_embeddings=False),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", rope_theta=10000.0,
                    sliding_window=None, tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0,
                  use_sliding_window=False, sliding_window=None, max_window_layers=0, tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0,
                  attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=0,
                  tie_word_embeddings=False),
}


def _llama_config(family: str):
    def make(size: str, vocab_size: int, special: dict) -> dict:
        cfg = {**_LLAMA_FAMILY[family], **_LLAMA_SIZES[size]}
        cfg.update(vocab_size=vocab_size, hidden_act="silu", rms_norm_eps=1e-6, initializer_range=DEFAULT_INIT_STD,
                   torch_dtype="float32", use_cache=True, **special)
        return cfg
    return make


def _llama_build(hf_config: dict) -> torch.nn.Module:
    from .backends.reference.ops import ReferenceOps
    from .models.llama import LlamaForCausalLM

    return LlamaForCausalLM(hf_config, ReferenceOps("cpu"), arch=hf_config["architectures"][0])


ARCHS: dict = {
    family: ArchSpec(name=family, sizes=_LLAMA_SIZES, config=_llama_config(family), build=_llama_build)
    for family in _LLAMA_FAMILY
}


# --- CED (DeepSeek-V4.1-Flash architecture) -------------------------------------------------------------

def _ced_config(size: str, vocab_size: int, special: dict) -> dict:
    from .models.ced.config import SIZES, CEDConfig

    return {**CEDConfig(**{**SIZES[size], "vocab_size": vocab_size}).to_hf(), "torch_dtype": "float32", **special}


def _ced_build(hf_config: dict) -> torch.nn.Module:
    from .models.ced.model import CEDForCausalLM

    return CEDForCausalLM(hf_config)


def _ced_init(model, seed: int, std: float) -> None:
    model.init_weights(seed, std=std)


def _ced_sizes() -> dict:
    from .models.ced.config import SIZES

    return dict(SIZES)


ARCHS["ced"] = ArchSpec(name="ced", sizes=_ced_sizes(), config=_ced_config, build=_ced_build, init=_ced_init)


def register_arch(spec: ArchSpec, override: bool = False) -> None:
    """Add an architecture init-model can write (a later family, or a test's)."""
    if spec.name in ARCHS and not override:
        raise ValueError(f"init-model architecture {spec.name!r} is already defined")
    ARCHS[spec.name] = spec


# --- writing -----------------------------------------------------------------------------------------

def random_init_(model: torch.nn.Module, seed: int, std: float = DEFAULT_INIT_STD) -> None:
    """Seeded init in a fixed (name) order: norm weights 1, every other tensor N(0, std)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            owner = name.split(".")[-2] if "." in name else ""  # the module that holds the tensor
            if "norm" in owner and name.endswith(".weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def create_checkpoint(out: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0,
                      vocab_size: Optional[int] = None, init_std: float = DEFAULT_INIT_STD) -> dict:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files to ``out``.

    The model's vocab is the tokenizer's (the test corpus caps it near 1.2k entries), so every id the
    model can emit decodes. Returns the config.json dict.
    """
    from safetensors.torch import save_file

    from .testing.tokenizers import build_test_tokenizer

    if arch not in ARCHS:
        raise ValueError(f"init-model --arch {arch!r} is unknown; known: {', '.join(sorted(ARCHS))}")
    spec = ARCHS[arch]
    if size not in spec.sizes:
        raise ValueError(f"init-model --size {size!r} is unknown for {arch}; known: {', '.join(spec.sizes)}")
    if not (isinstance(init_std, (int, float)) and init_std > 0):
        raise ValueError(f"init-model init_std={init_std!r} is invalid: must be > 0")
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise ValueError(f"init-model --out {str(root)!r} is a file; give a directory")
    root.mkdir(parents=True, exist_ok=True)
    tok = build_test_tokenizer(root, vocab_size=spec.default_vocab if vocab_size is None else vocab_size)
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_ids[0], pad_token_id=tok.pad_token_id)
    cfg = spec.config(size, tok.vocab_size, special)
    with torch.device("meta"):  # no point running nn.Linear's own init: random_init_ overwrites every tensor
        model = spec.build(cfg)
    model = model.to_empty(device="cpu")
    (spec.init or random_init_)(model, seed, init_std)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in model.hf_state_dict().items()}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": special["bos_token_id"], "eos_token_id": special["eos_token_id"],
           "pad_token_id": special["pad_token_id"]}
    (root / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return cfg


def num_parameters(ckpt_dir: str | Path) -> int:
    """Parameter count of a checkpoint's safetensors files (read from the headers, no tensor loaded)."""
    from safetensors import safe_open

    from .models.loader import safetensors_files

    n = 0
    for f in safetensors_files(Path(ckpt_dir)):
        with safe_open(str(f), framework="pt") as fh:
            n += sum(torch.Size(fh.get_slice(k).get_shape()).numel() for k in fh.keys())
    return n
