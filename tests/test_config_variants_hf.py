"""Config variants of the served architectures where our reading of config.json once differed from transformers'.

Each case writes a tiny random checkpoint with transformers (float32) and compares the prefill logits of both of
our paths (``forward_full`` and the paged engine forward, chunked over scattered blocks) with transformers' own:

* Qwen3-MoE with ``use_sliding_window``: every layer slides (it has no max_window_layers), not Qwen3's layers
  from max_window_layers on;
* Qwen2-MoE's config.json without ``layer_types`` (transformers-4 era): transformers 5 fills them in as every
  other layer below max_window_layers;
* shared experts of width 0 (Qwen2-MoE shared_expert_intermediate_size 0, DeepSeek n_shared_experts 0):
  transformers writes empty projections (and Qwen2-MoE a gate of their zero output); they load as no shared expert;
* ``partial_rotary_factor`` on a Llama: transformers' Llama rotates the whole head whatever the factor;
* DeepSeek's ``moe_layer_freq`` (honoured, unlike transformers): a checkpoint with experts where it puts a dense
  layer fails naming the layer.

Prompts are longer than the sliding windows, so a wrong choice of sliding layers changes the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM
from deepinfer.testing.compare import MODEL_FACTOR, assert_logits_close
from deepinfer.testing.engine import paged_prefill_logits
from deepinfer.testing.models import build_tiny_hf_model

PROMPT_LENS = [5, 23, 41]
WINDOW = 8
CASES = {
    "qwen3-moe-sliding": ("qwen3-moe", dict(use_sliding_window=True, sliding_window=WINDOW), False),
    "qwen3-moe-sliding-mwl1": ("qwen3-moe", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                 max_window_layers=1), False),
    "qwen2-moe-sliding-no-layer-types": ("qwen2-moe", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                           max_window_layers=3), True),
    "qwen2-moe-no-shared": ("qwen2-moe", dict(shared_expert_intermediate_size=0), False),
    "deepseek_v3-no-shared": ("deepseek_v3", dict(n_shared_experts=0), False),
    "deepseek_v2-no-shared": ("deepseek_v2", dict(n_shared_experts=0), False),
    "llama-partial-rotary": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5}), False),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    name, overrides, strip_layer_types = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_hf_model(path, name, init_range=0.3, random_norms_and_biases=True, **overrides)
    if strip_layer_types:  # as a config.json written before transformers had the field
        cfg = json.loads((Path(path) / "config.json").read_text())
        assert cfg.pop("layer_types", None) is not None
        (Path(path) / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0].float() for p in prompts]
    return request.param, str(path), hf, prompts, refs


def test_sliding_layers_are_transformers(case):
    """The layers that slide are the ones transformers' model applies a window to (read from its config)."""
    name, path, hf, _, _ = case
    net = LLM(path, num_kv_blocks=64, block_size=4).engine.model
    types = getattr(hf.config, "layer_types", None)
    window = getattr(hf.config, "sliding_window", None)
    if types is None:  # (Qwen3-MoE: one window for every layer, None when use_sliding_window is off)
        types = ["sliding_attention" if window else "full_attention"] * hf.config.num_hidden_layers
    expected = tuple(window if t == "sliding_attention" else None for t in types)
    windows = getattr(net.config, "windows", expected)  # (DeepSeek: no sliding layers)
    assert windows == expected, name
    if "sliding" in name:
        assert any(w is not None for w in windows) and max(PROMPT_LENS) > WINDOW


def test_prefill_logits_match_transformers(case):
    name, path, _, prompts, refs = case
    net = LLM(path, num_kv_blocks=64, block_size=4).engine.model
    paged = paged_prefill_logits(net, prompts, block_size=4, chunk=7, seed=3)
    for p, got, ref in zip(prompts, paged, refs):
        with torch.no_grad():
            full = net.forward_full(torch.tensor(p))
        assert_logits_close(full, ref, factor=MODEL_FACTOR, what=f"{name}, forward_full, prompt of {len(p)}")
        assert_logits_close(got, ref, factor=MODEL_FACTOR, what=f"{name}, engine, prompt of {len(p)}")


def test_zero_width_shared_expert_loads_as_none(case):
    name, path, _, _, _ = case
    if "no-shared" not in name:
        pytest.skip("a case with a shared expert of width 0")
    net = LLM(path, num_kv_blocks=64, block_size=4).engine.model
    blocks = [m for m in net.modules() if hasattr(m, "shared_size") and hasattr(m, "num_experts")]
    assert blocks and all(b.shared_size == 0 for b in blocks)


def test_nonempty_shared_expert_is_still_refused(tmp_path):
    """Only an empty shared expert is skipped: real shared weights where the config says none are an error."""
    from safetensors.torch import load_file, save_file

    build_tiny_hf_model(tmp_path, "qwen2-moe", shared_expert_intermediate_size=0)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("shared_expert.down_proj.weight"))
    tensors[name] = torch.zeros(tensors[name].shape[0], 16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match="shared_expert.down_proj"):
        LLM(str(tmp_path), num_kv_blocks=16, block_size=4)


def test_moe_layer_freq_mismatch_names_the_dense_layer(tmp_path):
    """DeepSeek's moe_layer_freq is honoured (layer i is MoE when i % freq == 0, as DeepSeek's own code has it);
    transformers ignores it and writes experts for every layer, and such a checkpoint fails naming the rule."""
    build_tiny_hf_model(tmp_path, "deepseek_v3", first_k_dense_replace=0, moe_layer_freq=2)
    with pytest.raises(Exception, match=r"layer 1 is dense under it, the MoE layers are \[0, 2\]"):
        LLM(str(tmp_path), num_kv_blocks=16, block_size=4)
