"""The `deepinfer` command: init-model, generate, chat, plugins, pipeline, bench (and benchmarks/hf_compare.py)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.cli import main

REPO = Path(__file__).resolve().parent.parent
# A short context keeps each LLM's KV pool small (the default sizes it for max_num_seqs full contexts).
SHORT = ("--max-model-len", 128)


def run_cli(capsys, *argv, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    assert main(["init-model", "--arch", "llama", "--size", "tiny", "--out", str(d), "--seed", "7"]) == 0
    return d


@pytest.fixture(scope="module")
def llm(ckpt):
    from deepinfer import LLM

    return LLM(model=str(ckpt), max_model_len=128)


# --- init-model ---------------------------------------------------------------------------------------------

def test_init_model_writes_a_checkpoint_that_loads_and_round_trips(ckpt, llm):
    from safetensors.torch import load_file

    files = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (4, 256)
    assert cfg["torch_dtype"] == "float32" and cfg["rope_theta"] > 0
    assert cfg["vocab_size"] == llm.tokenizer.vocab_size
    assert llm.hf_config == cfg  # what the loader read is what init-model wrote
    c = llm.engine.model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (4, 256, 4, 2)
    # The weights the engine loaded are the file's tensors, under the checkpoint's own names.
    saved = load_file(str(ckpt / "model.safetensors"))
    loaded = llm.engine.model.hf_state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    w = saved["model.layers.0.mlp.down_proj.weight"]
    assert 0.015 < w.std().item() < 0.025  # the N(0, 0.02) init
    assert torch.equal(saved["model.norm.weight"], torch.ones_like(saved["model.norm.weight"]))


def test_init_model_is_seeded(tmp_path, ckpt, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["init-model", "--arch", "llama", "--out", str(a), "--seed", "7"]) == 0
    assert main(["init-model", "--arch", "llama", "--out", str(b), "--seed", "8"]) == 0
    assert "3.67M parameters" in capsys.readouterr().out
    assert (a / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch,hf_arch", [("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                          ("qwen3", "Qwen3ForCausalLM")])
def test_init_model_other_archs_generate(tmp_path, arch, hf_arch):
    from deepinfer import LLM, SamplingParams

    assert main(["init-model", "--arch", arch, "--out", str(tmp_path), "--vocab-size", "300"]) == 0
    llm = LLM(model=str(tmp_path), max_model_len=64)
    assert llm.hf_config["architectures"] == [hf_arch] and llm.engine.model.vocab_size == 300
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_init_model_checkpoint_is_hf_format(tmp_path, arch):
    """transformers reads the same config and weights: its logits equal our full-sequence oracle's."""
    transformers = pytest.importorskip("transformers")
    from deepinfer import LLM

    main(["init-model", "--arch", arch, "--out", str(tmp_path), "--vocab-size", "300", "--seed", "1"])
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ours = LLM(model=str(tmp_path), max_model_len=64).engine.model
    ids = torch.arange(5, 25)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids[None]).logits[0], ours.forward_full(ids), atol=1e-4, rtol=1e-4)


def test_init_model_bad_values_exit_2(tmp_path, capsys):
    code, _, err = run_cli(capsys, "init-model", "--arch", "gpt2", "--out", tmp_path)
    assert code == 2 and "--arch" in err
    code, _, err = run_cli(capsys, "init-model", "--arch", "llama", "--out", tmp_path, "--vocab-size", "10")
    assert code == 2 and err.startswith("error:") and "vocab_size" in err


# --- generate ---------------------------------------------------------------------------------------------

def test_generate_json(ckpt, capsys):
    code, out, err = run_cli(capsys, "generate", "hello world", "def f(", "--model", ckpt, *SHORT,
                             "--max-tokens", 5, "--temperature", 0, "--ignore-eos", "--json", "--logprobs", 2)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["hello world", "def f("] and [r["index"] for r in rows] == [0, 1]
    for r in rows:
        assert set(r) == {"index", "prompt", "prompt_token_ids", "completions"}
        (c,) = r["completions"]
        assert c["index"] == 0 and len(c["token_ids"]) == 5 and c["finish_reason"] == "length"
        assert isinstance(c["text"], str)
        assert len(c["logprobs"]) == 5
        for tok, entry in zip(c["token_ids"], c["logprobs"]):
            assert entry["token_id"] == tok and entry["logprob"] <= 0
            assert entry["rank"] == 1  # greedy picks the top token
            assert len(entry["top"]) >= 2


