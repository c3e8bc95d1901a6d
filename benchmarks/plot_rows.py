"""Table and plot from benchmarks/gpu_bench.py rows (JSONL).

    python benchmarks/plot_rows.py gpu_bench.jsonl                          # Markdown table of the latest run
    python benchmarks/plot_rows.py gpu_bench.jsonl --png docs/results/gpu_bench.png [--run-id ID | --all-runs]

The plot has four panels: decode tokens/s against batch (DeepInfer, HF, the MoE and CED, each with its
roofline dashed), per-user tokens/s against batch, prefill tokens/s against batch tokens (with the FLOP
roofline), and CED prefill seconds in bounded vs exact mode against prompt length. Without matplotlib the
table is still printed and the command says that no plot was written (exit code 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def read_rows(path, bench: str = "benchmarks/gpu_bench.py") -> list:
    """The rows of one benchmark (their "bench" field) in a JSONL file."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:  # a run killed mid-write leaves at most one partial last line
            print(f"{path}:{n}: skipped a line that is not JSON ({exc})", file=sys.stderr)
            continue
        if row.get("bench") == bench:
            rows.append(row)
    return rows


def select_run(rows: list, run_id=None, all_runs: bool = False) -> list:
    if all_runs or not rows:
        return rows
    if run_id is None:
        run_id = rows[-1].get("run_id")
    return [r for r in rows if r.get("run_id") == run_id]


def _series_label(r: dict) -> str:
    eng = r.get("engine", "?")
    model = r.get("model", "?")
    return f"{'HF transformers' if eng == 'hf' else 'DeepInfer'} {model}"


def decode_series(rows: list) -> dict:
    """label -> sorted [(batch, decode tok/s, per-user tok/s, roofline tok/s, roofline per-user)]"""
    out = defaultdict(list)
    for r in rows:
        if r.get("measurement") == "decode" and r.get("decode_tok_s"):
            out[_series_label(r)].append((r["batch"], r["decode_tok_s"], r.get("per_user_tok_s"),
                                          r.get("roofline_tok_s"), r.get("roofline_per_user_tok_s")))
    return {k: sorted(v) for k, v in out.items()}


def prefill_series(rows: list) -> dict:
    out = defaultdict(list)
    for r in rows:
        if r.get("measurement") == "prefill" and r.get("prefill_tok_s"):
            out[_series_label(r)].append((r["batch_tokens"], r["prefill_tok_s"], r.get("roofline_tok_s")))
    return {k: sorted(v) for k, v in out.items()}


def ced_series(rows: list) -> dict:
    out = defaultdict(list)
    for r in rows:
        if r.get("measurement") == "ced_prefill" and r.get("prefill_s"):
            out[r.get("replay_mode", "?")].append((r["prompt_len"], r["prefill_s"]))
    return {k: sorted(v) for k, v in out.items()}


def plot(rows: list, png: str) -> bool:
    """Write the PNG; False (and a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (the table above has the numbers)")
        return False
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    (ax_dec, ax_user), (ax_pre, ax_ced) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, pts) in enumerate(decode_series(rows).items()):
        c = colors[i % len(colors)]
        b = [p[0] for p in pts]
        ax_dec.plot(b, [p[1] for p in pts], "o-", color=c, label=label)
        ax_user.plot(b, [p[2] for p in pts], "o-", color=c, label=label)
        if label.startswith("DeepInfer") and all(p[3] for p in pts):  # HF's roofline is the same shape's
            ax_dec.plot(b, [p[3] for p in pts], "x--", color=c, alpha=0.6, label=f"roofline {label[10:]}")
            ax_user.plot(b, [p[4] for p in pts], "x--", color=c, alpha=0.6, label=f"roofline {label[10:]}")
    for ax, title in ((ax_dec, "decode tokens/s (steady) vs batch"), (ax_user, "per-user tokens/s vs batch")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for i, (label, pts) in enumerate(prefill_series(rows).items()):
        c = colors[i % len(colors)]
        n = [p[0] for p in pts]
        ax_pre.plot(n, [p[1] for p in pts], "o-", color=c, label=label)
        if all(p[2] for p in pts):
            ax_pre.plot(n, [p[2] for p in pts], "x--", color=c, alpha=0.6, label=f"FLOP roofline {label[10:]}")
    ax_pre.set_xscale("log", base=2)
    ax_pre.set_yscale("log")
    ax_pre.set_xlabel("batch tokens per prefill step")
    ax_pre.set_title("prefill tokens/s")
    ax_pre.grid(True, which="both", alpha=0.3)
    ax_pre.legend(fontsize=7)
    for i, (mode, pts) in enumerate(sorted(ced_series(rows).items())):
        ax_ced.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[i % len(colors)], label=mode)
    ratios = [r for r in rows if r.get("measurement") == "ced_prefill_ratio"]
    for r in ratios:
        ax_ced.annotate(f"{r['exact_over_bounded']:.2f}x", (r["prompt_len"], r["exact_s"]), fontsize=8,
                        textcoords="offset points", xytext=(4, 4))
    ax_ced.set_xscale("log", base=2)
    ax_ced.set_yscale("log")
    ax_ced.set_xlabel("prompt tokens")
    ax_ced.set_ylabel("seconds")
    ax_ced.set_title("CED prefill: bounded vs exact replay")
    ax_ced.grid(True, which="both", alpha=0.3)
    ax_ced.legend(fontsize=7)
    for ax in (ax_dec, ax_user, ax_pre, ax_ced):  # a run of some phases only: say so, not an empty grid
        if not ax.lines:
            title = ax.get_title()
            ax.clear()
            ax.axis("off")
            ax.set_title(title)
            ax.text(0.5, 0.5, "no rows in this run", ha="center", va="center", transform=ax.transAxes)
    r0 = rows[0] if rows else {}
    fig.suptitle(f"{r0.get('device_name') or r0.get('cpu') or ''}  torch {r0.get('torch_version', '?')}  "
                 f"commit {str(r0.get('git_commit') or '?')[:12]}  run {r0.get('run_id', '?')}", fontsize=9)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"wrote {png}")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsonl", help="rows written by benchmarks/gpu_bench.py")
    ap.add_argument("--png", default=None, help="write the plot here (default: beside the JSONL, .png)")
    ap.add_argument("--no-plot", action="store_true", help="print the table only")
    ap.add_argument("--run-id", default=None, help="the run to show (default: the file's last)")
    ap.add_argument("--all-runs", action="store_true", help="every run in the file")
    args = ap.parse_args(argv)
    rows = select_run(read_rows(args.jsonl), args.run_id, args.all_runs)
    if not rows:
        print(f"{args.jsonl}: no gpu_bench rows")
        return 1
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_bench import summary_table

    print(summary_table(rows))
    if not args.no_plot:
        plot(rows, args.png or str(Path(args.jsonl).with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
