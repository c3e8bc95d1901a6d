"""Find a checkpoint, read config.json and safetensors, build the registered architecture.

Never unpickles: .bin/.pt/.pth checkpoints are refused. Never runs remote code. Never uses the network.
Model resolution: an existing directory; else, for a name that can only be a path (absolute, starting with
. or ~, or not of the form NAME or ORG/NAME), "no such directory"; else a Hugging Face id looked up under
DEEPINFER_HF_MODEL_DIR, then in the local Hugging Face cache only; None is the bundled demo model (or
DEEPINFER_HF_MODEL_DIR when it points at a checkpoint). A config.json without ``architectures`` is built
from its ``model_type``, as transformers does.
"""

from __future__ import annotations

import json
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

log = logging.getLogger(__name__)

DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """The checkpoint cannot be used; the message says why and what to do."""


def _is_checkpoint(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").exists()


HF_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # a Hugging Face repo id: NAME or ORG/NAME


def looks_like_path(model: str) -> bool:
    """True for a name only a path can be: absolute, starting with . or ~, or with a separator (a backslash,
    a second /) or character a Hugging Face id cannot hold. ORG/NAME could be either; it is taken as an id."""
    return os.path.isabs(model) or model.startswith((".", "~")) or not HF_ID.fullmatch(model)


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
    if p.exists():
        raise CheckpointError(f"model {model!r} is a file; pass the checkpoint directory that holds config.json")
    if looks_like_path(model):
        raise _no_such_directory(model)
    if env:
        for cand in (Path(env) / model, Path(env) / model.split("/")[-1]):
            if cand.is_dir():
                return cand
    return _from_hf_cache(model, env)


def _no_such_directory(model: str) -> CheckpointError:
    return CheckpointError(f"model {model!r}: no such directory ({Path(model).expanduser().absolute()})")


def _from_hf_cache(repo_id: str, env: Optional[str]) -> Path:
    """The snapshot of ``repo_id`` in the local Hugging Face cache (HF_HOME / HF_HUB_CACHE); never the network."""
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:  # pragma: no cover - a runtime dependency
        raise CheckpointError(f"model {repo_id!r} is not a directory and huggingface_hub is not installed") from None
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except FileNotFoundError as exc:  # LocalEntryNotFoundError; its IncompleteSnapshotError has snapshot_path
        why = f"its cached snapshot is incomplete ({exc})" if getattr(exc, "snapshot_path", None) else \
            f"is not in the local Hugging Face cache ({constants.HF_HUB_CACHE})"
    except ValueError:  # HFValidationError: not a valid repo id after all, so a path
        raise _no_such_directory(repo_id) from None
    looked = f" nor under DEEPINFER_HF_MODEL_DIR={env}" if env else ""
    raise CheckpointError(
        f"model {repo_id!r} is not a local directory{looked}, and {why}. DeepInfer never downloads: on a "
        f"machine with network access run `hf download {repo_id}` (older huggingface_hub: `huggingface-cli "
        f"download {repo_id}`) with HF_HOME pointing at the cache this machine reads, or copy the checkpoint "
        "directory here and pass its path (or put it under DEEPINFER_HF_MODEL_DIR).")


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
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{index} is not valid JSON: {exc}") from None
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


def tensor_names(path: Path) -> set:
    """The names of every tensor in the checkpoint's safetensors (headers only; nothing is read)."""
    from safetensors import safe_open

    names: set = set()
    for f in safetensors_files(path):
        with _reading(f), safe_open(str(f), framework="pt") as fh:
            names.update(fh.keys())
    return names


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
                   if hasattr(torch, n))
FP8_CODES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")  # their safetensors dtype names
FP8_EXPERTS = ("fp8", "dequantize")  # EngineConfig.fp8_experts


