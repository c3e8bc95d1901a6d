"""`deepinfer check yoco` (deepinfer/check_yoco.py) on tiny checkpoints: it runs, writes a JSONL row per forced
token and comparison plus a summary per comparison, mask vs gather and the full path vs the engine agree to
float rounding, and bounded replay differs from exact replay once the prompt is longer than n_win."""

from __future__ import annotations

import json

import pytest

from deepinfer.cli import main
from deepinfer.testing.ced import build_ced_checkpoint
from deepinfer.testing.models import build_tiny_hf_model

N_WIN = 4


@pytest.fixture(scope="module")
def tiny_ced(tmp_path_factory):
    path = tmp_path_factory.mktemp("ced")
    # Decoder [full, reindex]: a pool of 2 blocks x 2 positions, so a 20-token prompt's pool is a strict subset.
    build_ced_checkpoint(path, vocab_size=300, num_layers=3, num_encoder_layers=1,
                         layer_modes=("full", "full", "reindex"), hidden_size=32, head_dim=32, rope_dim=8,
                         num_heads=2, out_groups=1, out_group_dim=32, q_lora_rank=32, n_win=N_WIN, index_topk=4,
                         pool_block=2, pool_blocks=2, moe_intermediate_size=32, n_routed_experts=4,
                         index_heads=2, index_head_dim=32, encoder_ratio=2, std=0.5)
    return str(path)


def run(capsys, *argv):
    code = main(["check", "yoco", "--dtype", "float32", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def read(path):
    rows = [json.loads(l) for l in open(path)]
    return ([r for r in rows if r["kind"] == "position"], {r["comparison"]: r for r in rows if r["kind"] == "summary"})


def test_ced_long_prompt(tiny_ced, tmp_path, capsys):
    prompt = ",".join(str(5 + (7 * i) % 250) for i in range(20))
    out = tmp_path / "yoco.jsonl"
    code, text, err = run(capsys, "--model", tiny_ced, "--prompt-ids", prompt, "--max-tokens", "6", "--top-k", "5",
                          "--out", str(out))
    assert code == 0, err
    rows, summ = read(out)
    assert sorted(summ) == ["path", "pool", "replay"]
    for name in summ:
        mine = [r for r in rows if r["comparison"] == name]
        assert [r["position"] for r in mine] == list(range(20, 26)), name
        assert all(0 <= r["topk_overlap"] <= 1 for r in mine)
        assert f"summary {name}: 6 positions" in text
    assert summ["pool"]["reference"] == "full/mask/s=0" and summ["pool"]["candidate"] == "full/gather/s=0"
    assert summ["pool"]["max_abs_dlogprob"] < 1e-4 and summ["pool"]["first_argmax_divergence"] is None
    assert summ["path"]["candidate"] == "engine" and summ["path"]["max_abs_dlogprob"] < 1e-3
    assert summ["replay"]["replay_start"] == 20 - N_WIN and summ["replay"]["candidate"] == f"full/gather/s={20 - N_WIN}"
    assert summ["replay"]["max_abs_dlogprob"] > 1e-3  # the bounded approximation, visible on random weights


def test_ced_short_prompt_and_forced_ids(tiny_ced, tmp_path, capsys):
    """A prompt within n_win: bounded replay starts at 0 and equals exact replay (and says so)."""
    out = tmp_path / "yoco.jsonl"
    code, text, err = run(capsys, "--model", tiny_ced, "--prompt-ids", "5 6 7", "--continuation-ids", "8,9,10",
                          "--compare", "replay", "--out", str(out))
    assert code == 0, err
    rows, summ = read(out)
    assert list(summ) == ["replay"] and [r["token"] for r in rows] == [8, 9, 10]
    assert summ["replay"]["max_abs_dlogprob"] == 0 and "equals exact replay" in text


def test_llama_runs_path_only(tmp_path, capsys):
    build_tiny_hf_model(tmp_path / "llama", "llama", vocab_size=300)
    code, text, err = run(capsys, "--model", str(tmp_path / "llama"), "--prompt", "hello world",
                          "--continuation", " and more", "--top-k", "3")
    assert code == 0, err
    assert "summary path:" in text and "pool: skipped" in text and "replay: skipped" in text


@pytest.mark.parametrize("argv, why", [
    ([], "exactly one of --prompt"),
    (["--prompt", "a", "--prompt-ids", "1"], "exactly one of --prompt"),
    (["--prompt-ids", "1,x"], "--prompt-ids '1,x'"),
    (["--prompt", "a", "--compare", "pool,bogus"], "--compare 'bogus'"),
    (["--prompt", "a", "--top-k", "0"], "--top-k=0"),
])
def test_usage_errors(argv, why, tiny_ced, capsys):
    code, _, err = run(capsys, "--model", tiny_ced, *argv)
    assert code == 2 and why in err, err
