"""`deepinfer init-model`: every architecture the engine runs, the default size per architecture, writing
into an existing directory (refused, or --force), and no half-written directory on failure."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.cli import main
from deepinfer.init_model import ARCHS, create_checkpoint


def init(capsys, *argv):
    code = main(["init-model", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


# --- the mixture-of-experts and DeepSeek families -------------------------------------------------------------

MOE = {"mixtral": "MixtralForCausalLM", "qwen2-moe": "Qwen2MoeForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM",
       "deepseek-v2": "DeepseekV2ForCausalLM", "deepseek-v3": "DeepseekV3ForCausalLM"}


@pytest.mark.parametrize("arch", sorted(MOE))
def test_moe_archs_write_a_checkpoint_the_engine_and_transformers_load(tmp_path, capsys, arch):
    from deepinfer import LLM, SamplingParams

    code, out, err = init(capsys, "--arch", arch, "--out", tmp_path, "--vocab-size", 300, "--seed", 3)
    assert code == 0, err
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [MOE[arch]] and f"wrote {MOE[arch]} (tiny: 4 layers" in out
    llm = LLM(model=str(tmp_path), max_model_len=64)
    model = llm.engine.model
    assert model.moe_blocks() and model.vocab_size == 300
    # DeepSeek keeps layer 0 dense (first_k_dense_replace=1); the Llama-family MoE models are sparse throughout.
    assert model.moe_layers == ([1, 2, 3] if arch.startswith("deepseek") else [0, 1, 2, 3])
    got = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0), use_tqdm=False)
    assert len(got[0].outputs[0].token_ids) == 3
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.arange(5, 25)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids[None]).logits[0], model.forward_full(ids), atol=1e-4, rtol=1e-4)


# --- sizes ----------------------------------------------------------------------------------------------------

def test_every_arch_has_a_valid_default_size():
    for name, spec in ARCHS.items():
        assert spec.default_size in spec.sizes, name


def test_ced_writes_with_its_default_size(tmp_path, capsys):
    from deepinfer.models.ced.config import SIZES, CEDConfig

    code, out, err = init(capsys, "--arch", "ced", "--out", tmp_path, "--vocab-size", 300)
    assert code == 0, err
    cfg = json.loads((tmp_path / "config.json").read_text())
    want = CEDConfig(**{**SIZES["toy"], "vocab_size": cfg["vocab_size"]}).to_hf()
    assert {k: cfg[k] for k in want} == json.loads(json.dumps(want)) and "(toy:" in out


def test_a_size_the_arch_lacks_exits_2(tmp_path, capsys):
    code, _, err = init(capsys, "--arch", "ced", "--size", "tiny", "--out", tmp_path / "x")
    assert code == 2 and err.startswith("error:") and "toy" in err
    assert not (tmp_path / "x").exists()


# --- where it writes --------------------------------------------------------------------------------------------

def test_a_failed_write_leaves_no_directory(tmp_path, capsys, monkeypatch):
    import safetensors.torch

    def broken(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    code, _, err = init(capsys, "--arch", "llama", "--out", tmp_path / "ckpt")
    assert code == 2 and "No space left on device" in err
    assert list(tmp_path.iterdir()) == []  # neither the directory nor the temporary sibling
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    code, _, _ = init(capsys, "--arch", "llama", "--out", tmp_path / "kept", "--force")
    assert code == 2 and [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_a_non_empty_directory_is_refused_without_force(tmp_path, capsys):
    assert create_checkpoint(tmp_path / "c", "llama", vocab_size=300)["vocab_size"] == 300
    before = {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    code, out, err = init(capsys, "--arch", "qwen3", "--out", tmp_path / "c")
    assert code == 2 and out == "" and err.startswith("error:") and "not empty" in err and "--force" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()} == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert init(capsys, "--arch", "llama", "--out", empty, "--vocab-size", 300)[0] == 0  # an empty one is fine
    assert (empty / "model.safetensors").exists()


def test_force_replaces_a_sharded_checkpoint(tmp_path, capsys):
    """The old shards and index go (else the loader reads them and the parameter count is theirs); other
    files stay; the result loads."""
    from safetensors.torch import save_file

    from deepinfer import LLM

    d = tmp_path / "c"
    d.mkdir()
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for i, name in enumerate(shards):
        save_file({f"model.layers.{i}.big": torch.zeros(1000, 1000)}, str(d / name))
    index = {"metadata": {}, "weight_map": {f"model.layers.{i}.big": n for i, n in enumerate(shards)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text("{}")
    (d / "README.md").write_text("my notes")
    (d / "runs").mkdir()
    code, out, err = init(capsys, "--arch", "llama", "--out", d, "--force", "--seed", 7)
    assert code == 0, err
    assert "3.67M parameters" in out  # the new checkpoint's count, not the old shards' 2M more
    assert sorted(p.name for p in d.iterdir()) == sorted(
        ["README.md", "runs", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"])
    assert (d / "README.md").read_text() == "my notes"
    assert LLM(model=str(d), max_model_len=32).hf_config["architectures"] == ["LlamaForCausalLM"]