def iter_weights(path: Path, hf_config: Optional[dict] = None, keep_fp8: Optional[Callable] = None,
                 select: Optional[Callable] = None) -> Iterator:
    """(name, tensor) of every checkpoint tensor, shard by shard (only those ``select(name)`` accepts, when
    given: the others are never read).

    Block-quantized FP8 weights are dequantized here, for every architecture: an FP8 ``X.weight`` is paired
    with ``X.weight_scale_inv`` (SCALE_SUFFIX) wherever it lives among the shards and comes out as one float32
    ``X.weight`` (block size: the config's quantization_config.weight_block_size, default 128x128); its scale
    is not yielded. An FP8 weight without a scale is an error naming it.

    ``keep_fp8(name)`` (optional) names the tensors the model holds FP8 (``fp8_targets``): each comes as it is
    stored (float8_e4m3fn), followed at once by its scale (float32). Such a tensor stored otherwise is an error.
    """
    from contextlib import ExitStack

    from safetensors import safe_open

    from .quant import FP8, SCALE_SUFFIX, dequantize_fp8_block, fp8_block_size

    block = fp8_block_size(hf_config or {}) or (128, 128)
    files = safetensors_files(path)
    with ExitStack() as stack:
        handles = {}  # shard handle -> its file
        for f in files:
            with _reading(f):
                handles[stack.enter_context(safe_open(str(f), framework="pt"))] = f
        where = {name: fh for fh in handles for name in fh.keys()}  # tensor name -> its shard

        def get(fh, name: str) -> torch.Tensor:
            with _reading(handles[fh]):
                return fh.get_tensor(name)

        def is_fp8(name: str) -> bool:
            return name in where and where[name].get_slice(name).get_dtype() in FP8_CODES

        for fh in handles:
            for name in fh.keys():
                if select is not None and not select(name):
                    continue
                if name.endswith(SCALE_SUFFIX) and is_fp8(name[:-len(SCALE_SUFFIX)]):
                    continue  # consumed with its weight
                t = get(fh, name)
                keep = keep_fp8 is not None and keep_fp8(name)
                if t.dtype in FP8_DTYPES:
                    scale_name = name + SCALE_SUFFIX
                    if scale_name not in where:
                        raise CheckpointError(f"checkpoint tensor {name!r} is {str(t.dtype).removeprefix('torch.')} "
                                              f"but the checkpoint has no {scale_name!r} to dequantize it with")
                    scale = get(where[scale_name], scale_name)
                    if keep and t.dtype == FP8:
                        yield name, t
                        yield scale_name, scale.float()
                        continue
                    t = _dequantize(name, t, scale, block, dequantize_fp8_block)
                if keep:
                    raise CheckpointError(f"checkpoint tensor {name!r} is {str(t.dtype).removeprefix('torch.')} in "
                                          "an FP8 checkpoint whose expert weights the model keeps float8_e4m3fn; "
                                          "load it with fp8_experts='dequantize'")
                yield name, t


def fp8_targets(model) -> Callable:
    """keep_fp8 of iter_weights for this model: whether checkpoint tensor ``name`` lands in FP8 experts, either
    directly (a float8_e4m3fn parameter of that name: CED) or through a submodule that loads its own tensors
    and says so (MoEBlock.fp8_checkpoint_tensor, under the prefix the model's _delegates give it)."""
    from .quant import FP8

    direct = {n for n, p in model.named_parameters() if p.dtype == FP8}
    delegates = {prefix: mod for prefix, (mod, _) in model._delegates().items()
                 if hasattr(mod, "fp8_checkpoint_tensor")} if hasattr(model, "_delegates") else {}

    def keep(name: str) -> bool:
        if name in direct:
            return True
        head = name
        while "." in head:
            head = head.rsplit(".", 1)[0]
            if head in delegates:
                return delegates[head].fp8_checkpoint_tensor(name[len(head) + 1:])
        return False

    return keep


@contextmanager
def _reading(file: Path):
    """Errors of safetensors (a truncated or corrupt file) and of the OS as a CheckpointError naming the file."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as exc:
        raise CheckpointError(f"cannot read {file}: {exc}. The file is truncated or corrupt (an interrupted "
                              "download or copy?); fetch it again") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from None


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
    without a checkpoint on disk). Norm weights 1, everything else N(0, std); float32 router weights stay.
    FP8 experts: values N(0, 1) in float8_e4m3fn, block scales (``*_scale_inv``) std."""
    from .quant import FP8, SCALE_SUFFIX

    gen = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if gen is None or gen.device != p.device:
                gen = torch.Generator(device=p.device).manual_seed(seed)
            last = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
            if p.dtype == FP8:
                for e in range(p.shape[0]):  # one expert at a time: no float32 copy of them all
                    p[e].copy_(torch.randn(p.shape[1:], generator=gen, device=p.device).to(FP8))
            elif name.endswith(SCALE_SUFFIX):
                p.fill_(std)
            elif "norm" in last:
                p.fill_(1.0)
            elif name.endswith(("bias", "sink", "gate_bias", "e_score_correction_bias")):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)


# config.json model_type -> the architecture built when config.json has no "architectures" (as transformers'
# AutoModelForCausalLM maps it).
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", "ced": "CEDForCausalLM"}