def test_generate_matches_the_api_and_reads_stdin(ckpt, llm, capsys, monkeypatch):
    from deepinfer import SamplingParams

    want = llm.generate(["Once upon"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0]
    code, out, _ = run_cli(capsys, "generate", "--model", ckpt, *SHORT, "--max-tokens", 4, "--temperature", 0,
                           "--json", stdin="Once upon\n", monkeypatch=monkeypatch)
    assert code == 0
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["prompt"] == "Once upon" and row["completions"][0]["token_ids"] == want.token_ids
    code, out, _ = run_cli(capsys, "generate", "Once upon", "--model", ckpt, *SHORT, "--max-tokens", 4,
                           "--temperature", 0)
    assert code == 0 and out == want.text + "\n"


def test_generate_n_completions(ckpt, capsys):
    code, out, _ = run_cli(capsys, "generate", "abc", "--model", ckpt, *SHORT, "--max-tokens", 3, "--n", 3,
                           "--seed", 1, "--ignore-eos", "--json")
    assert code == 0
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert set(row) == {"index", "prompt", "prompt_token_ids", "completions"}  # no completion's fields on top
    assert [c["index"] for c in row["completions"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 3 for c in row["completions"])


def test_a_failed_prompt_fails_alone_with_exit_1(ckpt, capsys):
    code, out, err = run_cli(capsys, "generate", "hi", "a much longer prompt than the context allows " * 3,
                             "--model", ckpt, "--max-model-len", 16, "--max-tokens", 2, "--json")
    assert code == 1 and "error: prompt 1:" in err and "max_model_len" in err
    ok, bad = [json.loads(line) for line in out.splitlines()]
    assert len(ok["completions"][0]["token_ids"]) >= 1 and "error" not in ok
    assert bad["completions"][0]["finish_reason"] == "error" and "max_model_len" in bad["error"]


def test_a_failed_prompt_is_reported_once_in_a_real_process(ckpt):
    p = subprocess.run([sys.executable, "-m", "deepinfer.cli", "generate", "hi", "x " * 40, "--model", str(ckpt),
                        "--max-model-len", "16", "--max-tokens", "2", "--threads", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout.startswith("--- prompt 0 ---\n")
    assert p.stderr.count("max_model_len") == 1 and p.stderr.startswith("error: prompt 1:"), p.stderr


def test_stop_takes_one_value_per_flag(ckpt, capsys):
    from deepinfer.cli import build_parser

    args = build_parser().parse_args(["generate", "--stop", "a", "--stop", "b c", "prompt"])
    assert args.stop == ["a", "b c"] and args.prompts == ["prompt"]
    code, out, err = run_cli(capsys, "generate", "--stop", "sys", "import os", "--model", ckpt, *SHORT,
                             "--max-tokens", 2, "--json")
    assert code == 0, err
    assert json.loads(out)["prompt"] == "import os"


def test_logprobs_without_json_is_a_usage_error(capsys):
    code, out, err = run_cli(capsys, "generate", "x", "--logprobs", 2)
    assert code == 2 and out == "" and err.startswith("error:") and "--json" in err


def _option_help(command: str, flag: str) -> str:
    from deepinfer.cli import build_parser

    sub = next(a for a in build_parser()._subparsers._group_actions if command in a.choices).choices[command]
    return next(a.help for a in sub._actions if flag in a.option_strings)


@pytest.mark.parametrize("command,stdin", [("generate", None), ("chat", "hi\n")])
def test_help_states_the_sampling_defaults_used(ckpt, tmp_path, capsys, monkeypatch, command, stdin):
    """--max-tokens' stated default is the one used; the temperature comes from generation_config.json."""
    import re
    import shutil

    from deepinfer.core.llm import LLM

    model = tmp_path / "m"
    shutil.copytree(ckpt, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.25}))
    used = []
    for name in ("generate", "stream"):
        real = getattr(LLM, name)
        monkeypatch.setattr(LLM, name, lambda self, prompts, params=None, *a, _real=real, **k:
                            used.append(params) or _real(self, prompts, params, *a, **k))
    argv = [command, "--model", model, *SHORT, "--ignore-eos"] + (["hello"] if stdin is None else [])
    code, _, err = run_cli(capsys, *argv, stdin=stdin, monkeypatch=monkeypatch)
    assert code == 0, err
    stated = int(re.search(r"default (\d+)", _option_help(command, "--max-tokens")).group(1))
    assert used[0].max_tokens == stated and used[0].temperature == 0.25
    assert "generation_config.json" in _option_help(command, "--temperature")


def test_threads_sets_torch_threads_and_is_validated(ckpt, capsys):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so that 1 is a change
    try:
        code, _, err = run_cli(capsys, "generate", "hi", "--model", ckpt, *SHORT, "--max-tokens", 1,
                               "--threads", 1)
        assert code == 0, err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    for command in ("generate", "chat", "bench"):
        code, _, err = run_cli(capsys, command, "--model", ckpt, "--threads", 0)
        assert code == 2 and "--threads=0" in err, command


def test_threads_from_the_environment(ckpt, capsys, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("DEEPINFER_NUM_THREADS", "two")
    code, _, err = run_cli(capsys, "generate", "hi", "--model", ckpt, *SHORT)
    assert code == 2 and "DEEPINFER_NUM_THREADS='two' is invalid" in err
    monkeypatch.setenv("DEEPINFER_NUM_THREADS", "1")
    torch.set_num_threads(2)  # so that 1 is a change
    try:
        code, _, err = run_cli(capsys, "generate", "hi", "--model", ckpt, *SHORT, "--max-tokens", 1)
        assert code == 0 and torch.get_num_threads() == 1, err
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("flag,value,field", [("--temperature", "-1", "temperature"), ("--top-p", "2", "top_p"),
                                              ("--top-k", "-5", "top_k"), ("--max-tokens", "0", "max_tokens"),
                                              ("--dtype", "float8", "dtype")])
def test_bad_value_exits_2_naming_the_field(ckpt, capsys, flag, value, field):
    code, out, err = run_cli(capsys, "generate", "x", "--model", ckpt, *SHORT, flag, value)
    assert code == 2 and out == ""
    assert err.startswith("error:") and field in err and "Traceback" not in err


def test_bad_value_in_a_real_process():
    p = subprocess.run([sys.executable, "-m", "deepinfer.cli", "generate", "x", "--min-p", "3"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "error: SamplingParams.min_p=3.0 is invalid" in p.stderr and "Traceback" not in p.stderr


def test_missing_model_exits_2(capsys, monkeypatch, tmp_path):
    from deepinfer.models import loader

    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    monkeypatch.setattr(loader, "DEMO_DIR", tmp_path / "no-demo")
    code, _, err = run_cli(capsys, "generate", "hi")
    assert code == 2 and "no bundled demo model" in err and "init-model" in err


# --- chat ---------------------------------------------------------------------------------------------------

def test_chat_keeps_history_and_stops_at_exit(ckpt, capsys, monkeypatch):
    from deepinfer.core.llm import LLM

    prompt_lens = []
    stream = LLM.stream

    def spy(self, prompt, params=None):
        prompt_lens.append(len(prompt["prompt_token_ids"]))
        return stream(self, prompt, params)

    monkeypatch.setattr(LLM, "stream", spy)
    code, out, _ = run_cli(capsys, "chat", "--model", ckpt, *SHORT, "--max-tokens", 3, "--temperature", 0,
                           "--system", "be brief", stdin="hi\nand again\n/exit\nnot read\n", monkeypatch=monkeypatch)
    assert code == 0
    assert len(prompt_lens) == 2  # two turns; the line after /exit is never sent
    assert prompt_lens[1] > prompt_lens[0] + 3  # turn 2 carries turn 1 and its reply
    # Not a terminal: each reply comes after a "--- reply N ---" line.
    parts = re.split(r"^--- reply (\d+) ---\n", out, flags=re.M)
    assert parts[0] == "" and parts[1::2] == ["1", "2"] and all(p.endswith("\n") for p in parts[2::2])
    code, out, _ = run_cli(capsys, "chat", "--model", ckpt, *SHORT, "--max-tokens", 2,
                           stdin="one turn then EOF\n", monkeypatch=monkeypatch)
    assert code == 0 and out.startswith("--- reply 1 ---\n") and out.count("--- reply") == 1


# --- plugins / pipeline -------------------------------------------------------------------------------------

def test_plugins_lists_builtin_with_what_it_registers(capsys):
    from deepinfer.core.plugins import get_registry

    code, out, _ = run_cli(capsys, "plugins")
    assert code == 0
    block = out.split("deepinfer.builtin", 1)[1].split("\n\n")[0]
    assert "builtin.py" in block.splitlines()[0]  # origin: the module file
    for e in get_registry().by_plugin()["deepinfer.builtin"]:
        assert (f"{e.kind}/{e.name}" if e.category == "stage" else e.name) in out
    assert "sample/sampler" in out and "LlamaForCausalLM" in out and "reference" in out
    code, out, _ = run_cli(capsys, "plugins", "--json")
    builtin = next(p for p in json.loads(out) if p["name"] == "deepinfer.builtin")
    assert "verify/verify" in builtin["stages"] and "throughput" in builtin["recipes"]


def test_pipeline_describe_and_dot(capsys):
    from deepinfer import Pipeline

    code, out, _ = run_cli(capsys, "pipeline", "reference")
    assert code == 0 and out.startswith("Pipeline reference")
    for name in Pipeline.from_recipe("reference").stage_names("step"):
        assert f"{name} [" in out
    code, out, _ = run_cli(capsys, "pipeline", "--dot")
    assert code == 0 and out.startswith("digraph") and out.rstrip().endswith("}") and '"sampler"' in out
    code, _, err = run_cli(capsys, "pipeline", "no-such-recipe")
    assert code == 2 and "no-such-recipe" in err and "reference" in err


def test_help_lists_subcommands():
    p = subprocess.run([sys.executable, "-m", "deepinfer.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    for cmd in ("generate", "chat", "plugins", "pipeline", "init-model", "bench"):
        assert cmd in p.stdout


# --- bench --------------------------------------------------------------------------------------------------

BENCH_KEYS = {"model", "arch", "backend", "device", "dtype", "recipe", "num_prompts", "input_len", "output_len",
              "max_num_seqs", "max_num_batched_tokens", "seed", "torch_version", "torch_threads", "git_commit",
              "wall_s", "steps", "output_tokens", "output_tok_s", "total_tok_s", "ttft_mean_s", "ttft_p50_s",
              "model_ms_per_step", "overhead_ms_per_step", "timestamp"}


def test_bench_writes_a_reproducible_row(ckpt, tmp_path, capsys):
    out_file = tmp_path / "r.jsonl"
    before = torch.get_num_threads()
    try:
        code, out, err = run_cli(capsys, "bench", "--model", ckpt, "--num-prompts", 3, "--input-len", 8,
                                 "--output-len", 4, "--max-num-seqs", 2, "--warmups", 0, "--out", out_file,
                                 "--threads", 1)
    finally:
        torch.set_num_threads(before)
    assert code == 0, err
    assert "out tok/s" in out and "deepinfer" in out
    (row,) = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert BENCH_KEYS <= row.keys()
    assert row["model"] == str(ckpt.resolve()) and row["arch"] == "LlamaForCausalLM"
    assert (row["num_prompts"], row["input_len"], row["output_len"], row["max_num_seqs"]) == (3, 8, 4, 2)
    assert row["input_tokens"] == 24 and row["output_tokens"] == 12  # EOS ignored: exactly output_len each
    assert row["steps"] >= 4 + 1  # max_num_seqs=2: the third prompt waits for a free slot
    assert row["ttft_max_s"] > row["ttft_p50_s"] > 0
    assert row["model_ms_per_step"] > 0 and row["torch_threads"] == 1
    assert abs(row["output_tok_s"] * row["wall_s"] - 12) < 1e-6


def test_bench_prompts_file(ckpt, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt\n\nsecond one here\n")
    out_file = tmp_path / "r.jsonl"
    code, _, err = run_cli(capsys, "bench", "--model", ckpt, "--prompts-file", f, "--num-prompts", 3,
                           "--output-len", 2, "--warmups", 0, "--out", out_file)
    assert code == 0, err
    row = json.loads(out_file.read_text())
    assert row["num_prompts"] == 3 and row["output_tokens"] == 6 and row["prompts_file"] == str(f.resolve())


def test_bench_writes_no_file_without_out(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "bench", "--model", ckpt, "--num-prompts", 1, "--input-len", 4,
                             "--output-len", 1, "--warmups", 0)
    assert code == 0, err
    assert "out tok/s" in out and "wrote" not in out and list(tmp_path.iterdir()) == []


def test_bench_rejects_bad_sizes(capsys):
    code, _, err = run_cli(capsys, "bench", "--num-prompts", 0)
    assert code == 2 and "--num-prompts" in err


def test_model_timer_restores_the_model(llm):
    from deepinfer.bench import ModelTimer

    model = llm.engine.model
    with ModelTimer(model) as t:
        model.compute_logits(torch.zeros(1, 256))
    assert t.calls == 1 and t.seconds > 0
    assert "forward" not in model.__dict__ and "compute_logits" not in model.__dict__


def test_hf_compare_runs(ckpt, tmp_path, capsys):
    pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_compare", REPO / "benchmarks" / "hf_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out_file = tmp_path / "cmp.jsonl"
    assert mod.main(["--model", str(ckpt), "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                     "--repeats", "1", "--out", str(out_file)]) == 0
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["hf", "deepinfer"]
    for r in rows:
        assert r["output_tokens"] == 12 and r["deepinfer_over_hf_output_tok_s"] > 0
    assert rows[0]["exact_match_pct"] >= 2 / 3 * 100  # greedy on the same weights: (nearly) the same tokens
    assert "DeepInfer / HF output tokens/s" in capsys.readouterr().out
