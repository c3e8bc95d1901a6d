"""`deepinfer bench sweep` (deepinfer/bench_sweep.py) and `deepinfer bench sweep-plot` (deepinfer/sweep_plot.py):
rows whose tokens add up, tau only for fixed-length rows, and a plot that draws what the rows say."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from deepinfer import cli, sweep_plot


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "rows.jsonl"
    rc = cli.main(["bench", "sweep", "--device", "cpu", "--concurrency", "1", "2", "--steps", "3", "--warmup-steps",
                   "1", "--input-len", "16", "--motif", "4", "--settings", "none", "dspark:2", "dspark:2#b",
                   "dspark:2:dynamic", "--out", str(out), "--commit", "test"])
    assert rc == 0
    return out, [json.loads(line) for line in out.read_text().splitlines()]


def test_sweep_rows_count_the_tokens_they_emitted(swept):
    _, rows = swept
    assert {(r["setting"], r["concurrency"]) for r in rows} == \
        {(s, c) for s in ("none", "dspark:2", "dspark:2#b", "dspark:2:dynamic") for c in (1, 2)}
    for r in rows:
        assert r["bench"] == "deepinfer bench sweep" and r["commit"] == "test" and r["steps"] == 3
        # one target token per row-step plus the accepted drafts: counted from the requests, not derived
        assert r["output_tokens"] == r["steps"] * r["concurrency"] + r["accepted_tokens"], r
        if r["setting"] == "none":
            assert r["draft_tokens"] == 0 and "tau_formula" not in r
    fixed = [r for r in rows if r["setting"] in ("dspark:2", "dspark:2#b")]
    assert all(r["k"] == 2 and not r["dynamic"] for r in fixed)
    for r in fixed:  # every verified row drafted k: tau holds, and equals the measured tokens per verified row
        if r["draft_tokens"] == 2 * r["verified_rows"]:
            assert r["tau_formula"] == pytest.approx(1 + 2 * r["accepted_tokens"] / r["draft_tokens"], abs=1e-4)
            assert r["tau_formula"] == pytest.approx(r["tokens_per_verified_row"], abs=1e-4)
    assert all("tau_formula" not in r for r in rows if r["dynamic"])


def test_sweep_plot_converts_fixed_rows_and_refuses_tau_for_variable_ones(swept, tmp_path, capsys):
    path, rows = swept
    svg = tmp_path / "plot.svg"
    assert cli.main(["bench", "sweep-plot", str(path), "--svg", str(svg)]) == 0
    root = ET.fromstring(svg.read_text())
    ns = "{http://www.w3.org/2000/svg}"
    lines = {(p.get("class"), p.get("data-setting")): p.get("points") for p in root.iter(ns + "polyline")}
    assert {s for c, s in lines if c == "measured"} == {"none", "dspark:2", "dspark:2#b", "dspark:2:dynamic"}
    assert {s for c, s in lines if c == "tau"} <= {"dspark:2", "dspark:2#b"}  # never a dynamic row's
    capsys.readouterr()
    assert cli.main(["bench", "sweep-plot", str(path), "--tokens", "tau"]) == 2
    assert "variable-length drafts" in capsys.readouterr().err


def row(setting, C, step_rate, out_tok_s, **kw):
    r = {"setting": setting, "concurrency": C, "step_rate": step_rate, "output_tok_s": out_tok_s}
    if setting != "none":
        r.update(method="dspark", k=4, dynamic=setting.endswith("dynamic"))
    return {**r, **kw}


def test_tokens_per_second_by_the_formula_only_where_it_holds():
    fixed = row("dspark:4", 16, 100.0, 3000.0, tau_formula=1.9)
    assert sweep_plot.tokens_per_s(fixed, "tau") == pytest.approx(100.0 * 16 * 1.9)
    assert sweep_plot.tokens_per_s(fixed) == 3000.0
    assert sweep_plot.tokens_per_s(row("none", 8, 50.0, 400.0), "tau") == 400.0
    with pytest.raises(ValueError, match=r"dspark:4:dynamic at C=4 .*dynamic lengths"):
        sweep_plot.tokens_per_s(row("dspark:4:dynamic", 4, 10.0, 90.0), "tau")
    with pytest.raises(ValueError, match="fewer than k"):  # fixed k, but some rows had fewer drafts (n-gram misses)
        sweep_plot.tokens_per_s(row("ngram:4", 4, 10.0, 90.0), "tau")
    with pytest.raises(ValueError, match="'mean'"):
        sweep_plot.tokens_per_s(fixed, "mean")


def test_the_plot_draws_each_setting_where_its_values_are():
    rows = [row("none", 1, 100.0, 100.0), row("none", 4, 90.0, 360.0), row("none", 16, 50.0, 800.0),
            row("dspark:4", 1, 60.0, 150.0, tau_formula=2.5), row("dspark:4", 16, 20.0, 500.0, tau_formula=1.5),
            row("dspark:4:dynamic", 16, 45.0, 810.0)]
    root = ET.fromstring(sweep_plot.svg(rows))
    ns = "{http://www.w3.org/2000/svg}"
    pts = {(p.get("class"), p.get("data-setting")): [tuple(map(float, xy.split(","))) for xy in p.get("points").split()]
           for p in root.iter(ns + "polyline")}
    none = pts[("measured", "none")]
    assert [x for x, _ in none] == sorted(x for x, _ in none)  # concurrency left to right
    assert none[0][1] > none[1][1] > none[2][1]  # more tokens/s higher up (smaller y)
    xs = {c: x for c, (x, _) in zip((1, 4, 16), none)}
    assert xs[4] - xs[1] == pytest.approx(xs[16] - xs[4])  # log2 axis
    per_tok = (none[1][1] - none[2][1]) / (800 - 360)  # the y axis is linear in tokens/s
    assert pts[("measured", "dspark:4:dynamic")] == [(xs[16], pytest.approx(none[2][1] - per_tok * 10, abs=0.2))]
    assert ("tau", "dspark:4:dynamic") not in pts and len(pts[("tau", "dspark:4")]) == 2


def test_bad_input_is_an_error_that_names_it(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"setting": "none", "concurrency": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a sweep row \(no step_rate, output_tok_s\)"):
        sweep_plot.load_rows(bad)
    bad.write_text("not json\n")
    assert cli.main(["bench", "sweep-plot", str(bad)]) == 2
    assert "bad.jsonl:1: not JSON" in capsys.readouterr().err
    for argv, msg in [(["--rounds", "200", "--steps", "8"], "--rounds x --steps"),
                      (["--steps", "0"], "--steps=0 is invalid"), (["--settings", "ngram"], "METHOD:K"),
                      (["--settings", "none", "none"], "#LABEL"), (["--fresh-rounds"], "--rounds 2"),
                      (["--concurrency", "0"], "--concurrency 0")]:
        assert cli.main(["bench", "sweep", "--device", "cpu", *argv]) == 2, argv
        assert msg in capsys.readouterr().err, argv
