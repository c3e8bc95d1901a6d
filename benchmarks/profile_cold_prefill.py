"""Where a cold CED prefill goes on the GPU: the CED bench config (prefix caching off, as gpu_bench's phase ced
builds it) prefills one random prompt of ``--tokens`` in each replay mode; the wall time against the matmul
floor (gpu_bench.ced_prefill_flops), then under torch.profiler the GPU's busy time and the kernels by device time,
grouped by name, the host's top ops by self CPU time, and the device's idle spans with where the host was then
(``--host``: a cProfile of one more prefill too; ``--ops``: the torch ops by the device time of the kernels they
launched themselves, with their input shapes, so a library kernel in the table can be traced to its op).

    python benchmarks/profile_cold_prefill.py --tokens 16384 --out $OUT/profile_cold_prefill   # device

Writes OUT.txt (the tables) and OUT.jsonl (a row per mode: wall, busy, launches, the top kernels).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402

LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def build(d: Path, args, mode: str):
    tokens = args.tokens
    max_len = max(args.max_len or 0, tokens + 16)
    cfg = gpu_bench.ced_config(args.size, max_len)
    gpu_bench.write_model_dir(d, cfg)
    ns = argparse.Namespace(dtype=args.dtype, device=args.device, backend=None, build_in_dtype="always")
    seqs = args.max_seqs
    llm = gpu_bench.build_llm(d, ns, cfg, hf_overrides={"replay_mode": mode}, max_model_len=max_len,
                              max_num_seqs=seqs, max_num_batched_tokens=max(args.batched or 0, tokens),
                              enable_prefix_caching=False, num_kv_blocks=max_len // 16 + 64 + 20 * (seqs - 4))[0]
    return llm, cfg


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill(llm, prompt) -> float:
    """gpu_bench's timed CED prefill (its gc.collect before the clock: ~0.15 s with a model's objects alive), then
    the device's queue drained, inside the time."""
    sync()
    dt = gpu_bench.Runner._ced_prefill(llm, prompt)
    t0 = time.perf_counter()
    sync()
    return dt + time.perf_counter() - t0


def kernel_rows(prof) -> list:
    """Device kernels grouped by name: calls, total us; sorted by total. Without CUDA (a check of the script on
    the CPU) the ops by self CPU time stand in for them."""
    by: dict = {}
    cuda = torch.cuda.is_available()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA or not cuda:
            name = e.name[:90]
            n, t = by.get(name, (0, 0.0))
            by[name] = (n + 1, t + (e.device_time if cuda else e.self_cpu_time_total))
    return sorted(([k, n, t] for k, (n, t) in by.items()), key=lambda r: -r[2])


def op_rows(prof, n: int) -> list:
    """The torch ops (aten::...) by the device time of the kernels each launched itself, grouped by input shapes:
    [name, shapes, calls, us], the ``n`` largest (Triton kernels launch outside any aten op and are not here)."""
    def us(e):  # (without CUDA, a check of the script on the CPU: their own CPU time)
        if not torch.cuda.is_available():
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    ev = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::") and us(e) > 0]
    ev.sort(key=lambda e: -us(e))
    return [[e.key, str(e.input_shapes), e.count, round(us(e), 1)] for e in ev[:n]]


def gaps(prof, least_us: float = 500.0) -> list:
    """The device's idle spans of at least ``least_us`` between the first and the last kernel, each with where the
    host was when it began (the innermost CPU ops running then; pure Python between ops shows as none):
    [start us from the first kernel, length us, host path]."""
    kern = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    out, end = [], None
    first = kern[0][0] if kern else 0
    if kern:
        out.append([0.0, round(first - min(e.time_range.start for e in cpu), 1), "before the first kernel"])
    for a, b in kern:
        if end is not None and a - end >= least_us:
            live = [e for e in cpu if e.time_range.start <= end <= e.time_range.end]
            path = " > ".join(e.name[:60] for e in sorted(live, key=lambda e: e.time_range.start)[-6:])
            out.append([round(end - first, 1), round(a - end, 1), path])
        end = b if end is None else max(end, b)
    return out


MARKED = ("forward_engine", "_plan_step", "_on_device", "layer_engine", "compress_full", "_choose_entries")
ENGINE_MARKED = ("step", "_launch", "_collect_step")  # Engine methods: the step's own host work around the forward


def marked_prefill(llm, prompt) -> tuple:
    """One more prefill with a host clock reading and a device event at the entry and exit of engine_path's
    MARKED functions and the engine's ENGINE_MARKED methods: (wall, [(mark, host ms, device ms)] from the first
    mark). Where device ms - host ms stays near
    its first value the device has caught up with the host and waits on it; where it grows the host is ahead."""
    from deepinfer.models.ced import engine_path as ep

    marks = []

    def mark(name):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((name, time.perf_counter(), ev))

    def wrap(name, f):
        def marked(*a, **k):
            at = {"layer_engine": 1, "compress_full": 1, "_choose_entries": 2}.get(name)  # the layer argument
            label = name if at is None else f"{'layer' if name == 'layer_engine' else name} {a[at].i}"
            mark(label + " >")
            out = f(*a, **k)
            mark(label + " <")
            return out
        return marked

    orig = {n: getattr(ep, n) for n in MARKED}
    for n, f in orig.items():
        setattr(ep, n, wrap(n, f))
    eng = llm.engine  # and the engine step around the forward (instance attributes, dropped after)
    for n in ENGINE_MARKED:
        setattr(eng, n, wrap(f"engine.{n}", getattr(eng, n)))
    try:
        wall = prefill(llm, prompt)
    finally:
        for n, f in orig.items():
            setattr(ep, n, f)
        for n in ENGINE_MARKED:
            delattr(eng, n)
    sync()
    h0, e0 = marks[0][1], marks[0][2]
    return wall, [(name, round((t - h0) * 1e3, 3), round(e0.elapsed_time(ev), 3)) for name, t, ev in marks]


