"""benchmarks/spec_sweep.py on the CPU (--smoke, the tiny Llama): rows for every setting and concurrency, and
accounting that adds up: the tokens a timed window emitted are one per row-step plus the accepted drafts."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
spec_sweep = pytest.importorskip("spec_sweep")
from deepinfer import bench_sweep  # noqa: E402


def test_smoke_sweep_rows_add_up(tmp_path):
    pytest.importorskip("deepinfer_ngram", reason="the n-gram draft plugin: pip install -e plugins/deepinfer-ngram")
    out = tmp_path / "rows.jsonl"
    assert spec_sweep.main(["--smoke", "--targets", "llama-tiny", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["setting"], r["concurrency"]) for r in rows} == {(s, c) for s in ("none", "ngram:2") for c in (1, 3)}
    for r in rows:
        assert r["output_tokens"] == r["steps"] * r["concurrency"] + r["accepted_tokens"], r
        assert r["step_rate"] > 0 and r["output_tok_s"] > 0
    spec = [r for r in rows if r["setting"] != "none"]
    assert sum(r["draft_tokens"] for r in spec) > 0 and all("tau_formula" not in r or not r["dynamic"] for r in spec)


def test_interleaved_rounds_add_up_per_setting(tmp_path):
    """--rounds 2: every setting's engine alive at once, two timed blocks each; a row's totals are its blocks'."""
    pytest.importorskip("deepinfer_ngram", reason="the n-gram draft plugin: pip install -e plugins/deepinfer-ngram")
    out = tmp_path / "rows.jsonl"
    assert spec_sweep.main(["--smoke", "--targets", "llama-tiny", "--rounds", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["setting"], r["concurrency"]) for r in rows} == {(s, c) for s in ("none", "ngram:2") for c in (1, 3)}
    for r in rows:
        assert r["steps"] == 2 * 4 and len(r["block_step_rates"]) == 2 and r["rounds"] == 2
        assert r["output_tokens"] == r["steps"] * r["concurrency"] + r["accepted_tokens"], r
        assert len(r["block_output_tok_s"]) == 2 and all(x > 0 for x in r["block_output_tok_s"])
    pairs = bench_sweep.paired(rows)
    assert {(C, a, b) for _, C, a, b, _, _ in pairs} == {(c, "ngram:2", "none") for c in (1, 3)}


def test_fresh_rounds_time_new_requests_each_round(tmp_path):
    """--fresh-rounds: each round every setting serves new requests on the same new prompts; a row's totals are
    its rounds' blocks, and no request of an earlier round is left running beside a later one (C rows a step)."""
    pytest.importorskip("deepinfer_ngram", reason="the n-gram draft plugin: pip install -e plugins/deepinfer-ngram")
    out = tmp_path / "rows.jsonl"
    assert spec_sweep.main(["--smoke", "--targets", "llama-tiny", "--rounds", "3", "--fresh-rounds",
                            "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["setting"], r["concurrency"]) for r in rows} == {(s, c) for s in ("none", "ngram:2") for c in (1, 3)}
    for r in rows:
        assert r["fresh_rounds"] and r["steps"] == 3 * 4 and len(r["block_output_tok_s"]) == 3
        # one token per row-step plus the accepted drafts: C rows in every timed step
        assert r["output_tokens"] == r["steps"] * r["concurrency"] + r["accepted_tokens"], r
        assert r["verified_rows"] <= r["steps"] * r["concurrency"], r  # (engine-wide: no other round's rows)
        assert r["syncs_per_step"] is None
    assert any(r["verified_rows"] for r in rows)


def test_paired_ratio_is_the_median_of_the_rounds():
    """Drift between rounds cancels in each round's ratio: the median of those, not the ratio of the totals."""
    rows = [{"target": "t", "concurrency": 4, "setting": "none", "block_output_tok_s": [100.0, 50.0, 200.0]},
            {"target": "t", "concurrency": 4, "setting": "fast", "block_output_tok_s": [110.0, 60.0, 190.0]},
            {"target": "t", "concurrency": 8, "setting": "none", "block_output_tok_s": [10.0]}]  # one round: none
    (t, C, a, b, med, ratios), = bench_sweep.paired(rows)
    assert (t, C, a, b) == ("t", 4, "fast", "none") and ratios == [1.1, 1.2, 0.95] and med == 1.1


def test_bad_setting_names_the_problem():
    with pytest.raises(ValueError, match="METHOD:K"):
        bench_sweep.parse_setting("ngram")
    assert bench_sweep.parse_setting("dspark:4:dynamic")["dynamic"] is True
