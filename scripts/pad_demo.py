"""A memory-bound CED target that computes what the bundled demo computes: its shared experts widened.

    python scripts/pad_demo.py --out /tmp/ced_padded --shared-gb 8 --device cuda   # ~8 GB of weights a step reads

Issue 15 asks for speculative decoding measured on a target whose decode is memory-bound. The demo model (7.9M
parameters) is host-bound on the H200, and a larger CED trained on the device in minutes is a weak model whose
drafts rarely stand. This keeps the demo's function and its trained DSpark drafter, and makes every decode step
read as many bytes as a model of several billion parameters: each layer's shared expert (a SwiGLU MLP every
token runs) gets extra intermediate columns, random gate and up rows (the demo's own scale) and zero down
columns, so their contribution is exactly zero while every step reads them (GEMMs do not skip zeros). Outputs
equal the demo's up to rounding (a longer reduction), and so do its drafts' acceptance (tests/test_pad_demo.py).
What it does not model: a real large model's attention and KV bytes (the demo's are tiny) and its expert
routing; compute per token grows with the padding, so at high concurrency it turns compute-bound, as a dense
model of that size does. Not shipped (GBs); written where --out says, beside the demo's tokenizer, held-out
text and dspark/ drafter (benchmarks/spec_sweep.py --targets path --model DIR --text-prompts).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.models.ced.train import write_safetensors
from deepinfer.models.loader import safetensors_files

COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "heldout_sample.txt")


def load_tensors(src: Path) -> dict:
    out = {}
    for path in safetensors_files(src):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def widen(w13: torch.Tensor, w2: torch.Tensor, extra: int, gen: torch.Generator, device) -> tuple:
    """shared_w13 [2 Fs, d] (gate rows, then up rows) and shared_w2 [d, Fs] -> the same with Fs + extra
    intermediate columns: random gate and up rows at the old rows' scale, zero down columns."""
    Fs, d = w2.shape[1], w2.shape[0]
    gate, up = w13[:Fs], w13[Fs:]

    def rand(like):
        r = torch.randn(extra, d, generator=gen, device=device, dtype=torch.float32) * like.float().std()
        return r.to(like.dtype).cpu()

    new13 = torch.cat([gate, rand(gate), up, rand(up)])
    new2 = torch.cat([w2, torch.zeros(d, extra, dtype=w2.dtype)], dim=1)
    return new13.contiguous(), new2.contiguous()


def pad(src: Path, out: Path, n_shared: int, seed: int = 0, device: str = "cpu") -> dict:
    """Write the padded checkpoint; returns a summary (shapes, bytes)."""
    cfg = json.loads((src / "config.json").read_text())
    old = int(cfg.get("n_shared_experts", 0))
    if old < 1:
        raise ValueError(f"{src}: n_shared_experts={old}; padding widens the shared experts, there are none")
    if n_shared <= old:
        raise ValueError(f"--shared-experts {n_shared} must exceed the model's n_shared_experts={old}")
    Fe = int(cfg["moe_intermediate_size"])
    extra = Fe * (n_shared - old)
    tensors = load_tensors(src)
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = sorted({k.split(".")[1] for k in tensors if k.endswith(".shared_w13")}, key=int)
    for i in layers:
        a, b = f"layers.{i}.shared_w13", f"layers.{i}.shared_w2"
        tensors[a], tensors[b] = widen(tensors[a], tensors[b], extra, gen, device)
    _, total = write_safetensors(tensors, out, 4 * 2**30)  # shards of at most ~4 GB
    cfg["n_shared_experts"] = n_shared
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    if (src / "dspark").is_dir():
        shutil.copytree(src / "dspark", out / "dspark", dirs_exist_ok=True)
    shared = sum(tensors[f"layers.{i}.shared_w13"].numel() + tensors[f"layers.{i}.shared_w2"].numel()
                 for i in layers) * tensors[f"layers.{layers[0]}.shared_w2"].element_size()
    summary = {"source": str(src), "n_shared_experts": [old, n_shared], "layers": len(layers),
               "shared_intermediate": Fe * n_shared, "shared_expert_bytes": shared, "total_bytes": total}
    (out / "PADDED.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="the CED checkpoint to pad (default: the bundled demo)")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--shared-experts", type=int, help="the new n_shared_experts")
    group.add_argument("--shared-gb", type=float, help="about this many GB of shared-expert weights in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the random rows are drawn (cuda: fast)")
    args = ap.parse_args(argv)
    from deepinfer.models.loader import resolve_model_path

    src = Path(args.model or resolve_model_path(None))
    n = args.shared_experts
    if n is None:
        cfg = json.loads((src / "config.json").read_text())
        per_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2 * cfg["num_layers"]  # bf16, all layers
        n = max(int(cfg.get("n_shared_experts", 0)) + 1, round(args.shared_gb * 1e9 / per_expert))
    print(json.dumps(pad(src, Path(args.out), n, args.seed, args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