def host_top(llm, prompt, n: int = 30) -> str:
    """cProfile of one more prefill: the top functions by own time (the host's share of the wall), then by
    cumulative time (where it is spent from the top down)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    prefill(llm, prompt)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(n)
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(n)
    return s.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--modes", nargs="+", default=["bounded", "exact"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", default="bench", help="a CEDConfig size (small: a CPU check of the script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--host", action="store_true", help="also cProfile one prefill (host functions by own time)")
    ap.add_argument("--stack", action="store_true",
                    help="record the ops' Python stacks (torch.profiler with_stack); the idle spans still name only "
                         "the ops live when the device ran dry, often none (34th session): --marks says where")
    ap.add_argument("--marks", action="store_true",
                    help="one more prefill with host / device times at engine_path's layer boundaries (MARKED)")
    ap.add_argument("--ops", action="store_true", help="record input shapes: torch ops by their kernels' device time")
    ap.add_argument("--max-len", type=int, default=None, help="the engine's max_model_len (default: tokens + 16)")
    ap.add_argument("--max-seqs", type=int, default=4, help="the engine's max_num_seqs (gpu_bench's ced phase: 64)")
    ap.add_argument("--batched", type=int, default=None, help="max_num_batched_tokens (default: tokens)")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                    help="a backend constant set first (profile_decode.set_knobs: ENTRY_TABLE=1)")
    ap.add_argument("--out", default="profile_cold_prefill")
    args = ap.parse_args()
    from profile_decode import set_knobs

    knobs = set_knobs(args.knob)
    report, rows = io.StringIO(), []

    def say(*a):
        print(*a, flush=True)
        print(*a, file=report)

    n = 8192 if args.device == "cuda" else 512
    x = torch.randn(n, n, device=args.device, dtype=getattr(torch, args.dtype))
    for _ in range(3):
        x @ x
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        x @ x
    sync()
    rate = 10 * 2 * n ** 3 / (time.perf_counter() - t0)
    del x
    say(f"{args.dtype} matmul {n}^3: {rate / 1e12:.1f} TFLOP/s")
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as d:
            llm, cfg = build(Path(d), args, mode)
            vocab = llm.engine.model.vocab_size
            g = torch.Generator().manual_seed(args.tokens)
            prompt = torch.randint(0, vocab, (args.tokens,), generator=g).tolist()
            prefill(llm, prompt)  # compiles every kernel this length uses
            walls = [prefill(llm, prompt) for _ in range(args.repeats)]
            model = llm.engine.model
            flops = gpu_bench.ced_prefill_flops(model, model.counters)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts, record_shapes=args.ops, with_stack=args.stack) as prof:
                prof_wall = prefill(llm, prompt)
            kern = kernel_rows(prof)
            busy = sum(r[2] for r in kern) / 1e6
            ev = prof.key_averages()
            launches = sum(e.count for e in ev if e.key in LAUNCH)
            wall = statistics.median(walls)
            each = [round(w * 1e3, 1) for w in walls]
            say(f"\n== {mode}{' ' + str(knobs) if knobs else ''}: {args.tokens} tokens,"
                f" wall {wall * 1e3:.1f} ms (all {each}),"
                f" profiled {prof_wall * 1e3:.1f} ms, GPU busy {busy * 1e3:.1f} ms, {launches} launches;"
                f" matmul floor {flops['flops'] / rate * 1e3:.1f} ms ({flops['flops'] / rate / wall:.1%} of the wall)"
                f"; layer tokens {list(model.counters['layer_tokens'])}")
            say(f"{'kernel':90s} {'calls':>6s} {'ms':>8s} {'share':>6s}")
            for name, n, t in kern[:args.top]:
                say(f"{name:90s} {n:6d} {t / 1e3:8.2f} {t / 1e6 / busy:6.1%}")
            say(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
            idle = gaps(prof) if torch.cuda.is_available() else []
            say(f"device idle spans >= 0.5 ms: {len(idle)}, {sum(g[1] for g in idle) / 1e3:.1f} ms in all")
            for g in idle[:25]:
                say(f"  at {g[0] / 1e3:8.2f} ms for {g[1] / 1e3:7.2f} ms  host in: {g[2]}")
            ops = op_rows(prof, args.top) if args.ops else []
            if ops:
                say(f"{'torch op':40s} {'input shapes':80s} {'calls':>6s} {'device ms':>9s}")
                for name, shapes, n, t in ops:
                    say(f"{name:40s} {shapes[:80]:80s} {n:6d} {t / 1e3:9.2f}")
            if args.host:
                say(host_top(llm, prompt))
            marks = []
            if args.marks and torch.cuda.is_available():
                mwall, marks = marked_prefill(llm, prompt)
                say(f"marks (wall {mwall * 1e3:.1f} ms; host ms, device ms, device - host: the host's lead):")
                for name, h, g in marks:
                    say(f"  {name:28s} {h:9.3f} {g:9.3f} {g - h:9.3f}")
            rows.append({"bench": "profile_cold_prefill", "mode": mode, "tokens": args.tokens, "knobs": knobs,
                         "wall_s": wall,
                         "walls_s": walls, "busy_s": busy, "launches": launches, "flops": flops,
                         "matmul_flop_per_s": rate, "fraction_of_matmul_rate": flops["flops"] / rate / wall,
                         "idle_spans": idle, "ops": ops, "marks": marks,
                         "kernels": [[k, n, round(t, 1)] for k, n, t in kern[:60]]})
            del llm, model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    Path(args.out + ".txt").write_text(report.getvalue())
    Path(args.out + ".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
