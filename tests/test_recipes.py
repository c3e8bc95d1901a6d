"""Recipes as data (issue 16, items 1-2): the built-in TOML recipes load, build an LLM and generate; a user
recipe file may put a plugin's stage anywhere; every kind of bad recipe fails at load naming the file and the
key; explicit LLM arguments win over the recipe's settings."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from deepinfer import LLM, Pipeline, SamplingParams
from deepinfer.core.config import config_fields
from deepinfer.core.plugins import get_registry
from deepinfer.core.recipe import RecipeError, builtin_dir, resolve

BUILTINS = ("default", "reference", "throughput", "latency", "deterministic")
STAGES = ["tokenize", "prefix_cache", "swa_replay", "prefill", "forward", "verify", "grammar", "sampler", "detokenize"]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from deepinfer.testing.models import build_tiny_hf_model

    path = tmp_path_factory.mktemp("tiny-llama-recipes")
    build_tiny_hf_model(path, "llama")
    return path


def write(tmp_path: Path, text: str, name: str = "mine.toml") -> Path:
    f = tmp_path / name
    f.write_text(textwrap.dedent(text))
    return f


def test_builtin_recipes_live_in_the_top_level_folder():
    assert builtin_dir() == Path(__file__).resolve().parent.parent / "recipes"
    assert sorted(f.stem for f in builtin_dir().glob("*.toml")) == sorted(BUILTINS)
    assert set(get_registry().names("recipe")) >= set(BUILTINS)


def test_builtin_recipes_differ_in_what_matters():
    r = {name: resolve(name, get_registry()) for name in BUILTINS}
    for rec in r.values():
        assert rec.description and [name for name, _ in rec.stages] == STAGES
    args = {name: dict(rec.stages)["swa_replay"] for name, rec in r.items()}
    assert args["reference"] == args["deterministic"] == {"mode": "exact"}
    assert args["throughput"] == args["latency"] == {"mode": "bounded"}
    assert r["reference"].backend == "reference" and r["deterministic"].backend is None  # nvidia on CUDA
    assert r["throughput"].backend is None and r["default"].engine == {}
    assert r["reference"].model == {"pool_impl": "mask"}
    assert r["reference"].engine == {"enforce_eager": True, "overlap_scheduling": False}
    t, lat, det = r["throughput"].engine, r["latency"].engine, r["deterministic"].engine
    assert (t["max_num_seqs"], t["max_num_batched_tokens"]) == (512, 8192)
    assert t["enforce_eager"] is False and t["overlap_scheduling"] and t["enable_prefix_caching"]
    assert (lat["max_num_seqs"], lat["max_num_batched_tokens"]) == (8, 512) and lat["enable_prefix_caching"]
    # Batch-invariant kernels; prefix hits and chunked prefill give the same bits (tests/test_batch_invariant.py).
    assert det == {"batch_invariant": True, "enable_prefix_caching": True}
    assert "bitwise the same" in r["deterministic"].description


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_recipe_builds_an_llm_and_generates(tiny_llama, name):
    llm = LLM(str(tiny_llama), recipe=name, num_kv_blocks=64, max_model_len=128, device="cpu", threads=1)
    rec = resolve(name, get_registry())
    for key, value in rec.engine.items():
        assert getattr(llm.config, key) == value, key
    assert llm.backend_name == "reference" and llm.pipeline.recipe == name
    assert llm.pipeline.stage_names("admit") == STAGES[:3]
    outs = llm.generate(["hello world", "a b c"], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_reference_recipe_sets_the_slow_twin_where_the_model_has_it(tmp_path):
    from deepinfer.testing.ced import build_ced_checkpoint

    build_ced_checkpoint(tmp_path)
    kw = dict(num_kv_blocks=64, max_model_len=128, device="cpu", threads=1)
    assert LLM(str(tmp_path), recipe="reference", **kw).engine.model.pool_impl == "mask"
    assert LLM(str(tmp_path), recipe="throughput", **kw).engine.model.pool_impl == "gather"


def test_user_recipe_with_a_plugin_stage_from_a_path(tiny_llama, tmp_path):
    pytest.importorskip("deepinfer_top_a")
    f = write(tmp_path, """
        description = "top-a sampling instead of the built-in sampler"
        backend = "reference"
        stages = ["tokenize", "prefix_cache", "prefill", "forward", "verify",
                  {name = "top_a", a = 0.5}, "detokenize"]
        [engine]
        max_num_seqs = 4
        [cache]
        enable_prefix_caching = false
        [speculative]
        """)
    pipe = Pipeline.from_recipe(str(f))
    assert pipe.stage_names() == ["prefill", "forward", "verify", "top_a", "detokenize"]
    assert pipe.recipe == str(f) and "top_a [sample] (a=0.5)  from top_a" in pipe.describe()
    llm = LLM(str(tiny_llama), recipe=f, num_kv_blocks=64, max_model_len=128, threads=1)
    assert llm.config.max_num_seqs == 4 and llm.config.enable_prefix_caching is False
    outs = llm.generate(["hello world"], SamplingParams(max_tokens=3, ignore_eos=True, seed=1), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3


def test_explicit_llm_arguments_win_over_the_recipe(tiny_llama, tmp_path):
    f = write(tmp_path, """
        backend = "reference"
        stages = ["tokenize", "prefix_cache", "swa_replay", "prefill", "forward", "verify", "sampler",
                  "detokenize"]
        [engine]
        max_num_seqs = 4
        max_num_batched_tokens = 256
        dtype = "bfloat16"
        max_model_len = 96
        [cache]
        enable_prefix_caching = false
        """)
    llm = LLM(str(tiny_llama), recipe=str(f), num_kv_blocks=64, threads=1)
    assert (llm.config.max_num_seqs, llm.config.dtype, llm.config.max_model_len) == (4, "bfloat16", 96)
    llm = LLM(str(tiny_llama), recipe=str(f), num_kv_blocks=64, threads=1, max_num_seqs=2, dtype="float32",
              max_model_len=128, enable_prefix_caching=True)
    assert (llm.config.max_num_seqs, llm.config.dtype, llm.config.max_model_len) == (2, "float32", 128)
    assert llm.config.enable_prefix_caching is True and llm.config.max_num_batched_tokens == 256


GOOD = """
stages = ["tokenize", "prefix_cache", "swa_replay", "prefill", "forward", "verify", "sampler", "detokenize"]
"""


@pytest.mark.parametrize("text, message", [
    # an unknown stage: the known ones are listed
    ('stages = ["tokenize", "fastest_sampler"]', r"\[\[stages\]\] #2: unknown stage 'fastest_sampler'; "
                                                  r"registered stages: .*sampler"),
    # an unknown top-level key
    (GOOD + 'speculate = true', r"unknown key 'speculate'; a recipe has: description, backend, stages"),
    # an unknown engine key
    (GOOD + '[engine]\nmax_seqs = 8', r"\[engine\] unknown key 'max_seqs'; EngineConfig fields: .*max_num_seqs"),
    (GOOD + '[cache]\nsize_gb = 8', r"\[cache\] unknown key 'size_gb'; accepted: enable_prefix_caching, "
                                    r"host_cache_gb, cache_dir, disk_cache_gb"),
    # bad values: EngineConfig's own validation, the stage's own validators, the recipe's tables
    (GOOD + '[engine]\nmax_num_seqs = -1', r"\[engine\] max_num_seqs = -1 is invalid: must be an int >= 1"),
    (GOOD + '[engine]\ndtype = "fp7"', r"\[engine\] dtype = \"fp7\" is invalid: expected one of"),
    (GOOD + '[cache]\nhost_cache_gb = -2', r"\[cache\] host_cache_gb = -2 is invalid: must be a finite number"),
    (GOOD + '[cache]\ndisk_write_through = "yes"', r"\[cache\] disk_write_through = \"yes\" is invalid"),
    ('stages = ["tokenize", {name = "swa_replay", mode = "fast"}]',
     r"\[\[stages\]\] #2 \(swa_replay\): swa_replay mode='fast' is invalid: expected one of \('bounded', 'exact'\)"),
    ('stages = [{name = "swa_replay", window = 4}]',
     r"\[\[stages\]\] #1 \(swa_replay\): unknown argument 'window'; swa_replay takes: model, mode"),
    (GOOD + 'backend = "tpu"', r"backend = \"tpu\" is invalid: registered backends: .*reference"),
    (GOOD + '[model]\npool_impl = "sparse"', r"\[model\] pool_impl = \"sparse\" is invalid: expected one of "
                                              r"\"gather\", \"mask\""),
    (GOOD + '[speculative]\nmethod = "ngram"', r"\[speculative\] is invalid: speculative_config lacks "
                                               r"'num_speculative_tokens'"),
    (GOOD + '[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 99', r"\[speculative\] is invalid: "
                                                                          r"speculative_config num_speculative_tokens=99"),
    ('description = "no stages"', r"stages is missing or empty"),
    (GOOD + '[engine]\nenable_prefix_caching = true\n[cache]\nenable_prefix_caching = false',
     r"enable_prefix_caching is set in both \[engine\] and \[cache\]"),
    # bad TOML syntax
    ('stages = ["tokenize"', r"not valid TOML"),
])
def test_bad_recipe_fails_at_load_naming_file_and_key(tmp_path, text, message):
    f = write(tmp_path, text)
    with pytest.raises(RecipeError, match="^" + re.escape(str(f)) + ": " + message):
        Pipeline.from_recipe(str(f))


def test_missing_recipe_file_and_unknown_name(tmp_path):
    with pytest.raises(RecipeError, match=re.escape(f"{tmp_path}/nope.toml: no such recipe file")):
        LLM(recipe=str(tmp_path / "nope.toml"))
    with pytest.raises(RecipeError, match="unknown recipe 'fastest'; registered: default, deterministic, latency, "
                                          "reference, throughput; or give a path to a .toml recipe file"):
        Pipeline.from_recipe("fastest")


def test_speculative_table_sets_speculative_config(tmp_path):
    f = write(tmp_path, GOOD + '[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 3\nprompt_lookup_max = 2')
    assert Pipeline.from_recipe(str(f)).config["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    assert Pipeline.from_recipe("throughput").config["speculative_config"]["method"] == "dspark"


def test_every_engine_field_but_speculative_is_a_recipe_engine_key(tmp_path):
    f = write(tmp_path, GOOD + "[engine]\nspeculative_config = {}")
    with pytest.raises(RecipeError, match=r"unknown key 'speculative_config' \(use \[speculative\]\)"):
        Pipeline.from_recipe(f)
    assert "max_num_seqs" in config_fields()


def test_cli_pipeline_shows_what_a_recipe_chooses(capsys, tmp_path):
    from deepinfer.cli import main

    assert main(["pipeline", "--recipe", "throughput"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Pipeline throughput") and "max_num_seqs=512" in out
    assert "swa_replay [swa_replay] (mode='bounded')" in out
    assert main(["pipeline", "--recipe", "reference"]) == 0
    out = capsys.readouterr().out
    assert "backend: reference" in out and "pool_impl='mask'" in out and "(mode='exact')" in out
    f = write(tmp_path, GOOD + "[engine]\nmax_num_seqs = 0")
    assert main(["pipeline", "--recipe", str(f)]) == 2
    assert f"{f}: [engine] max_num_seqs = 0 is invalid: must be an int >= 1" in capsys.readouterr().err


def test_cli_generate_takes_a_recipe_file(capsys, tiny_llama, tmp_path):
    from deepinfer.cli import main

    f = write(tmp_path, GOOD + "backend = \"reference\"\n[engine]\nmax_num_seqs = 2\n")
    code = main(["generate", "--model", str(tiny_llama), "--recipe", str(f), "--max-tokens", "2", "--temperature",
                 "0", "--threads", "1", "--max-model-len", "64", "hello"])
    assert code == 0, capsys.readouterr().err
