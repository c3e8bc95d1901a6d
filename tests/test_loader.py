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
from deepinfer.cli import main
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


def cli(capsys, *argv) -> tuple:
    """(exit code, stderr) of the deepinfer command; stderr must be one clean error, never a traceback."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_shard_is_a_checkpoint_error_naming_it(ckpts, tmp_path, capsys, damage):
    files = write_shards(ckpts["llama"][0], tmp_path / "sharded", 3)
    shard = tmp_path / "sharded" / files[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"\x00garbage" * 100)
    with pytest.raises(CheckpointError) as info:
        small_llm(tmp_path / "sharded")
    msg = str(info.value)
    assert str(shard) in msg and "truncated or corrupt" in msg
    code, err = cli(capsys, "generate", "--model", tmp_path / "sharded", "--max-tokens", 1, "hi")
    assert code == 2 and err.startswith("error: ") and files[1] in err and "truncated or corrupt" in err


def test_corrupt_index_json_is_named(ckpts, tmp_path):
    write_shards(ckpts["llama"][0], tmp_path / "sharded", 2)
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is not valid JSON"):
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


def test_no_model_and_no_demo_is_a_clear_error(ckpts, tmp_path, monkeypatch, capsys):
    """model=None is the demo model where there is one, else an error that says how to pass one."""
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    monkeypatch.setattr(loader, "DEMO_DIR", ckpts["llama"][0])
    assert loader.resolve_model_path(None) == ckpts["llama"][0]
    monkeypatch.setattr(loader, "DEMO_DIR", tmp_path)  # an empty directory: no demo installed
    with pytest.raises(CheckpointError) as info:
        LLM(model=None)
    msg = str(info.value)
    assert "demo" in msg and "model=" in msg and str(tmp_path) in msg
    code, err = cli(capsys, "generate", "hi")
    assert code == 2 and "demo" in err and "--model" in err


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


# Resolving a model name: paths, ids in the local Hugging Face cache, and never the network.

@pytest.fixture
def no_network(monkeypatch) -> list:
    """Every attempt to open a connection is recorded and refused; the test asserts the list stays empty."""
    import socket

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("the network is off in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face hub cache of our own (what HF_HOME/hub or HF_HUB_CACHE would point at)."""
    import huggingface_hub.constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # offline or not, the loader never goes online
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    return cache


@pytest.mark.parametrize("name", ["./no-such-ckpt", "~/no-such-ckpt-deepinfer", "/no/such/ckpt", "a/b/c",
                                  "dir\\ckpt", "../ckpt"])
def test_a_path_that_does_not_exist_says_no_such_directory(hf_cache, no_network, name):
    with pytest.raises(CheckpointError) as info:
        loader.resolve_model_path(name)
    msg = str(info.value)
    assert "no such directory" in msg and repr(name) in msg and "Hugging Face" not in msg
    assert not no_network


def test_an_id_not_in_the_local_cache_says_how_to_put_it_there(hf_cache, no_network):
    with pytest.raises(CheckpointError) as info:
        loader.resolve_model_path("some-org/not-cached")
    msg = str(info.value)
    assert "not in the local Hugging Face cache" in msg and str(hf_cache) in msg
    assert "hf download some-org/not-cached" in msg and "HF_HOME" in msg and "DEEPINFER_HF_MODEL_DIR" in msg
    assert not no_network


def test_an_id_in_the_local_cache_loads_from_its_snapshot(ckpts, hf_cache, no_network):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_cache / "models--some-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = clone(ckpts["llama"][0], repo / "snapshots" / commit)
    assert loader.resolve_model_path("some-org/tiny-llama") == snapshot
    llm = small_llm("some-org/tiny-llama")
    assert llm.model_path == snapshot
    torch.testing.assert_close(logits(llm), logits(small_llm(ckpts["llama"][0])), rtol=0, atol=0)
    assert not no_network


# config.json without "architectures": model_type, as transformers maps it.

def test_model_types_map_to_registered_architectures_as_transformers_does():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from deepinfer.core.plugins import get_registry

    registered = set(get_registry().names("model"))
    assert set(loader.MODEL_TYPES.values()) == registered  # every built-in architecture has its model_type
    for model_type, arch in loader.MODEL_TYPES.items():
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, arch) == arch, model_type  # ced is ours alone


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_config_without_architectures_uses_model_type(ckpts, tmp_path, name):
    """qwen2 differs from llama (q/k/v bias, sliding windows), so building the wrong one would not load."""
    d = clone(ckpts[name][0], tmp_path / "m")
    cfg = edit_config(d, lambda c: c.pop("architectures") and None)
    assert "architectures" not in cfg and cfg["model_type"] == name
    torch.testing.assert_close(logits(small_llm(d)), logits(small_llm(ckpts[name][0])), rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["gpt2", None])
def test_config_without_architectures_and_unknown_model_type(ckpts, tmp_path, model_type):
    d = clone(ckpts["llama"][0], tmp_path / "m")
    cfg = edit_config(d, lambda c: c.pop("architectures") and c.update(model_type=model_type))
    assert "architectures" not in cfg and cfg["model_type"] == model_type
    with pytest.raises(CheckpointError) as info:
        small_llm(d)
    msg = str(info.value)
    assert "architectures" in msg and (model_type is None or repr(model_type) in msg)
    for t in loader.MODEL_TYPES:
        assert t in msg


# max_model_len past the checkpoint's context.

def test_max_model_len_longer_than_the_checkpoint_is_refused(ckpts, monkeypatch, capsys):
    monkeypatch.delenv(loader.ALLOW_LONG_ENV, raising=False)
    src = ckpts["llama"][0]  # max_position_embeddings 512
    with pytest.raises(ValueError, match=r"max_model_len=100000.*512") as info:
        small_llm(src, max_model_len=100000)
    assert loader.ALLOW_LONG_ENV in str(info.value)
    llm = LLM(str(src), max_model_len=512, num_kv_blocks=32, block_size=16)
    assert llm.engine.max_model_len == 512  # the checkpoint's own length is fine
    code, err = cli(capsys, "generate", "--model", src, "--max-model-len", 100000, "hi")
    assert code == 2 and err.startswith("error: ") and "100000" in err and "512" in err


def test_allow_long_max_model_len_warns(ckpts, monkeypatch, caplog):
    monkeypatch.setenv(loader.ALLOW_LONG_ENV, "1")
    with caplog.at_level("WARNING", logger=loader.__name__):
        llm = LLM(str(ckpts["llama"][0]), max_model_len=2048, num_kv_blocks=128, block_size=16)
    assert llm.engine.max_model_len == 2048
    assert "garbage" in caplog.text and "2048" in caplog.text and "512" in caplog.text


@pytest.mark.parametrize("scaling, expected", [
    (None, 512),
    ({"rope_type": "linear", "factor": 2.0}, 1024),
    ({"type": "dynamic", "factor": 4.0}, 2048),  # the transformers-4 key
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, 512),  # DeepSeek-style
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 2048),  # Qwen-style
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}, 512),  # already included
])
def test_trained_len_follows_rope_scaling_as_vllm(scaling, expected):
    for key in ("rope_scaling", "rope_parameters"):
        assert loader.trained_len({key: scaling}, 512) == expected
    if scaling is not None:
        assert loader.check_max_model_len(expected, {"rope_scaling": scaling}, 512) == expected
        with pytest.raises(ValueError, match=str(expected)):
            loader.check_max_model_len(expected + 1, {"rope_scaling": scaling}, 512)
