"""The checkpoint loader: bad checkpoints fail with errors that say what is wrong; good ones load in every
layout and spelling (sharded safetensors, transformers 4 and 5 config.json) to the same model."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.models import loader
from deepinfer.models.base import WeightError
from deepinfer.models.llama import ARCHITECTURES
from deepinfer.models.loader import CheckpointError
from deepinfer.testing.models import build_tiny_hf_model

PROMPT = [5, 17, 200, 33, 91, 7, 150, 64, 12, 300, 41, 8, 77, 19]  # longer than qwen2's window (10)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict:
    """name -> (checkpoint dir, transformers model); never modified by the tests (they copy)."""
    out = {}
    for name in ("llama", "llama-tied", "qwen2"):
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, build_tiny_hf_model(d, name))
    return out


def clone(src: Path, dst: Path, drop=()) -> Path:
    shutil.copytree(src, dst)
    for f in drop:
        (dst / f).unlink()
    return dst


def edit_config(d: Path, fn) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    cfg = fn(cfg) or cfg
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


def edit_weights(d: Path, fn) -> None:
    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def logits(llm: LLM, ids=PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return llm.engine.model.forward_full(torch.tensor(ids))


def greedy(llm: LLM, n: int = 12) -> list:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids


def small_llm(path, **kw) -> LLM:
    return LLM(str(path), num_kv_blocks=16, block_size=4, **kw)


# Bad checkpoints.

def test_missing_config_json(ckpts, tmp_path):
    d = clone(ckpts["llama"][0], tmp_path / "m", drop=["config.json"])
    with pytest.raises(CheckpointError, match="config.json"):
        small_llm(d)
    with pytest.raises(CheckpointError, match="config.json"):
        loader.load_config(d)


def test_invalid_config_json(ckpts, tmp_path):
    d = clone(ckpts["llama"][0], tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        small_llm(d)


def test_pickle_only_checkpoint_is_refused_unopened(ckpts, tmp_path):
    d = clone(ckpts["llama"][0], tmp_path / "m", drop=["model.safetensors"])
    marker = tmp_path / "unpickled"

    class Trap:  # unpickling this file would create `marker`
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Trap()}))
    with pytest.raises(CheckpointError) as info:
        small_llm(d)
    msg = str(info.value)
    assert "pytorch_model.bin" in msg and "pickle" in msg and "safetensors" in msg
    assert not marker.exists()


def test_no_weights_at_all(ckpts, tmp_path):
    d = clone(ckpts["llama"][0], tmp_path / "m", drop=["model.safetensors"])
    with pytest.raises(CheckpointError, match="safetensors"):
        small_llm(d)


def test_unknown_architecture_lists_supported(ckpts, tmp_path):
    d = clone(ckpts["llama"][0], tmp_path / "m")
    edit_config(d, lambda c: c.update(architectures=["FancyNewForCausalLM"]))
    with pytest.raises(CheckpointError) as info:
        small_llm(d)
    msg = str(info.value)
    assert "FancyNewForCausalLM" in msg
    for arch in ARCHITECTURES:
        assert arch in msg


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.down_proj.weight",
                                    "model.layers.0.self_attn.k_proj.weight",  # one part of a fused q/k/v
                                    "model.layers.1.mlp.up_proj.weight",  # one part of fused gate/up
                                    "lm_head.weight", "model.norm.weight"])
def test_missing_tensor_is_named(ckpts, tmp_path, tensor):
    d = clone(ckpts["llama"][0], tmp_path / "m")
    edit_weights(d, lambda sd: sd.pop(tensor))
    with pytest.raises(WeightError, match="lacks") as info:
        small_llm(d)
    assert tensor in str(info.value)


@pytest.mark.parametrize("tensor", ["model.layers.0.self_attn.v_proj.weight", "model.norm.weight",
                                    "model.layers.1.mlp.gate_proj.weight", "model.embed_tokens.weight"])
def test_wrong_shape_tensor_is_named(ckpts, tmp_path, tensor):
    d = clone(ckpts["llama"][0], tmp_path / "m")
    edit_weights(d, lambda sd: sd.__setitem__(tensor, torch.zeros(*[n + 1 for n in sd[tensor].shape])))
    with pytest.raises(WeightError) as info:
        small_llm(d)
    assert tensor in str(info.value) and "shape" in str(info.value)


def test_unexpected_tensor_is_named(ckpts, tmp_path):
    d = clone(ckpts["llama"][0], tmp_path / "m")
    edit_weights(d, lambda sd: sd.__setitem__("model.layers.7.mlp.down_proj.weight", torch.zeros(64, 128)))
    with pytest.raises(WeightError, match=r"model\.layers\.7\.mlp\.down_proj\.weight"):
        small_llm(d)


def test_tied_checkpoint_may_still_store_the_head(ckpts, tmp_path):
    """Some tied checkpoints also save lm_head.weight (a copy of the embedding); it is ignored."""
    d = clone(ckpts["llama-tied"][0], tmp_path / "m")
    edit_weights(d, lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"].clone()))
    torch.testing.assert_close(logits(small_llm(d)), logits(small_llm(ckpts["llama-tied"][0])), rtol=0, atol=0)


# Layouts.

def write_shards(src: Path, dst: Path, num_shards: int) -> list:
    """Split src's model.safetensors into num_shards files plus model.safetensors.index.json."""
    dst = clone(src, dst, drop=["model.safetensors"])
    sd = load_file(str(src / "model.safetensors"))
    names = sorted(sd)
    files, weight_map = [], {}
    for k in range(num_shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: sd[n] for n in names[k::num_shards]}  # interleaved: fused q/k/v parts land in different shards
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        files.append(fname)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
             "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_sharded_checkpoint_matches_single_file(ckpts, tmp_path, name):
    src = ckpts[name][0]
    files = write_shards(src, tmp_path / "sharded", 3)
    assert [p.name for p in loader.safetensors_files(tmp_path / "sharded")] == files
    single, sharded = small_llm(src), small_llm(tmp_path / "sharded")
    a, b = single.engine.model.state_dict(), sharded.engine.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    torch.testing.assert_close(logits(sharded), logits(single), rtol=0, atol=0)
    assert greedy(sharded) == greedy(single)


