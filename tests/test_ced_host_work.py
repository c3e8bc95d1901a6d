"""Host work of a CED step does not grow with the layers: the index tensors every layer reads alike are copied to
the device once per step (engine_path.Shared, _Compression), and the router's float32 weights are kept only
while the parameters are unchanged."""

from __future__ import annotations

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.ced import engine_path
from deepinfer.testing.ced import REPLAY_CONFIG, build_ced_checkpoint

DEEP = dict(REPLAY_CONFIG, num_layers=10, num_encoder_layers=5,
            layer_modes=("swa", "full", "reuse", "reuse", "reuse", "full", "reindex", "reuse", "reuse", "reuse"))


def copies_per_prefill(path, monkeypatch) -> int:
    llm = LLM(str(path), num_kv_blocks=32, block_size=4, enable_prefix_caching=False)
    seen = []
    for name in ("to_device", "staged_copy"):  # (the step's index lists go through staged_copy)
        real = getattr(engine_path, name)
        monkeypatch.setattr(engine_path, name, lambda *a, _real=real, **k: seen.append(1) or _real(*a, **k))
    llm.generate([list(range(3, 22))], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    monkeypatch.undo()
    return len(seen)


def test_host_copies_do_not_grow_with_layers(tmp_path, monkeypatch):
    build_ced_checkpoint(tmp_path / "a", seed=1, **REPLAY_CONFIG)
    build_ced_checkpoint(tmp_path / "b", seed=1, **DEEP)
    shallow, deep = copies_per_prefill(tmp_path / "a", monkeypatch), copies_per_prefill(tmp_path / "b", monkeypatch)
    assert shallow > 0 and deep == shallow, (shallow, deep)


def test_router_float32_weights_follow_the_parameters(tmp_path):
    build_ced_checkpoint(tmp_path, seed=2, **REPLAY_CONFIG)
    model = LLM(str(tmp_path), num_kv_blocks=16, block_size=4, dtype="bfloat16").engine.model
    layer = model.layers[1]
    with torch.no_grad():
        g, b = layer._router_f32()
        assert g.dtype == torch.float32 and torch.equal(g, layer.gate.float()) and layer._router_f32()[0] is g
        layer.gate.mul_(2)  # an in-place change (load_weights, EPLB's set_parameters) is seen
        layer.gate_bias.add_(1)
        g2, b2 = layer._router_f32()
        assert torch.equal(g2, layer.gate.float()) and torch.equal(b2, layer.gate_bias.float())
    layer.gate.requires_grad_(True)
    g3, _ = layer._router_f32()  # under autograd: a fresh cast that carries the gradient
    assert g3.requires_grad


def test_host_before_forward_bench_writes_its_row(tmp_path):
    """benchmarks/host_before_forward.py (its layers stubbed, so it runs in seconds): one row, the time to the
    forward inside the whole generate's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, str(root / "benchmarks" / "host_before_forward.py"), "--tokens", "256",
                    "--repeats", "2", "--label", "t", "--out", str(out)], check=True, capture_output=True, timeout=300)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["tokens"] == 256 and row["label"] == "t"
    assert 0 < row["to_forward_ms"] < row["generate_ms"]
    assert 0 < row["passes_ms"] < row["generate_ms"] and 0 < row["plan_ms"] < row["generate_ms"]
