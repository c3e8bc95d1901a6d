"""`deepinfer bench sweep-plot`: output tokens/s against concurrency from `deepinfer bench sweep` rows, as an SVG
(no plotting library) and a table.

A row's step rate becomes tokens two ways. Measured: the tokens the timed steps emitted (``output_tok_s``), for
every row. By the formula: step rate x C x tau, tau = 1 + k x acceptance, which holds only for fixed-length drafts
(every verified row drafted exactly k; the sweep records ``tau_formula`` only then). A dynamic row's drafts vary
per request and step, so 1 + k x acceptance is not its tokens per row-step, and its accepted tokens are measured
anyway: the formula is refused for it (``tokens_per_s(row, "tau")`` raises, naming the row), and the plot draws
it from its measured tokens only. A plain row (no drafts) is step rate x C either way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from xml.sax.saxutils import escape

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def load_rows(path) -> list:
    """Sweep rows of a JSONL file; a line that is not a sweep row is an error naming its line."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        missing = [k for k in ("setting", "concurrency", "step_rate", "output_tok_s") if k not in row]
        if missing:
            raise ValueError(f"{path}:{n}: not a sweep row (no {', '.join(missing)})")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no sweep rows")
    return rows


def variable_length(row: dict) -> bool:
    """Whether the row's drafts varied in length (dynamic, or rows that drafted fewer than k): no tau for it."""
    return bool(row.get("method")) and "tau_formula" not in row


def tokens_per_s(row: dict, how: str = "measured") -> float:
    """Output tokens/s of a row: ``measured`` (what its steps emitted) or ``tau`` (step rate x C x (1 + k x
    acceptance)), which a variable-length row refuses."""
    if how == "measured":
        return float(row["output_tok_s"])
    if how != "tau":
        raise ValueError(f"tokens {how!r}: use 'measured' or 'tau'")
    rate = float(row["step_rate"]) * int(row["concurrency"])
    if not row.get("method"):
        return rate
    if variable_length(row):
        why = "dynamic lengths" if row.get("dynamic") else "some rows drafted fewer than k"
        raise ValueError(f"row {row['setting']} at C={row['concurrency']} has variable-length drafts ({why}): "
                         "tau = 1 + k x acceptance holds only for fixed-length drafts; its accepted tokens are "
                         "measured (output_tok_s)")
    return rate * float(row["tau_formula"])


def series(rows: list) -> dict:
    """{setting: [(C, measured tok/s, tau tok/s or None)]} in concurrency order (the last row of a repeat)."""
    out: dict = {}
    for r in rows:
        tau = None if variable_length(r) else tokens_per_s(r, "tau")
        out.setdefault(r["setting"], {})[int(r["concurrency"])] = (tokens_per_s(r), tau)
    return {s: [(c, *v[c]) for c in sorted(v)] for s, v in out.items()}


def table(rows: list) -> str:
    lines = [f"{'setting':>20} {'C':>5} {'steps/s':>9} {'measured tok/s':>15} {'tau tok/s':>10}  note"]
    for setting, pts in series(rows).items():
        for c, measured, tau in pts:
            note = "" if tau is not None or setting == "none" else "variable length: measured only"
            lines.append(f"{setting:>20} {c:5d} {_rate(rows, setting, c):9.1f} {measured:15.1f} "
                         f"{'-' if tau is None else f'{tau:.1f}':>10}  {note}")
    return "\n".join(lines)


def _rate(rows: list, setting: str, c: int) -> float:
    return next(float(r["step_rate"]) for r in reversed(rows) if r["setting"] == setting and r["concurrency"] == c)


def svg(rows: list, title: str = "speculative decoding sweep") -> str:
    """Output tokens/s (measured: solid, with points; by tau for fixed-length rows: dashed) against concurrency
    (log2 axis)."""
    data = series(rows)
    cs = sorted({c for pts in data.values() for c, _, _ in pts})
    top = max(max(m, t or 0.0) for pts in data.values() for _, m, t in pts)
    W, H, L, R, T, B = 760, 440, 70, 190, 40, 50
    lo, hi = math.log2(cs[0]), math.log2(cs[-1])
    ymax = _nice(top)

    def x(c):
        return L + (W - L - R) * (0.5 if hi == lo else (math.log2(c) - lo) / (hi - lo))

    def y(v):
        return H - B - (H - T - B) * v / ymax

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">concurrency</text>',
           f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 16 {(T + H - B) / 2})">'
           'output tokens/s</text>']
    for c in cs:
        out.append(f'<text x="{x(c):.1f}" y="{H - B + 16}" text-anchor="middle">{c}</text>')
    for i in range(6):
        v = ymax * i / 5
        out.append(f'<line x1="{L - 4}" y1="{y(v):.1f}" x2="{W - R}" y2="{y(v):.1f}" stroke="#ddd"/>'
                   f'<text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    for n, (setting, pts) in enumerate(data.items()):
        color = COLORS[n % len(COLORS)]
        line = " ".join(f"{x(c):.1f},{y(m):.1f}" for c, m, _ in pts)
        out.append(f'<polyline class="measured" data-setting="{escape(setting)}" points="{line}" fill="none" '
                   f'stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{x(c):.1f}" cy="{y(m):.1f}" r="3" fill="{color}"/>' for c, m, _ in pts]
        taus = [(c, t) for c, _, t in pts if t is not None]
        if taus and any(r.get("method") for r in rows if r["setting"] == setting):
            line = " ".join(f"{x(c):.1f},{y(t):.1f}" for c, t in taus)
            out.append(f'<polyline class="tau" data-setting="{escape(setting)}" points="{line}" fill="none" '
                       f'stroke="{color}" stroke-width="1.5" stroke-dasharray="5,4"/>')
        ly = T + 18 * n
        label = setting + ("" if taus or setting == "none" else " (measured only)")
        out.append(f'<line x1="{W - R + 12}" y1="{ly}" x2="{W - R + 34}" y2="{ly}" stroke="{color}" '
                   f'stroke-width="2"/><text x="{W - R + 40}" y="{ly + 4}">{escape(label)}</text>')
    out.append(f'<text x="{W - R + 12}" y="{T + 18 * len(data) + 10}" font-size="10">dashed: step rate x C x tau '
               '(fixed length)</text></svg>')
    return "\n".join(out) + "\n"


def _nice(v: float) -> float:
    """The smallest 1, 2 or 5 x 10^n at or above v (an axis top)."""
    if v <= 0:
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    return next(m * e for m in (1, 2, 5, 10) if m * e >= v)


def add_arguments(p) -> None:
    p.add_argument("rows", help="JSONL rows of `deepinfer bench sweep` (or benchmarks/spec_sweep.py)")
    p.add_argument("--svg", default=None, metavar="FILE", help="write the plot here (default: the table only)")
    p.add_argument("--tokens", choices=["measured", "tau"], default=None,
                   help="print every row's tokens/s this way only; tau is refused for variable-length rows")
    p.add_argument("--title", default=None)


def main(args) -> int:
    rows = load_rows(args.rows)
    if args.tokens is not None:  # one way for every row (tau: an error on the first variable-length row)
        for r in rows:
            print(f"{r['setting']:>20} C={r['concurrency']:<5d} {tokens_per_s(r, args.tokens):.1f} tok/s")
    else:
        print(table(rows))
    if args.svg:
        Path(args.svg).write_text(svg(rows, args.title or Path(args.rows).stem))
        print(f"wrote {args.svg}")
    return 0