def test_index_naming_a_missing_shard(ckpts, tmp_path):
    files = write_shards(ckpts["llama"][0], tmp_path / "sharded", 2)
    (tmp_path / "sharded" / files[1]).unlink()
    with pytest.raises(CheckpointError, match=files[1]):
        small_llm(tmp_path / "sharded")


# config.json spellings.

def _v4_spelling(cfg: dict) -> None:
    """Rewrite a transformers-5 config.json in transformers-4 spelling."""
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    if rp.get("rope_type", "default") != "default":
        rp["type"] = rp.pop("rope_type")  # the legacy key
        cfg["rope_scaling"] = rp
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)  # v4 Qwen2 derives its windows from use_sliding_window / max_window_layers


@pytest.mark.parametrize("name", ["llama-tied", "qwen2"])
def test_transformers_4_and_5_spellings_agree(ckpts, tmp_path, name):
    src, hf = ckpts[name]
    v5 = json.loads((src / "config.json").read_text())
    assert "rope_parameters" in v5 and "dtype" in v5 and "rope_theta" not in v5  # written by transformers 5
    d4 = clone(src, tmp_path / "v4")
    v4 = edit_config(d4, _v4_spelling)
    assert "rope_parameters" not in v4 and "torch_dtype" in v4 and "rope_theta" in v4
    llm5, llm4 = small_llm(src), small_llm(d4)
    assert llm4.engine.model.config == llm5.engine.model.config
    torch.testing.assert_close(logits(llm4), logits(llm5), rtol=0, atol=0)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits(llm4), ref, rtol=1e-4, atol=1e-5)
    assert greedy(llm4) == greedy(llm5)


