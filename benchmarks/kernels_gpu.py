"""Triton kernels of the nvidia backend against the reference ops, on CUDA, at realistic shapes.

    python benchmarks/kernels_gpu.py --out $OUT/kernels_gpu.jsonl
    python benchmarks/kernels_gpu.py --smoke --out /tmp/kernels_smoke.jsonl   # tiny shapes; CPU interpreter
                                                                            # when there is no GPU

For every case: build fresh random inputs (several sets, so that repeated calls are not served from the
L2 cache), check the kernel against the reference op on them first (max abs error, relative L2 error;
a case that fails its bound is reported as not ok), then time both. Timing: warm-up (compilation included)
on a side stream, then one CUDA graph per op holding several calls that rotate over the input sets, replayed
``--reps`` times between CUDA events; the time per call is the median replay time over the calls in it
(graphs remove the Python launch gaps, as the engine's decode graphs do). An op that cannot be captured is
timed eagerly with events around the same calls instead (the row says ``timing: eager``).

Bandwidth = the fewest bytes the op must move (each input read once, each output written once) over the
kernel's time, against the H200's 4.29 TB/s (``--peak-tbs``).

Cases (bf16):
  paged_decode  Llama-3.1-8B attention shape: 32 query heads, 8 KV heads, head dim 128, block size 16;
                batch 1/16/64/256 x context 1024/4096 (every row at that context, shuffled block tables).
  rms_norm, add_rms_norm  [256, 4096].
  silu_and_mul  [256, 2 * 14336].
  fp8_quantize, fp8_dequantize  KV of 4096 tokens x 8 heads x 128 (the lowbit fp8_e4m3_pow2 layout;
                bit-exact check).

Rows go to ``--out`` as JSON lines; a table is printed last. Runs in well under 2 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

PEAK_TBS = 4.29  # H200 HBM3e, TB/s


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="kernels_gpu.jsonl", help="JSONL file for the result rows")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=20, help="timed graph replays per op (median)")
    ap.add_argument("--rotate-mb", type=float, default=256.0,
                    help="input sets per case are added until the data touched exceeds this (defeats L2)")
    ap.add_argument("--peak-tbs", type=float, default=PEAK_TBS, help="memory bandwidth to compare with, TB/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, to check the script itself; without CUDA it runs the kernels through "
                         "Triton's interpreter on the CPU and times with the host clock (numbers meaningless)")
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------- timing
def _warm(calls) -> None:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def time_calls(calls, reps: int, capture: bool = True) -> tuple[float, str]:
    """Median milliseconds per call over `reps` runs of all `calls` (each a zero-argument op call), replayed
    from one CUDA graph, or launched eagerly when `capture` is False (ops with host syncs) or capture fails."""
    if not torch.cuda.is_available():  # --smoke on the CPU: host clock, eager
        for f in calls:
            f()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for f in calls:
                f()
            times.append((time.perf_counter() - t0) * 1e3 / len(calls))
        return statistics.median(times), "host"
    _warm(calls)
    graph = None
    try:
        if not capture:
            raise RuntimeError("not capturable (host syncs)")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in calls:
                f()
        run, mode = graph.replay, "graph"
        run()
    except Exception as e:  # an op that cannot be captured: time it eagerly
        if capture:
            print(f"  (graph capture failed: {type(e).__name__}: {e}; timing eagerly)", file=sys.stderr)
        torch.cuda.synchronize()
        graph = None

        def run():
            for f in calls:
                f()

        mode = "eager"
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    torch.cuda.synchronize()
    return statistics.median(times), mode


def n_sets(bytes_per_set: int, rotate_mb: float, most: int = 32) -> int:
    return int(max(1, min(most, -(-int(rotate_mb * 2**20) // max(1, bytes_per_set)))))


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.double(), ref.double()
    finite = bool(torch.isfinite(o).all())
    return {"max_abs_err": float((o - r).abs().max()), "rel_l2_err": float((o - r).norm() / r.norm().clamp_min(1e-30)),
            "ref_max_abs": float(r.abs().max()), "finite": finite}


# ------------------------------------------------------------------------------------------- cases
def decode_case(B: int, ctx: int, sets: int, gen: torch.Generator, dev, H=32, Hk=8, D=128, bs=16,
                dtype=torch.bfloat16):
    """`sets` independent decode batches over one paged cache: each set its own shuffled blocks."""
    from deepinfer.backends.base import AttnMetadata

    nb = -(-ctx // bs)
    total = sets * B * nb + 1
    k_cache = torch.randn(total * bs, Hk, D, device=dev, dtype=dtype)
    v_cache = torch.randn(total * bs, Hk, D, device=dev, dtype=dtype)
    perm = torch.randperm(total, generator=gen).to(dev)
    metas, qs = [], []
    kv_pos = torch.arange(nb * bs, device=dev)
    for s in range(sets):
        bt = perm[s * B * nb:(s + 1) * B * nb].view(B, nb).contiguous()
        lens = torch.full((B,), ctx, device=dev, dtype=torch.long)
        q_pos = (lens - 1)[:, None]
        kv_slots = bt[:, kv_pos // bs] * bs + kv_pos % bs
        meta = AttnMetadata(positions=q_pos[:, 0], slot_mapping=kv_slots[:, ctx - 1], seq_lens=lens,
                            q_index=torch.arange(B, device=dev)[:, None],
                            q_valid=torch.ones(B, 1, dtype=torch.bool, device=dev), kv_slots=kv_slots, q_pos=q_pos,
                            block_table=bt, block_size=bs)
        meta.mask(None)  # build the reference's cached mask outside any graph capture
        metas.append(meta)
        qs.append(torch.randn(B, H, D, device=dev, dtype=dtype))
    return qs, k_cache, v_cache, metas


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        if not args.smoke:
            print("kernels_gpu.py needs a CUDA GPU (run it on the device machine), or --smoke", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import triton

    from deepinfer.backends import nvidia
    from deepinfer.backends.nvidia import triton_attention
    from deepinfer.backends.nvidia.ops import NvidiaOps
    from deepinfer.backends.reference import lowbit
    from deepinfer.backends.reference.ops import ReferenceOps

    if nvidia.interpreter_requested() and torch.cuda.is_available():
        print("TRITON_INTERPRET is set: unset it to time compiled kernels", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:  # tiny shapes
        args.batches, args.contexts, args.reps, args.rotate_mb = [1, 3], [40], 2, 0.05
    T, d, F, N = (4, 64, 48, 64) if args.smoke else (256, 4096, 14336, 4096 * 8)
    H, Hk, D, bs = (4, 2, 32, 16) if args.smoke else (32, 8, 128, 16)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    fast, ref = NvidiaOps(dev), ReferenceOps(dev)
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "peak_tbs": args.peak_tbs}
    rows: list = []
    out_f = open(args.out, "w")
    t_start = time.time()

    def emit(row: dict) -> None:
        row = {**row, **info}
        rows.append(row)
        out_f.write(json.dumps(row) + "\n")
        out_f.flush()
        print(f"  {row['kernel']:<15} {row['shape']:<28} {row['ms'] * 1e3:9.1f} us  ref {row['ref_ms'] * 1e3:10.1f} us  "
              f"{row['tb_s']:5.2f} TB/s  ok={row['ok']}", flush=True)

    def measure(kernel: str, shape: str, calls_fast, calls_ref, nbytes: int, err: dict, ok: bool,
                ref_capture: bool = True, **extra):
        ms, mode = time_calls(calls_fast, args.reps)
        ref_ms, ref_mode = time_calls(calls_ref, max(3, args.reps // 4), capture=ref_capture)
        tbs = nbytes / (ms * 1e-3) / 1e12
        emit({"kernel": kernel, "shape": shape, "ms": ms, "ref_ms": ref_ms, "speedup": ref_ms / ms, "bytes": nbytes,
              "tb_s": tbs, "frac_peak": tbs / args.peak_tbs, "timing": mode, "ref_timing": ref_mode, "ok": ok,
              "calls_per_graph": len(calls_fast), **err, **extra})

    # Decode attention, Llama-3.1-8B shape.
    scale = D ** -0.5
    for B in args.batches:
        for ctx in args.contexts:
            kv_bytes = B * ctx * Hk * D * 2 * 2  # K and V, bf16
            sets = n_sets(kv_bytes, args.rotate_mb)
            qs, kc, vc, metas = decode_case(B, ctx, sets, gen, dev, H, Hk, D, bs)
            out = fast.paged_attention(qs[0], kc, vc, metas[0], scale)
            want = ref.paged_attention(qs[0], kc, vc, metas[0], scale)
            err = errors(out, want)
            ok = err["finite"] and err["rel_l2_err"] < 1e-2
            nbytes = kv_bytes + 2 * B * H * D * 2 + metas[0].block_table.numel() * 8 + 2 * B * 8
            calls = [(lambda q=q, m=m: fast.paged_attention(q, kc, vc, m, scale)) for q, m in zip(qs, metas)]
            calls = (calls * (-(-8 // len(calls))))[:max(8, len(calls))]  # at least 8 calls per graph
            ref_calls = [(lambda q=q, m=m: ref.paged_attention(q, kc, vc, m, scale)) for q, m in zip(qs, metas)]
            ref_calls = ref_calls[:2] if kv_bytes > 2**30 else ref_calls[:4]
            splits = triton_attention.choose_splits(B, Hk, 1, metas[0].block_table.shape[1] * bs, dev,
                                                    16 if triton_attention.INTERPRET else 64)
            measure("paged_decode", f"B={B} ctx={ctx} H={H}/{Hk} D={D}", calls, ref_calls, nbytes, err, ok,
                    batch=B, context=ctx, heads=H, kv_heads=Hk, head_dim=D, block_size=bs, splits=splits,
                    input_sets=sets)
            del qs, kc, vc, metas, out, want, calls, ref_calls
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    # RMSNorm and fused add + RMSNorm, [256, 4096].
    sets = n_sets(T * d * 2 * 2, args.rotate_mb)
    xs = [torch.randn(T, d, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    rs = [torch.randn(T, d, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    w = (1 + 0.1 * torch.randn(d, device=dev)).to(torch.bfloat16)
    err = errors(fast.rms_norm(xs[0], w, 1e-5), ref.rms_norm(xs[0], w, 1e-5))
    ok = err["finite"] and err["max_abs_err"] <= 2 * 2**-7 * err["ref_max_abs"]  # within ~2 bf16 ulps
    measure("rms_norm", f"[{T}, {d}]", [(lambda x=x: fast.rms_norm(x, w, 1e-5)) for x in xs],
            [(lambda x=x: ref.rms_norm(x, w, 1e-5)) for x in xs], 2 * T * d * 2 + d * 2, err, ok)
    o, h = fast.add_rms_norm(xs[0], rs[0], w, 1e-5)
    ro, rh = ref.add_rms_norm(xs[0], rs[0], w, 1e-5)
    err = {**errors(o, ro), "residual_exact": bool(torch.equal(h, rh))}
    ok = err["finite"] and err["residual_exact"] and err["max_abs_err"] <= 2 * 2**-7 * err["ref_max_abs"]
    measure("add_rms_norm", f"[{T}, {d}]", [(lambda x=x, r=r: fast.add_rms_norm(x, r, w, 1e-5)) for x, r in zip(xs, rs)],
            [(lambda x=x, r=r: ref.add_rms_norm(x, r, w, 1e-5)) for x, r in zip(xs, rs)], 4 * T * d * 2 + d * 2, err, ok)
    del xs, rs

    # SiLU-and-mul, [256, 2 * 14336].
    sets = n_sets(T * 3 * F * 2, args.rotate_mb)
    xs = [torch.randn(T, 2 * F, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    err = errors(fast.silu_and_mul(xs[0]), ref.silu_and_mul(xs[0]))
    ok = err["finite"] and err["max_abs_err"] <= 2 * 2**-7 * err["ref_max_abs"]
    measure("silu_and_mul", f"[{T}, 2*{F}]", [(lambda x=x: fast.silu_and_mul(x)) for x in xs],
            [(lambda x=x: ref.silu_and_mul(x)) for x in xs], T * 3 * F * 2, err, ok)
    del xs

    # FP8 KV quantisation: 4096 tokens x 8 heads x 128 channels.
    C = 128
    sets = n_sets(N * C * 3, args.rotate_mb)
    xs = [torch.randn(N, C, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    codes, scales = fast.quantize_kv(xs[0], "fp8_e4m3_pow2")
    rc, rsc = lowbit.quantize(xs[0], "fp8_e4m3_pow2")
    exact = bool(torch.equal(codes, rc) and torch.equal(scales, rsc))
    err = {"bit_exact": exact, "finite": True, "max_abs_err": 0.0 if exact else float("nan"),
           "rel_l2_err": 0.0 if exact else float("nan")}
    measure("fp8_quantize", f"[{N}, {C}] bf16", [(lambda x=x: fast.quantize_kv(x, "fp8_e4m3_pow2")) for x in xs],
            [(lambda x=x: lowbit.quantize(x, "fp8_e4m3_pow2")) for x in xs[:2]], N * C * 2 + N * C + N * C // 32,
            err, exact, ref_capture=False)
    packed = [fast.quantize_kv(x, "fp8_e4m3_pow2") for x in xs]
    back = fast.dequantize_kv(codes, scales, "fp8_e4m3_pow2", torch.bfloat16)
    exact = bool(torch.equal(back, lowbit.dequantize(rc, rsc, "fp8_e4m3_pow2", torch.bfloat16)))
    err = {"bit_exact": exact, "finite": bool(torch.isfinite(back).all()), "max_abs_err": 0.0 if exact else float("nan"),
           "rel_l2_err": 0.0 if exact else float("nan")}
    measure("fp8_dequantize", f"[{N}, {C}] -> bf16",
            [(lambda c=c, s=s: fast.dequantize_kv(c, s, "fp8_e4m3_pow2", torch.bfloat16)) for c, s in packed],
            [(lambda c=c, s=s: lowbit.dequantize(c, s, "fp8_e4m3_pow2", torch.bfloat16)) for c, s in packed[:2]],
            N * C + N * C // 32 + N * C * 2, err, exact, ref_capture=False)
    out_f.close()

    print(f"\n{'kernel':<15} {'shape':<28} {'us':>9} {'ref us':>10} {'speedup':>8} {'TB/s':>6} {'%peak':>6} "
          f"{'rel_l2':>8} ok   (peak {args.peak_tbs} TB/s, {info['device']}, {time.time() - t_start:.0f} s)")
    for r in rows:
        print(f"{r['kernel']:<15} {r['shape']:<28} {r['ms'] * 1e3:9.1f} {r['ref_ms'] * 1e3:10.1f} {r['speedup']:8.1f} "
              f"{r['tb_s']:6.2f} {100 * r['frac_peak']:5.1f}% {r['rel_l2_err']:8.1e} {r['ok']}")
    bad = [r for r in rows if not r["ok"]]
    if bad:
        print(f"\n{len(bad)} case(s) failed the correctness check: {[(r['kernel'], r['shape']) for r in bad]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
