"""Plot of benchmarks/prefix_bench.py's TTFT rows: one group of bars per (model, prefix), one bar per tier (log
scale, the speedup over cold prefill written on it), and for CED models the issue's target line, cold / 5.

    python benchmarks/plot_prefix.py docs/results/h200_issue13_prefix_{ced16k_d223834,ced64k_6fe2c58,llama_6fe2c58}.jsonl \
        --png docs/results/h200_issue13_prefix.png

(name the runs: a later file overrides an earlier one's rows, and older runs in docs/results hold slower tiers.)

Without matplotlib it prints the table only and says that no plot was written (exit code 0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_rows import read_rows  # noqa: E402

TIERS = ["cold", "device", "host", "device+swa", "host+swa", "disk"]


def read(paths: list) -> dict:
    """{(model, prefix): {tier: row}}, later files overriding earlier ones."""
    groups: dict = {}
    for p in paths:
        for r in read_rows(p, bench="prefix_ttft"):
            groups.setdefault((r["model"], r["prefix"]), {})[r["tier"]] = r
    return groups


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    groups = read(args.jsonl)
    for (model, prefix), rows in sorted(groups.items()):
        cells = [f"{t} {rows[t]['ttft_s'] * 1e3:.1f} ms ({rows[t]['speedup']}x)" for t in TIERS if t in rows]
        print(f"{model:14} {prefix:>6}  " + ", ".join(cells))
    if not args.png:
        return 0
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return 0
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(TIERS)
    keys = sorted(groups)
    for j, tier in enumerate(TIERS):
        xs, ys, labels = [], [], []
        for i, k in enumerate(keys):
            r = groups[k].get(tier)
            if r is not None:
                xs.append(i + (j - len(TIERS) / 2 + 0.5) * width)
                ys.append(r["ttft_s"] * 1e3)
                labels.append(f"{r['speedup']:g}x")
        bars = ax.bar(xs, ys, width, label=tier)
        for b, lab in zip(bars, labels):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height() * 1.05, lab, ha="center", fontsize=6, rotation=90)
    for i, k in enumerate(keys):
        cold = groups[k].get("cold")
        if cold is not None and k[0].startswith("ced"):
            ax.hlines(cold["ttft_s"] * 1e3 / 5, i - 0.4, i + 0.4, colors="k", linestyles="dashed")
    ax.set_xticks(range(len(keys)), [f"{m}\n{p // 1024}K prefix" for m, p in keys])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, ms (log)")
    ax.set_title("Prefix-cache hits by tier vs cold prefill (dashed: cold / 5, the CED disk target)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
