"""Find a checkpoint, read config.json and safetensors, build the registered architecture.

Never unpickles: .bin/.pt/.pth checkpoints are refused. Never runs remote code.
Model resolution: an existing directory; else a Hugging Face id looked up under
DEEPINFER_HF_MODEL_DIR, then in the Hugging Face cache (offline first); None is
the bundled demo model (or DEEPINFER_HF_MODEL_DIR when it points at a checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterator, Optional

import torch

log = logging.getLogger(__name__)

DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """The checkpoint cannot be used; the message says why and what to do."""


def _is_checkpoint(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").exists()


def resolve_model_path(model: Optional[str]) -> Path:
    env = os.environ.get("DEEPINFER_HF_MODEL_DIR")
    if model is None:
        if env and _is_checkpoint(Path(env)):
            return Path(env)
        if _is_checkpoint(DEMO_DIR):
            return DEMO_DIR
        raise CheckpointError("no model given and no bundled demo model is installed "
                              f"(looked in {DEMO_DIR}); pass model='path/to/checkpoint'")
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    if env:
        for cand in (Path(env) / model, Path(env) / model.split("/")[-1]):
            if cand.is_dir():
                return cand
    if p.exists():
        raise CheckpointError(f"model {model!r} is a file; pass the checkpoint directory that holds config.json")
    return _from_hf_cache(model)


def _from_hf_cache(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a runtime dependency
        raise CheckpointError(f"model {repo_id!r} is not a directory and huggingface_hub is not installed") from None
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception as local_exc:
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            raise CheckpointError(f"model {repo_id!r} is not a directory and is not in the Hugging Face cache "
                                  f"(offline): {local_exc}") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:
        raise CheckpointError(f"model {repo_id!r} is not a local directory and could not be fetched from the "
                              f"Hugging Face hub: {exc}") from None


def load_config(path: Path) -> dict:
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        raise CheckpointError(f"{path} has no config.json; a checkpoint directory needs config.json, "
                              "*.safetensors and tokenizer.json")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg} is not valid JSON: {exc}") from None


def safetensors_files(path: Path) -> list:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise CheckpointError(f"{index.name} lists shard(s) {', '.join(missing)} that are not in {path}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise CheckpointError(f"{path} holds only pickle checkpoint(s) ({', '.join(pickled)}); DeepInfer never "
                              "unpickles weights. Convert them to safetensors (for example with transformers: "
                              "model.save_pretrained(dir, safe_serialization=True)).")
    raise CheckpointError(f"{path} has no *.safetensors weights")


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
                   if hasattr(torch, n))
FP8_CODES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")  # their safetensors dtype names
SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3 style: X.weight (FP8) pairs with X.weight_scale_inv (float32 per block)


def iter_weights(path: Path, hf_config: Optional[dict] = None) -> Iterator:
    """(name, tensor) of every checkpoint tensor, shard by shard.

    Block-quantized FP8 weights are dequantized here, for every architecture: an FP8 ``X.weight`` is paired
    with ``X.weight_scale_inv`` wherever it lives among the shards and comes out as one float32 ``X.weight``
    (block size: the config's quantization_config.weight_block_size, default 128x128); its scale is not
    yielded. An FP8 weight without a scale is an error naming it.
    """
    from contextlib import ExitStack

    from safetensors import safe_open

    from .quant import dequantize_fp8_block, fp8_block_size

    block = fp8_block_size(hf_config or {}) or (128, 128)
    files = safetensors_files(path)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        where = {name: fh for fh in handles for name in fh.keys()}  # tensor name -> its shard

        def is_fp8(name: str) -> bool:
            return name in where and where[name].get_slice(name).get_dtype() in FP8_CODES

        for fh in handles:
            for name in fh.keys():
                if name.endswith(SCALE_SUFFIX) and is_fp8(name[:-len(SCALE_SUFFIX)]):
                    continue  # consumed with its weight
                t = fh.get_tensor(name)
                if t.dtype in FP8_DTYPES:
                    scale_name = name + SCALE_SUFFIX
                    if scale_name not in where:
                        raise CheckpointError(f"checkpoint tensor {name!r} is {str(t.dtype).removeprefix('torch.')} "
                                              f"but the checkpoint has no {scale_name!r} to dequantize it with")
                    t = _dequantize(name, t, where[scale_name].get_tensor(scale_name), block, dequantize_fp8_block)
                yield name, t


def _dequantize(name, w, scale_inv, block, dequantize) -> torch.Tensor:
    """FP8 [R, C] (or [..., R, C], e.g. fused experts) with block scales [..., ceil(R/br), ceil(C/bc)] -> float32."""
    try:
        if w.dim() == 2:
            return dequantize(w, scale_inv, block)
        if w.dim() > 2 and scale_inv.dim() == w.dim() and scale_inv.shape[:-2] == w.shape[:-2]:
            flat_w, flat_s = w.reshape(-1, *w.shape[-2:]), scale_inv.reshape(-1, *scale_inv.shape[-2:])
            return torch.stack([dequantize(a, b, block) for a, b in zip(flat_w, flat_s)]).reshape(w.shape)
        raise ValueError(f"cannot pair a weight of shape {tuple(w.shape)} with scales of shape "
                         f"{tuple(scale_inv.shape)}")
    except ValueError as exc:
        raise CheckpointError(f"checkpoint tensor {name!r}: {exc}") from None


def torch_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32  # CPU bf16 matmuls are slow and the reference backend is the oracle
        name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
        name = {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(name, name)
    return getattr(torch, name)


def dummy_init_(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place, on the model's device (``load_format="dummy"``: benchmarks of real shapes
    without a checkpoint on disk). Norm weights 1, everything else N(0, std); float32 router weights stay."""
    gen = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if gen is None or gen.device != p.device:
                gen = torch.Generator(device=p.device).manual_seed(seed)
            last = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
            if "norm" in last:
                p.fill_(1.0)
            elif name.endswith(("bias", "sink", "gate_bias", "e_score_correction_bias")):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)


def build_model(path: Path, hf_config: dict, ops, dtype: torch.dtype, device, registry, load_format: str = "auto"):
    """load_format: "auto" reads the safetensors; "dummy" fills random weights (no weight files needed)."""
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format={load_format!r} is invalid: expected 'auto' or 'dummy'")
    archs = hf_config.get("architectures") or []
    supported = registry.names("model")
    arch = next((a for a in archs if a in supported), None)
    if arch is None:
        raise CheckpointError(f"{path}: architecture {archs or '(none in config.json)'} is not supported; "
                              f"supported: {', '.join(supported)}")
    entry = registry.get("model", arch)
    with torch.device("meta"):
        model = entry.obj(hf_config, ops)
    model = model.to(dtype).to_empty(device=device)  # cast on meta first: no float32 copy of a big model
    if load_format == "dummy":
        dummy_init_(model)
    else:
        model.load_weights(iter_weights(path, hf_config))
    model.eval()
    log.info("loaded %s from %s (%s, %s, provided by %s)", arch, path, dtype, device, entry.plugin)
    return model