@pytest.mark.parametrize("spelling", ["v4", "v5"])
def test_rope_theta_is_read_in_both_spellings(ckpts, tmp_path, spelling):
    """A different theta changes the logits, so the agreement above is not vacuous."""
    src = ckpts["llama"][0]
    d = clone(src, tmp_path / "m")

    def set_theta(cfg):
        if spelling == "v4":
            _v4_spelling(cfg)
            cfg["rope_theta"] = 37.0
        else:
            cfg["rope_parameters"]["rope_theta"] = 37.0

    edit_config(d, set_theta)
    llm = small_llm(d)
    assert llm.engine.model.config.rope["rope_theta"] == 37.0
    assert not torch.allclose(logits(llm), logits(small_llm(src)), rtol=1e-3, atol=1e-3)


def test_v4_qwen2_sliding_window_fields_are_read(ckpts, tmp_path):
    d = clone(ckpts["qwen2"][0], tmp_path / "m")
    edit_config(d, _v4_spelling)
    assert small_llm(d).engine.model.config.windows == (None, 10, 10)  # layers >= max_window_layers slide
    edit_config(d, lambda c: c.update(use_sliding_window=False))
    assert small_llm(d).engine.model.config.windows == (None, None, None)


def test_dtype_auto_is_float32_on_cpu_and_explicit_dtype_wins(ckpts, tmp_path):
    d = clone(ckpts["llama"][0], tmp_path / "m")
    edit_config(d, lambda c: c.update(dtype="bfloat16"))
    assert next(small_llm(d).engine.model.parameters()).dtype == torch.float32
    assert next(small_llm(d, dtype="bfloat16").engine.model.parameters()).dtype == torch.bfloat16


# Resolving a model name.

def test_env_model_dir_resolves_a_name(ckpts, tmp_path, monkeypatch):
    root = tmp_path / "models"
    root.mkdir()
    clone(ckpts["llama"][0], root / "tiny-llama")
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # so a relative "tiny-llama" is not found by accident
    assert loader.resolve_model_path("tiny-llama") == root / "tiny-llama"
    assert loader.resolve_model_path("some-org/tiny-llama") == root / "tiny-llama"  # the repo id's last part
    llm = small_llm("some-org/tiny-llama")
    assert llm.model_path == root / "tiny-llama"
    torch.testing.assert_close(logits(llm), logits(small_llm(ckpts["llama"][0])), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="not-there"):
        loader.resolve_model_path("some-org/not-there")


def test_env_model_dir_pointing_at_a_checkpoint_is_the_default_model(ckpts, monkeypatch):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(ckpts["llama"][0]))
    assert loader.resolve_model_path(None) == ckpts["llama"][0]


def test_model_path_that_is_a_file(ckpts, monkeypatch):
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    with pytest.raises(CheckpointError, match="config.json"):
        loader.resolve_model_path(str(ckpts["llama"][0] / "model.safetensors"))


def test_no_model_and_no_demo_is_a_clear_error(monkeypatch):
    if (loader.DEMO_DIR / "config.json").exists():
        pytest.skip("the bundled demo model is installed")
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    with pytest.raises(CheckpointError) as info:
        LLM(model=None)
    msg = str(info.value)
    assert "demo" in msg and "model=" in msg


def test_dummy_load_format_needs_no_weights(tmp_path):
    import json

    from deepinfer import LLM, SamplingParams
    from deepinfer.testing.tokenizers import build_test_tokenizer

    tok = build_test_tokenizer(tmp_path, vocab_size=300)
    cfg = dict(architectures=["LlamaForCausalLM"], hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=tok.vocab_size, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", num_kv_blocks=8)
    out = llm.generate(["a"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    norms = [p for n, p in llm.engine.model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tmp_path), load_format="pickle")
