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


def iter_weights(path: Path) -> Iterator:
    from safetensors import safe_open

    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def torch_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32  # CPU bf16 matmuls are slow and the reference backend is the oracle
        name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
        name = {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(name, name)
    return getattr(torch, name)


def build_model(path: Path, hf_config: dict, ops, dtype: torch.dtype, device, registry):
    archs = hf_config.get("architectures") or []
    supported = registry.names("model")
    arch = next((a for a in archs if a in supported), None)
    if arch is None:
        raise CheckpointError(f"{path}: architecture {archs or '(none in config.json)'} is not supported; "
                              f"supported: {', '.join(supported)}")
    entry = registry.get("model", arch)
    with torch.device("meta"):
        model = entry.obj(hf_config, ops)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(iter_weights(path))
    model.eval()
    log.info("loaded %s from %s (%s, %s, provided by %s)", arch, path, dtype, device, entry.plugin)
    return model
