"""benchmarks/topk_search_sim.py counts passes of the top-K searches' ports: its rows, within each search's bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import topk_search_sim  # noqa: E402


def test_rows_and_bounds(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert topk_search_sim.main(["--rows", "3", "--lengths", "700", "--k", "64", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["scores"] for r in rows] == list(topk_search_sim.DISTS)
    for r in rows:
        assert 1 <= r["bits_mean"] <= r["bits_max"] <= 32
        assert 2 <= r["interp_mean"] <= r["interp_max"] <= 1 + topk_search_sim.PROBES + 32


def test_a_row_of_at_most_k_needs_no_pass():
    keys = topk_search_sim.keys_of(topk_search_sim.np.arange(10.0))
    assert topk_search_sim.interp(keys, 10) == 0 and topk_search_sim.interp(keys, 9) >= 2
