"""Write a random-weight checkpoint in Hugging Face format, without transformers.

``deepinfer init-model --arch llama --size tiny --out DIR`` writes config.json
(HF spelling), model.safetensors (the model's own ``hf_state_dict()`` after a
seeded random init) and a small byte-level BPE tokenizer (tokenizers only), so
benchmarks and tests get a real checkpoint directory that DeepInfer and
transformers both load.

Architectures plug in through ``ARCHS``: an :class:`ArchSpec` says how to make
the config.json dict for a size and how to build the module that owns the
weights. There are entries for the Llama family (llama, mistral, qwen2, qwen3),
the MoE families (mixtral, qwen2-moe, qwen3-moe, deepseek-v2, deepseek-v3) and
CED; a new family adds one entry.

A checkpoint is written into a hidden sibling directory and moved into place
when complete; a non-empty target is refused unless ``force`` (see
:func:`create_checkpoint`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
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
    default_size: str = "tiny"  # the size ``--size`` means when not given; one of ``sizes``


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


# --- mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3 --------------------------------------

# Shapes shared by the MoE families; each family's config maps them to its own keys. Every layer after the
# first dense ones is sparse, with num_experts experts of moe_intermediate_size (Mixtral: intermediate_size).
_MOE_SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=2048),
    "small": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
                  max_position_embeddings=4096),
}


def _mixtral(s: dict) -> dict:
    return dict(architectures=["MixtralForCausalLM"], model_type="mixtral", rope_theta=1000000.0,
                sliding_window=None, tie_word_embeddings=False, intermediate_size=s["moe_intermediate_size"],
                num_local_experts=s["num_experts"], router_aux_loss_coef=0.02, output_router_logits=False)


def _qwen_moe(arch: str, model_type: str, shared_expert: bool = False, **extra):
    def make(s: dict) -> dict:
        cfg = dict(architectures=[arch], model_type=model_type, rope_theta=1000000.0, use_sliding_window=False,
                   sliding_window=None, max_window_layers=0, tie_word_embeddings=False,
                   num_experts=s["num_experts"], moe_intermediate_size=s["moe_intermediate_size"],
                   decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                   output_router_logits=False, **extra)
        if shared_expert:  # Qwen2-MoE's gated shared expert
            cfg["shared_expert_intermediate_size"] = 2 * s["moe_intermediate_size"]
        return cfg
    return make


def _deepseek(version: int):
    def make(s: dict) -> dict:
        head = s["head_dim"]  # MLA: nope + rope key dims make the qk head, v_head_dim the value head
        cfg = dict(architectures=[f"DeepseekV{version}ForCausalLM"], model_type=f"deepseek_v{version}",
                   rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                   num_key_value_heads=s["num_attention_heads"], kv_lora_rank=head, qk_nope_head_dim=head // 2,
                   qk_rope_head_dim=head // 4, v_head_dim=head // 2, n_routed_experts=s["num_experts"],
                   moe_intermediate_size=s["moe_intermediate_size"], n_shared_experts=1, first_k_dense_replace=1,
                   moe_layer_freq=1)
        if version == 2:  # softmax greedy routing, no q LoRA
            cfg.update(q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None,
                       routed_scaling_factor=1.0, norm_topk_prob=False)
        else:  # sigmoid noaux_tc routing in groups, q LoRA, no multi-token-prediction layers written
            cfg.update(q_lora_rank=2 * head, topk_method="noaux_tc", scoring_func="sigmoid", n_group=4,
                       topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                       num_nextn_predict_layers=0)
        return cfg
    return make


_MOE_FAMILY = {
    "mixtral": _mixtral,
    "qwen2-moe": _qwen_moe("Qwen2MoeForCausalLM", "qwen2_moe", shared_expert=True, qkv_bias=True,
                           norm_topk_prob=False),
    "qwen3-moe": _qwen_moe("Qwen3MoeForCausalLM", "qwen3_moe", attention_bias=False, norm_topk_prob=True),
    "deepseek-v2": _deepseek(2),
    "deepseek-v3": _deepseek(3),
}


def _moe_config(family: str):
    def make(size: str, vocab_size: int, special: dict) -> dict:
        shape = _MOE_SIZES[size]
        family_cfg = _MOE_FAMILY[family](shape)
        drop = {"num_experts", "moe_intermediate_size"} | ({"head_dim"} if "kv_lora_rank" in family_cfg else set())
        cfg = {k: v for k, v in shape.items() if k not in drop}  # MLA has no head_dim of its own
        cfg.update(family_cfg)
        cfg.update(vocab_size=vocab_size, hidden_act="silu", rms_norm_eps=1e-6, initializer_range=DEFAULT_INIT_STD,
                   torch_dtype="float32", use_cache=True, **special)
        return cfg
    return make


def _moe_build(hf_config: dict) -> torch.nn.Module:
    from .backends.reference.ops import ReferenceOps
    from .models.deepseek import MODELS as DEEPSEEK
    from .models.moe_llama import MODELS as MOE_LLAMA

    return {**MOE_LLAMA, **DEEPSEEK}[hf_config["architectures"][0]](hf_config, ReferenceOps("cpu"))


ARCHS.update({family: ArchSpec(name=family, sizes=_MOE_SIZES, config=_moe_config(family), build=_moe_build)
              for family in _MOE_FAMILY})


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


ARCHS["ced"] = ArchSpec(name="ced", sizes=_ced_sizes(), config=_ced_config, build=_ced_build, init=_ced_init,
                        default_size="toy")


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


# What ``force=True`` replaces in a non-empty directory: the files of a Hugging Face checkpoint (weights,
# shard index, configs, tokenizer). Anything else there (a README, logs, subdirectories) is left alone.
CHECKPOINT_FILE_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt",
                            "*.pth", "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                            "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template*")


def checkpoint_files(root: Path) -> list:
    """The top-level files of ``root`` that belong to a checkpoint (see CHECKPOINT_FILE_PATTERNS)."""
    return sorted(p for p in root.iterdir() if p.is_file() and any(p.match(pat) for pat in CHECKPOINT_FILE_PATTERNS))


def create_checkpoint(out: str | Path, arch: str = "llama", size: Optional[str] = None, seed: int = 0,
                      vocab_size: Optional[int] = None, init_std: float = DEFAULT_INIT_STD,
                      force: bool = False) -> dict:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files to ``out``.

    The model's vocab is the tokenizer's (the test corpus caps it near 1.2k entries), so every id the
    model can emit decodes. ``size=None`` is the architecture's default size. The checkpoint is written
    into a hidden sibling directory and moved into place only once complete, so a failure leaves ``out``
    as it was. A non-empty ``out`` is refused unless ``force``, which first removes the checkpoint files
    already there (stale shards and indexes would otherwise be loaded with the new ones).
    Returns the config.json dict.
    """
    if arch not in ARCHS:
        raise ValueError(f"init-model --arch {arch!r} is unknown; known: {', '.join(sorted(ARCHS))}")
    spec = ARCHS[arch]
    size = spec.default_size if size is None else size
    if size not in spec.sizes:
        raise ValueError(f"init-model --size {size!r} is unknown for {arch}; known: {', '.join(spec.sizes)}")
    if not (isinstance(init_std, (int, float)) and init_std > 0):
        raise ValueError(f"init-model init_std={init_std!r} is invalid: must be > 0")
    root = Path(out).resolve()
    if root.exists() and not root.is_dir():
        raise ValueError(f"init-model --out {str(out)!r} is a file; give a directory")
    existing = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if existing and not force:
        shown = ", ".join(existing[:4]) + (", ..." if len(existing) > 4 else "")
        raise ValueError(f"init-model --out {str(out)!r} is not empty ({shown}); pass --force to replace the "
                         "checkpoint in it, or give a new directory")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.init-model-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        cfg = _write_checkpoint(tmp, spec, size, seed, vocab_size, init_std)
        if not root.exists():
            os.replace(tmp, root)
        else:
            for f in checkpoint_files(root):
                f.unlink()
            for f in sorted(tmp.iterdir()):
                os.replace(f, root / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cfg


def _write_checkpoint(root: Path, spec: ArchSpec, size: str, seed: int, vocab_size: Optional[int],
                      init_std: float) -> dict:
    from safetensors.torch import save_file

    from .testing.tokenizers import build_test_tokenizer

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
