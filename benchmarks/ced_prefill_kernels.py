"""The CED prefill's three biggest kernels at the bench config, one choice against another, in one run (GPU).

    python benchmarks/ced_prefill_kernels.py --out $OUT/ced_prefill_kernels.jsonl     # H200, ~1 min

A 16K cold prefill's encoder layers (docs/benchmarks.md, fifteenth session) spend most of their GPU time in
CED sparse attention, the indexer's scores and its top-K, each over a 2048-query chunk ending at --context:
- attention (tilelang_vs_triton's ced_case: window 128 + 512 FP4 entries + sink, 16 heads x 512): FP4 entries
  decoded by triton_fp4.fp4_bf16_pair (``fast``) or by the float32 decoder it replaced (``FAST_DECODE`` off);
- indexer scores (16 heads x 128, MXFP4 keys, the encoder's m = 2: query i sees (i + 1) // 2 entries):
  BLOCK_Q queries a program (1: one query, as before; launch_config's choice) x the two decoders; then the
  scores over a decoded key table (triton_ced_scores, TABLE_LAUNCHES: its launch and neighbours);
- top-K (512 of up to --context // 2 entries): row tiles of 4096 (as before; re-read from L2 by each of the
  33 passes) or one tile of the whole row kept in registers, 8 or 16 warps (these three: the plain search, all
  32 passes); then on the one tile, the threshold search settling one or two bits a pass (TOPK_DIGIT), each
  without and with the early stop (TOPK_EARLY; one bit with it is the default), one bit on 4 warps, the ties'
  prefix sum only where needed (TOPK_LAZY_TIES) and the interpolation search (TOPK_SEARCH 1) (TOPK_SEARCHES).
--kernels picks which of the three run (all by default).
Each variant is checked against the reference op on the first input set (attention: relative L2 error under
1e-2; scores: relative L2 under 1e-4; top-K: the same sets as the reference's selection from the same scores)
and timed as kernels_gpu times (a CUDA graph of calls over rotating input sets). Rows go to --out; a table
prints each kernel's variants with the time against the first variant's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import errors, time_calls  # noqa: E402
from tilelang_vs_triton import ced_case  # noqa: E402


TABLE_LAUNCHES = ((8, 64, 8, 2), (8, 128, 8, 2), (8, 64, 4, 2), (8, 64, 8, 3), (4, 64, 4, 2), (16, 64, 8, 2),
                  (8, 32, 4, 3))


def indexer_inputs(chunk: int, context: int, sets: int, fmt: str, g: torch.Generator):
    """Input sets of the encoder's indexer: one sequence of context // 2 entries, a chunk of queries ending at
    context (query at position p sees (p + 1) // 2 entries)."""
    from deepinfer.backends.reference import lowbit
    from deepinfer.models.ced.config import SIZES, CEDConfig

    c = CEDConfig(**SIZES["bench"])
    nh, dh, J = c.index_heads, c.index_head_dim, context // 2
    pos = torch.arange(context - chunk, context)
    out = []
    for _ in range(sets):
        codes, scales = lowbit.quantize(torch.randn(J, dh, generator=g), fmt)
        slots = torch.randperm(J, generator=g)[None, :]
        q = torch.randn(chunk, nh, dh, generator=g).to(torch.bfloat16)
        w = torch.randn(chunk, nh, generator=g).to(torch.bfloat16)
        out.append(tuple(x.cuda() for x in (q, w, codes, scales)) + (fmt, slots.cuda(),
                                                                     torch.zeros(chunk, dtype=torch.long).cuda(),
                                                                     ((pos + 1) // 2).cuda()))
    return out, c.index_topk


def same_sets(ids: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of rows whose selected set equals the reference's."""
    a = torch.sort(ids, dim=1).values
    b = torch.sort(ref, dim=1).values
    return float((a == b).all(dim=1).float().mean())


# The threshold search's variants on the one tile: (bits a pass, early stop, warps or None for topk_select's, search
# 0 bits / 1 interpolation, lazy ties). A radix digit of 4 / 8 bits a pass from a histogram lost here (36th session:
# 293 / 355 us against 252) and is gone.
TOPK_SEARCHES = ((1, True, None, 0, False), (2, False, None, 0, False), (2, True, None, 0, False),
                 (1, True, 4, 0, False), (1, True, None, 0, True), (1, True, None, 1, False), (1, True, None, 1, True),
                 (1, True, 4, 1, True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="ced_prefill_kernels.jsonl")
    ap.add_argument("--kernels", nargs="+", default=["attention", "indexer", "topk"],
                    choices=["attention", "indexer", "topk"])
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from deepinfer.backends.nvidia import triton_ced_attention as tca, triton_ced_indexer as tci, triton_fp4
    from deepinfer.backends.reference.ops import ReferenceOps
    from deepinfer.bench import format_table

    ref_ops = ReferenceOps("cuda")
    rows = []

    def run(kernel, variant, fn, sets, check):
        row = dict(bench="ced_prefill_kernels", kernel=kernel, variant=variant, chunk=a.chunk, context=a.context,
                   device=torch.cuda.get_device_name())
        try:
            row.update(check(fn(*sets[0])))
            us, row["timing"] = time_calls([lambda s=s: fn(*s) for s in sets], a.reps)
            row["us"] = round(us * 1e3, 1)
        except Exception as e:  # a variant that does not build loses; the others still run
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-300:]}")
        base = next((r for r in rows if r["kernel"] == kernel and r.get("us")), None)
        if base is not None and row.get("us"):
            row["vs_first"] = round(row["us"] / base["us"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)

    if "attention" in a.kernels:
        # Attention: the chunk's queries, the fast FP4 decoder off, then on.
        case = ced_case(1, a.context, a.chunk, 256.0, [])
        sets = [(args, kw) for args, kw in case["sets"]]
        want = case["reference"](*sets[0])

        def attn_check(out):
            e = errors(out, want)
            return dict(e, ok=e["finite"] and e["rel_l2_err"] < 1e-2)

        for fast in (False, True):
            triton_fp4.FAST_DECODE = fast
            run("attention", "fast decoder" if fast else "float32 decoder",
                lambda args, kw: tca.sparse_attention(*args, **kw), sets, attn_check)
        del case, sets
        torch.cuda.empty_cache()

    # Indexer scores (their time: indexer_topk's less topk_select's on the same scores), then top-K.
    isets, k = indexer_inputs(a.chunk, a.context, 4, "mxfp4", torch.Generator().manual_seed(0))
    q0, w0, c0, s0, *rest0 = isets[0]
    ref_ids, ref_scores = ref_ops.ced_indexer_topk(q0, w0, (c0, s0), *rest0, k, return_scores=True)
    bq = tci.launch_config(*q0.shape[1:], a.chunk)["BLOCK_Q"]  # (index heads, head dim) of the inputs

    def score_check(res):
        ids, scores = res
        vis = torch.arange(scores.shape[1], device="cuda")[None, :] < isets[0][7][:, None]
        rel = float((scores[vis] - ref_scores[vis]).norm() / ref_scores[vis].norm())
        return dict(rel_l2_err=rel, same_sets=same_sets(ids, ref_ids), ok=rel < 1e-4)

    for fast in ((False, True) if "indexer" in a.kernels else ()):
        triton_fp4.FAST_DECODE = fast
        for q in sorted({1, bq}):
            run("indexer", f"BLOCK_Q {q}, {'fast' if fast else 'float32'} decoder",
                lambda *s, _q=q: tci.indexer_topk(*s, k, return_scores=True, launch={"BLOCK_Q": _q}, table=False),
                isets, score_check)
    triton_fp4.FAST_DECODE = True
    # The scores over a decoded key table (triton_ced_scores; the table's build inside the time), at its launch
    # and its neighbours: BLOCK_Q queries, BLOCK_J keys, warps, stages.
    for bq, bj, warps, stages in TABLE_LAUNCHES if "indexer" in a.kernels else ():
        run("indexer", f"table, BLOCK_Q {bq}, BLOCK_J {bj}, {warps} warps, {stages} stages",
            lambda *s, _l=dict(BLOCK_Q=bq, BLOCK_J=bj, num_warps=warps, num_stages=stages):
            tci.indexer_topk(*s, k, return_scores=True, launch=_l, table=True), isets, score_check)
    scores = [tci.indexer_topk(*s, k, return_scores=True)[1] for s in isets]
    tsets = [(sc, s[7]) for sc, s in zip(scores, isets)]
    want_ids = ref_ids  # (the reference's selection from its own scores)
    row = max(4096, 1 << (a.context // 2 - 1).bit_length())
    same = lambda ids: dict(same_sets_vs_reference=same_sets(ids, want_ids), ok=True)  # noqa: E731
    for block, warps in ((4096, 8), (row, 8), (row, 16)) if "topk" in a.kernels else ():
        run("topk", f"{'tiles of 4096' if block < row else 'one tile'}, {warps} warps",
            lambda sc, nv, _b=block, _w=warps: tci.topk_select(sc, nv, k, block=_b, num_warps=_w, digit=1,
                                                               early=False), tsets, same)
    for digit, early, warps, search, lazy in TOPK_SEARCHES if "topk" in a.kernels else ():
        how = "interpolation" if search else f"{digit} bit{'s' * (digit > 1)} a pass"
        run("topk", f"one tile, {warps or 'default'} warps, {how}{', early stop' * early}{', lazy ties' * lazy}",
            lambda sc, nv, _d=digit, _e=early, _w=warps, _s=search, _z=lazy: tci.topk_select(
                sc, nv, k, digit=_d, early=_e, num_warps=_w, search=_s, lazy_ties=_z), tsets, same)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(format_table(rows, [("kernel", "kernel", "{}"), ("variant", "variant", "{}"), ("us", "us", "{:.1f}"),
                              ("vs first", "vs_first", "{:.3f}"), ("ok", "ok", "{}"),
                              ("rel L2", "rel_l2_err", "{:.1e}")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
