"""TileLang against Triton for the two kernel families that have both: CED sparse attention and MLA decode.

    python benchmarks/tilelang_vs_triton.py --out $OUT/tilelang_vs_triton.jsonl
    python benchmarks/tilelang_vs_triton.py --smoke --out /tmp/tl_smoke.jsonl   # small shapes, checks the script

Cases (bf16), every one checked against the reference op before it is timed (a case over its bound is reported
as not ok and cannot win):
  ced_sparse_attention  the CED bench config (16 heads x 512 latent, window 128, ring 140, top-K 512 FP4 entries
                        of fp4_e2m1_e4m3, sinks): decode at batch 1/16/64 with 4K/16K of context (each query at
                        the context's last position; its K entries drawn from a cache of up to 1M rows), and one
                        2048-token prefill chunk at 16K (reported, not part of the choice: decode is what the
                        choice serves most often; a prefill loss is printed).
  mla_decode            DeepSeek-V3 (128 heads, r = 512, rope = 64, block size 16): batch 1/16/64 at 4K/16K.
Implementations: "triton", "tilelang" (its launch config) and "tilelang-bn<N>" variants (other key tiles,
``--tilelang-block-n``), so one run also says which TileLang tile wins.

Timing as benchmarks/kernels_gpu.py times (its time_calls): several input sets (rotating, so repeated calls
are not served from the L2 cache), warm-up (compilation included) on a side stream, then one CUDA graph of
calls replayed ``--reps`` times between CUDA events, median per call ("us"); and the same calls launched
eagerly ("eager_us": the host's launch cost included, as a prefill step pays it). Rows go to ``--out`` as
JSON lines (one per case and implementation, then one "choice" row per op: the faster implementation by the
geometric mean of the decode speedups); a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import errors, n_sets, time_calls  # noqa: E402  (the shared timing and error helpers)

REL_BOUND = 1e-2  # bf16 against the float32 reference op


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tilelang_vs_triton.jsonl"),
                    help="JSONL file for the result rows (default $OUT/tilelang_vs_triton.jsonl)")
    ap.add_argument("--ops", nargs="+", default=["ced_sparse_attention", "mla_decode"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--reps", type=int, default=20, help="timed graph replays per implementation (median)")
    ap.add_argument("--rotate-mb", type=float, default=256.0, help="input sets per case until this much is touched")
    ap.add_argument("--tilelang-block-n", type=int, nargs="*", default=[32, 64],
                    help="extra TileLang key tiles to time besides the launch config's")
    ap.add_argument("--no-prefill", action="store_true", help="skip the CED prefill chunk")
    ap.add_argument("--smoke", action="store_true", help="small shapes, few reps: checks the script itself")
    return ap.parse_args(argv)


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------- cases
# A case: input sets (each the positional arguments of its implementations), the implementations (name ->
# callable on one set), the reference on a set, and ``pick``, the part of an output the reference gives.
def ced_case(batch: int, context: int, chunk: int, rotate_mb: float, block_ns) -> dict:
    """CED bench config: ``batch`` decode queries (chunk 1), or one prefill chunk of ``chunk`` queries."""
    from deepinfer.backends.nvidia import tilelang_ced_attention as lca, triton_ced_attention as tca
    from deepinfer.backends.reference.ops import ReferenceOps
    from deepinfer.models.ced.config import SIZES, CEDConfig
    from deepinfer.testing.attention_cases import ced_attention_case

    c = CEDConfig(**SIZES["bench"])
    ring, D, K = c.n_win + c.swa_allowance, c.head_dim, c.index_topk
    per_query = ring * (D + D // 32) + K * (D // 2 + D // 16) + 2 * D * 2  # ring + selected entries + q, out
    n = batch * chunk
    sets = min(8, n_sets(per_query * n, rotate_mb))
    if chunk == 1:  # decode: each query at its context's last position, its own ring
        rows = [(context - 1, 1, 0)] * (batch * sets)
    else:  # a prefill chunk ending at the context, the replay cut a window before it
        rows = [(context - chunk, chunk, context - chunk - c.n_win)] * sets
    n_entries = min(max(4096, len(rows) * context if chunk == 1 else context), 1 << 20)
    (q, kv, ring_t, entries, sel), kw = ced_attention_case(
        rows, window=c.n_win, ring_size=ring, heads=c.num_heads, dim=D, topk=K, fmt="fp4_e2m1_e4m3",
        dtype=torch.bfloat16, sinks=c.use_sink, device="cuda", n_entries=n_entries, full_selection=True,
        poison=False)
    where = ("pos", "cut", "fresh_lo", "fresh_start", "ring_slot")
    inputs = []
    for i in range(sets):
        rs = slice(i * n, (i + 1) * n)
        k = dict(kw, **{w: kw[w][rs] for w in where})
        k["fresh_start"] = k["fresh_start"] - i * n  # rows of this set's own kv
        inputs.append(((q[rs], kv[rs], ring_t, entries, sel[rs]), k))
    impls = {"triton": lambda a, k: tca.sparse_attention(*a, **k),
             "tilelang": lambda a, k: lca.sparse_attention(*a, **k)}
    for bn in set(block_ns) - {lca.launch_config(c.num_heads, D)["BLOCK_N"]}:  # other key tiles
        impls[f"tilelang-bn{bn}"] = lambda a, k, _bn=bn: lca.sparse_attention(*a, block_n=_bn, **k)
    ref = ReferenceOps("cuda")
    return dict(op="ced_sparse_attention", case="decode" if chunk == 1 else "prefill", batch=batch, context=context,
                shape=f"B{batch} ctx{context}" if chunk == 1 else f"chunk{chunk} @{context}",
                bytes=per_query * n, sets=inputs, impls=impls,
                reference=lambda a, k: ref.ced_sparse_attention(*a, **k), pick=lambda out: out)


def mla_case(batch: int, context: int, rotate_mb: float, block_ns) -> dict:
    """DeepSeek-V3 MLA decode: ``batch`` rows at ``context``, input sets over one shuffled paged cache."""
    from deepinfer.backends.base import AttnMetadata
    from deepinfer.backends.nvidia import tilelang_mla, triton_mla
    from deepinfer.backends.reference.ops import ReferenceOps
    from deepinfer.testing.attention_cases import mla_decode_case

    H, r, rope, bs = 128, 512, 64, 16
    scale = 192 ** -0.5  # DeepSeek-V3's q/k head dim (nope 128 + rope 64)
    per_row = context * (r + rope) * 2 + H * (r + rope) * 2 + H * r * 2
    sets = n_sets(per_row * batch, rotate_mb, most=8)
    q, cache, _, meta = mla_decode_case([context] * (batch * sets), block_size=bs, heads=H, rank=r, rope=rope,
                                        dtype=torch.bfloat16, device="cuda", poison=False)

    def rows_of(rs, q_index):
        return AttnMetadata(positions=meta.positions[rs], slot_mapping=meta.slot_mapping[rs],
                            seq_lens=meta.seq_lens[rs], q_index=q_index, q_valid=meta.q_valid[rs],
                            kv_slots=meta.kv_slots[rs], q_pos=meta.q_pos[rs], block_table=meta.block_table[rs],
                            block_size=bs)

    inputs = [(q[i * batch:(i + 1) * batch], rows_of(slice(i * batch, (i + 1) * batch), meta.q_index[:batch]))
              for i in range(sets)]

    def call(mod, **extra):
        return lambda qs, m: mod.mla_decode(qs, cache, m.block_table, bs, m.seq_lens, scale, r, **extra)

    impls = {"triton": call(triton_mla), "tilelang": call(tilelang_mla)}
    for bn in set(block_ns) - {tilelang_mla.launch_config(H, r, rope)["BLOCK_N"]}:  # other key tiles
        impls[f"tilelang-bn{bn}"] = call(tilelang_mla, block_n=bn)
    picked = sorted({0, batch - 1})
    ref = ReferenceOps("cuda")

    def reference(qs, m):  # row by row: the reference materialises [B, H, r + rope, max_kv] float32
        outs = [ref.paged_attention(qs[b:b + 1], cache, cache[..., :r],
                                    rows_of(slice(b, b + 1), torch.zeros_like(m.q_index[:1])), scale)[0]
                for b in picked]
        return torch.stack(outs)

    return dict(op="mla_decode", case="decode", batch=batch, context=context, shape=f"B{batch} ctx{context}",
                bytes=per_row * batch, sets=inputs, impls=impls, reference=reference, pick=lambda out: out[picked])


# ------------------------------------------------------------------------------------------- running
def run_case(case: dict, reps: int, base: dict) -> list:
    """Check every implementation against the reference on the first set, then time it over all sets. -> rows."""
    first = case["sets"][0]
    want = case["reference"](*first)
    rows = []
    for name, fn in case["impls"].items():
        row = dict(base, **{k: case[k] for k in ("op", "case", "shape", "batch", "context", "bytes")}, impl=name,
                   sets=len(case["sets"]))
        try:
            row.update(errors(case["pick"](fn(*first)), want))
            row["ok"] = row["finite"] and row["rel_l2_err"] < REL_BOUND
            calls = [lambda fn=fn, s=s: fn(*s) for s in case["sets"]]
            ms, row["timing"] = time_calls(calls, reps)
            row["us"] = 1e3 * ms
            row["eager_us"] = 1e3 * time_calls(calls, reps, capture=False)[0]
            row["tb_s"] = row["bytes"] / (row["us"] * 1e-6) / 1e12
        except Exception as e:  # an implementation that fails to build or run loses, and says why
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-400:]}")
        detail = (f"{row['us']:8.1f} us  eager {row['eager_us']:8.1f} us  rel {row['rel_l2_err']:.1e}"
                  f"{'' if row['ok'] else '  NOT OK'}") if "us" in row else row.get("error", "")
        print(f"  {row['op']:<21} {row['shape']:<16} {name:<14} {detail}", flush=True)
        rows.append(row)
    return rows


def geomean_speedup(rows: list, op: str, impl: str):
    """Geometric mean over the op's decode cases of triton us / ``impl`` us; 0 when ``impl`` failed a case
    (or was not ok there) that Triton passed; None without cases."""
    ratios = []
    for shape in dict.fromkeys(r["shape"] for r in rows if r["op"] == op and r["case"] == "decode"):
        case = {r["impl"]: r for r in rows if r["op"] == op and r["case"] == "decode" and r["shape"] == shape}
        tri, other = case.get("triton", {}), case.get(impl, {})
        if not other.get("ok"):
            if tri.get("ok"):
                return 0.0
            continue
        if tri.get("ok"):
            ratios.append(tri["us"] / other["us"])
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None


def choose(rows: list, op: str) -> dict:
    """The op's choice between Triton and TileLang as the dispatcher runs it (its launch config): TileLang when
    its geometric-mean decode speedup over Triton exceeds 1 and it passed every case Triton passed. The other
    TileLang tiles are reported beside it, for launch_config."""
    geo = geomean_speedup(rows, op, "tilelang")
    variants = sorted({r["impl"] for r in rows if r["op"] == op and r["impl"].startswith("tilelang-")})
    per_variant = {v: geomean_speedup(rows, op, v) for v in variants}
    return {"op": op, "impl": "choice", "choice": "tilelang" if geo is not None and geo > 1.0 else "triton",
            "geomean_speedup": geo, "variants_geomean_speedup": per_variant}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tilelang_vs_triton: needs a CUDA GPU (TileLang kernels do not run on the CPU)", file=sys.stderr)
        return 2
    from deepinfer.backends.nvidia import tilelang_common

    if not tilelang_common.importable():
        print("tilelang_vs_triton: tilelang is not importable (scripts/device_tilelang.sh installs it)",
              file=sys.stderr)
        return 2
    if args.smoke:
        args.batches, args.contexts, args.reps, args.rotate_mb = [1, 4], [512], 3, 8.0
    torch.manual_seed(0)
    base = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "git": git_rev(),
            "python": platform.python_version()}
    try:
        import tilelang
        import triton

        base.update(tilelang=tilelang.__version__, triton=triton.__version__,
                    stream="torch exchange API" if tilelang_common.stream_from_torch() else "use_torch_stream")
    except ImportError:
        pass
    specs = []
    if "ced_sparse_attention" in args.ops:
        specs += [(ced_case, (b, ctx, 1)) for ctx in args.contexts for b in args.batches]
        if not args.no_prefill:
            specs.append((ced_case, (1, max(args.contexts), 256 if args.smoke else 2048)))
    if "mla_decode" in args.ops:
        specs += [(mla_case, (b, ctx)) for ctx in args.contexts for b in args.batches]
    rows = []
    for build, shape in specs:
        case = build(*shape, args.rotate_mb, args.tilelang_block_n)
        rows += run_case(case, args.reps, base)
        del case
        torch.cuda.empty_cache()
    choices = [dict(base, **choose(rows, op)) for op in args.ops]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        for row in rows + choices:
            f.write(json.dumps(row) + "\n")
    print(f"\n{'op':<21} {'case':<8} {'shape':<16} {'triton us':>10} {'tilelang us':>12} {'speedup':>8}   "
          "other tiles (us)")
    nan = float("nan")
    for key in dict.fromkeys((r["op"], r["case"], r["shape"]) for r in rows):
        case = {r["impl"]: r for r in rows if (r["op"], r["case"], r["shape"]) == key}
        tri, tl_ = case.get("triton", {}), case.get("tilelang", {})
        us = lambda r: r["us"] if r.get("ok") else nan  # noqa: E731
        others = "  ".join(f"{k[9:]} {us(r):.1f}" for k, r in case.items() if k.startswith("tilelang-"))
        print(f"{key[0]:<21} {key[1]:<8} {key[2]:<16} {us(tri):10.1f} {us(tl_):12.1f} {us(tri) / us(tl_):8.2f}   "
              f"{others}")
    fmt = lambda g: "n/a" if g is None else f"{g:.2f}x"  # noqa: E731
    for c in choices:
        others = ", ".join(f"{v} {fmt(g)}" for v, g in c["variants_geomean_speedup"].items())
        print(f"choice {c['op']}: {c['choice']} (TileLang's decode speed over Triton's, geometric mean: "
              f"{fmt(c['geomean_speedup'])}; other TileLang tiles: {others or 'none timed'})")
    print(f"rows: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