def architecture(path: Path, hf_config: dict, supported: list) -> str:
    """The registered architecture to build: the first of config.json's ``architectures`` that is supported;
    without ``architectures``, the one its ``model_type`` stands for (MODEL_TYPES)."""
    archs = hf_config.get("architectures") or []
    if archs:
        arch = next((a for a in archs if a in supported), None)
        if arch is None:
            raise CheckpointError(f"{path}: architecture {archs} is not supported; supported: {', '.join(supported)}")
        return arch
    model_type = hf_config.get("model_type")
    arch = MODEL_TYPES.get(model_type)
    if arch in supported:
        log.info("%s: config.json has no architectures; model_type %r -> %s", path, model_type, arch)
        return arch
    types = ", ".join(t for t, a in MODEL_TYPES.items() if a in supported)
    what = f"model_type {model_type!r} is not supported" if model_type else "no model_type either"
    raise CheckpointError(f"{path}: config.json has no 'architectures' and {what}; supported model types: "
                          f"{types}; or set 'architectures' to one of: {', '.join(supported)}")


ALLOW_LONG_ENV = "DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN"


def trained_len(hf_config: dict, max_position: int) -> int:
    """The longest context the checkpoint was made for, as vLLM derives it: ``max_position`` (the model's
    max_position_embeddings), times the RoPE scaling factor for linear and dynamic scaling; for yarn,
    original_max_position_embeddings times the factor; llama3 scaling is already in max_position_embeddings."""
    raw = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    rope_type = (raw.get("rope_type") or raw.get("type")) if isinstance(raw, dict) else None
    factor = raw.get("factor") if rope_type in ("linear", "dynamic", "yarn") else None
    if not factor:
        return max_position
    base = raw.get("original_max_position_embeddings") if rope_type == "yarn" else None
    return max(max_position, int((base or max_position) * float(factor)))


def check_max_model_len(requested: Optional[int], hf_config: dict, max_position: int) -> int:
    """The context length to serve: ``requested``, or the checkpoint's ``max_position`` when None.

    More than the checkpoint was trained for (``trained_len``) is a ValueError naming both numbers, as in
    vLLM, unless DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1; then a warning (positions past the trained length give
    garbage for a RoPE model without scaling)."""
    if requested is None:
        return max_position
    limit = trained_len(hf_config, max_position)
    if requested <= limit:
        return requested
    source = f"max_position_embeddings={max_position}" + ("" if limit == max_position else " with RoPE scaling")
    msg = f"max_model_len={requested} is longer than the checkpoint's context of {limit} ({source})"
    if os.environ.get(ALLOW_LONG_ENV, "").strip().lower() not in ("1", "true", "yes"):
        raise ValueError(f"{msg}; pass a max_model_len <= {limit}, or set {ALLOW_LONG_ENV}=1 to allow it anyway")
    log.warning("%s; allowed by %s=1. Outputs past position %d may be garbage: a model is only trained to that "
                "length (a RoPE model without rope scaling extrapolates badly)", msg, ALLOW_LONG_ENV, limit)
    return requested


def build_model(path: Path, hf_config: dict, ops, dtype: torch.dtype, device, registry, load_format: str = "auto",
                fp8_experts: str = "fp8"):
    """load_format: "auto" reads the safetensors; "dummy" fills random weights (no weight files needed).

    fp8_experts (EngineConfig.fp8_experts): with an FP8 block-scaled checkpoint, "fp8" keeps the expert weights
    of every MoE module FP8 with their block scales (models/quant.py: 128x128 blocks and expert widths that are a
    multiple of 128; others are dequantized), "dequantize" dequantizes them to ``dtype`` like every other weight.
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format={load_format!r} is invalid: expected 'auto' or 'dummy'")
    if fp8_experts not in FP8_EXPERTS:
        raise ValueError(f"fp8_experts={fp8_experts!r} is invalid: expected one of {FP8_EXPERTS}")
    from .quant import fp8_block_size, store_experts_fp8

    arch = architecture(path, hf_config, registry.names("model"))
    entry = registry.get("model", arch)
    with torch.device("meta"):
        model = entry.obj(hf_config, ops)
    model = model.to(dtype)  # cast on meta first: no float32 copy of a big model
    block = fp8_block_size(hf_config)
    if block is not None and fp8_experts == "fp8":
        kept = store_experts_fp8(model, block)  # still on meta
        log.info("%s: FP8 checkpoint (%dx%d blocks): experts of %d MoE module(s) stay FP8", arch, *block, len(kept))
    model = model.to_empty(device=device)
    if load_format == "dummy":
        dummy_init_(model)
    else:
        model.load_weights(iter_weights(path, hf_config, keep_fp8=fp8_targets(model)))
    if hasattr(model, "after_load"):  # e.g. joined projections (CEDForCausalLM.after_load)
        model.after_load()
    model.eval()
    log.info("loaded %s from %s (%s, %s, provided by %s)", arch, path, dtype, device, entry.plugin)
    return model
