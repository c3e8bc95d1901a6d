"""Where a decode step's time goes, on the GPU: engine step vs CUDA-graph replay vs the kernels inside.

    python benchmarks/profile_decode.py --batches 1 64 --out $OUT/profile.jsonl   # device run, ~1 min

For the Llama-3.1-8B shape with random bf16 weights (as benchmarks/gpu_bench.py builds it), at each batch size:
``step_ms``: steady engine step (wall, B sequences decoding, overlap scheduling as configured); ``wait_ms``: the
part of it the host spent waiting for a step's tokens (near zero: the step is host-bound);
``replay_ms``: the captured decode graph alone, replayed back to back (CUDA events) - the GPU's share;
``kernels``: the top kernels by GPU time per step under torch.profiler (the graph's kernels are listed one by
one), so the gap to the bandwidth roofline can be attributed; ``device_ms`` and the rest of ``device_split``: the
GPU's busy time a step and the part launched outside the graph, so a step longer than its replay says whether the
device works or waits; ``timeline``: where the profiled steps' span on the device goes when kernels overlap (PDL
launches a kernel while the one before still runs, so busy time double-counts): each kernel is charged only for
how far it moves the end of the timeline, and the idle gaps apart. One JSONL row per batch size, and a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402  (the same model shapes and builder)


def steady_steps(llm, B: int, in_len: int, n_steps: int, vocab: int, profile=False):
    """Add B requests, step until each has a token, then time n_steps steps (optionally under a profiler:
    "gpu" torch.profiler, "host" cProfile with CUDA sync detection)."""
    from deepinfer import SamplingParams

    eng = llm.engine
    rng = random.Random(B)
    sp = SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0.0)
    rids = [f"p{B}-{profile}-{i}" for i in range(B)]
    reqs = [eng.add_request(r, {"prompt_token_ids": gpu_bench.random_ids(rng, vocab, in_len)}, sp) for r in rids]
    while not all(r.first_token_time for r in reqs):
        eng.step()
    for _ in range(4):
        eng.step()
    prof = None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if profile == "host":
        import cProfile

        from deepinfer.testing.syncs import synchronizing_calls

        prof = cProfile.Profile()
        prof.enable()
        syncs = synchronizing_calls(eng.step, n_steps)  # none should be in a launch
        prof.disable()
        torch.cuda.synchronize()
        prof.syncs = sorted({s[:160] for s in syncs})
    elif profile:
        from torch.profiler import ProfilerActivity, profile as tprofile

        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n_steps):
                eng.step()
            torch.cuda.synchronize()
    else:
        with event_waits() as waited:
            for _ in range(n_steps):
                eng.step()
            torch.cuda.synchronize()
        llm.wait_ms = 1e3 * waited[0] / n_steps
    dt = time.perf_counter() - t0
    for r in rids:
        eng.abort(r)
    while eng.has_unfinished():
        eng.step()
    return 1e3 * dt / n_steps, prof


@contextlib.contextmanager
def event_waits():
    """Seconds the host spends in torch.cuda.Event.synchronize (a step's collection waiting for its tokens) while
    the block runs, in a one-item list. An engine step minus its wait is the host's own time: a wait near zero
    means the device waited for the host (host-bound), not the other way round."""
    waited = [0.0]
    real = torch.cuda.Event.synchronize

    def timed(self):
        t = time.perf_counter()
        try:
            return real(self)
        finally:
            waited[0] += time.perf_counter() - t

    torch.cuda.Event.synchronize = timed
    try:
        yield waited
    finally:
        torch.cuda.Event.synchronize = real


def replay_ms(llm, B: int) -> float | None:
    """The graph the steady steps replayed last (its batch and block buckets: before the 15th session this took
    the smallest block bucket, whose attention reads less, so replay_ms at batch 16 and 64 was low)."""
    graphs = llm.engine.decode_graphs
    key = getattr(graphs, "last_key", None) if graphs else None
    if key is None or key not in graphs.graphs or key[0] < B:
        return None
    graph = graphs.graphs[key][0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def top_kernels(prof, n_steps: int, k: int = 18) -> list:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.key and not e.key.startswith(("ProfilerStep", "cudaGraphLaunch")) and e.device_type.name == "CUDA":
            rows.append((e.key[:90], t / 1e3 / n_steps, e.count // n_steps))
    rows.sort(key=lambda r: -r[1])
    return [{"kernel": a, "ms_per_step": round(b, 4), "calls_per_step": c} for a, b, c in rows[:k]]


def device_split(prof, n_steps: int) -> dict:
    """Where a step's wall time is on the device, from the profiled steps: ``device_ms`` the GPU's busy time a step
    (every kernel and copy, the graph's and the rest), ``launches_outside_graph`` the kernels the host launched one
    by one (cudaLaunchKernel / cuLaunchKernel calls a step) and ``graph_launches``. Beside the engine step and the
    replay: busy well over the replay means device work outside the graph; busy well under the step, an idle
    device waiting for the host."""
    busy = launches = graphs = 0.0
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            busy += getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        elif e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += e.count
        elif e.key == "cudaGraphLaunch":
            graphs += e.count
    return {"device_ms": round(busy / 1e3 / n_steps, 3), "launches_outside_graph": round(launches / n_steps, 1),
            "graph_launches": round(graphs / n_steps, 1)}


def timeline(prof, n_steps: int, k: int = 18) -> dict:
    """The device span of the profiled steps, split by kernel: in start order, a kernel advances the timeline's end
    by max(0, its end - max(its start, the latest end before it)); a start after that latest end is idle time. So
    the advances plus the idle time add up to the span, and a kernel hidden under another's run costs nothing."""
    evs = sorted((e.time_range.start, e.time_range.end, e.name[:90]) for e in prof.events()
                 if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    if not evs:
        return {}
    adv: dict = {}
    frontier, idle = evs[0][0], 0.0
    for start, end, name in evs:
        if start > frontier:
            idle += start - frontier
        a = end - max(start, frontier)
        if a > 0:
            adv[name] = adv.get(name, 0.0) + a
            frontier = end
    span = frontier - evs[0][0]
    rows = sorted(adv.items(), key=lambda r: -r[1])[:k]
    return {"span_ms": round(span / 1e3 / n_steps, 4), "idle_ms": round(idle / 1e3 / n_steps, 4),
            "advance": [{"kernel": a, "ms_per_step": round(b / 1e3 / n_steps, 4)} for a, b in rows]}


def top_functions(prof, n_steps: int, k: int = 22) -> list:
    """Host time per step by function (self time), from cProfile."""
    import pstats

    st = pstats.Stats(prof)
    rows = [(f"{fn[0].split('/')[-1]}:{fn[1]}({fn[2]})", tt / n_steps * 1e3, nc // n_steps)
            for fn, (cc, nc, tt, ct, callers) in st.stats.items()]
    rows.sort(key=lambda r: -r[1])
    return [{"function": a[:90], "ms_per_step": round(b, 4), "calls_per_step": c} for a, b, c in rows[:k]]


def set_knobs(pairs: list) -> dict:
    """NAME=VALUE pairs -> the nvidia backend's module constants set (ints; bools as 0 / 1): NAME is a constant of
    backends/nvidia/ops.py, or MODULE.NAME one of another backends/nvidia module (triton_gemv.EARLY_W), or
    backends.MODULE.NAME one of deepinfer/backends (backends.cuda_graph.RESOLVE_IN_GRAPH), or any deepinfer module
    by its dotted path from the package (staging.ON, models.ced.engine_path.INDEX_CHUNK); unknown names raise."""
    import importlib
    import importlib.util

    knobs = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        mod_name, _, const = name.rpartition(".")
        top = f"deepinfer.{mod_name.split('.')[0]}" if mod_name else None
        path = f"deepinfer.{mod_name}" if top and importlib.util.find_spec(top) is not None else \
            f"deepinfer.backends.nvidia.{mod_name or 'ops'}"
        try:
            mod = importlib.import_module(path)
        except ImportError:
            raise SystemExit(f"--knob {pair!r}: no module {path}") from None
        if not hasattr(mod, const) or not isinstance(getattr(mod, const), (bool, int)):
            raise SystemExit(f"--knob {pair!r}: {mod.__name__} has no int / bool constant {const!r}")
        knobs[name] = type(getattr(mod, const))(int(value))
        setattr(mod, const, knobs[name])
    return knobs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(gpu_bench.SHAPES) + ["ced-bench"],
                    help="a gpu_bench shape, or ced-bench: the CED bench config (random weights)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default="profile.jsonl")
    ap.add_argument("--top", type=int, default=18, help="kernels listed a row (by GPU time a step)")
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs: profile the eager step's host time")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the deterministic recipe's kernels (EngineConfig.batch_invariant): what they cost")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                    help="set deepinfer.backends.nvidia.ops.NAME, or MODULE.NAME of that package (an existing int / "
                         "bool constant) first: A/B runs")
    args = ap.parse_args()
    knobs = set_knobs(args.knob)
    cfg = gpu_bench.ced_config("bench", 4096) if args.shape == "ced-bench" else gpu_bench.SHAPES[args.shape]
    ns = argparse.Namespace(dtype="bfloat16", device="cuda", backend=None, build_in_dtype="auto")
    overlap = {"auto": None, "on": True, "off": False}[args.overlap]
    with tempfile.TemporaryDirectory() as d:
        gpu_bench.write_model_dir(Path(d), cfg)
        llm, _ = gpu_bench.build_llm(Path(d), ns, cfg, max_model_len=4096, overlap_scheduling=overlap,
                                     enforce_eager=args.eager, num_kv_blocks=4096,
                                     batch_invariant=args.batch_invariant)
    vocab = cfg["vocab_size"]
    rows = []
    for B in args.batches:
        step, _ = steady_steps(llm, B, args.input_len, args.steps, vocab)
        wait = llm.wait_ms
        rep = replay_ms(llm, B)
        _, prof = steady_steps(llm, B, args.input_len, 8, vocab, profile="gpu")
        host_ms, hprof = steady_steps(llm, B, args.input_len, 16, vocab, profile="host")
        row = {"shape": args.shape, "knobs": knobs, "batch_invariant": args.batch_invariant, "batch": B,
               "step_ms": round(step, 3), "wait_ms": round(wait, 3), "replay_ms": rep and round(rep, 3),
               "overlap": llm.engine.overlap, **device_split(prof, 8), "kernels": top_kernels(prof, 8, args.top),
               "timeline": timeline(prof, 8, args.top),
               "syncs": hprof.syncs,
               "host": top_functions(hprof, 16)}
        rows.append(row)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    for r in rows:
        print(f"\n== batch {r['batch']}: engine step {r['step_ms']} ms (host waited {r['wait_ms']}), graph replay "
              f"{r['replay_ms']} ms "
              f"(overlap {r['overlap']}); under the profiler the GPU is busy {r['device_ms']} ms a step, with "
              f"{r['launches_outside_graph']} kernels launched outside the {r['graph_launches']} graph launches")
        print(f"{'ms/step':>9} {'calls':>5}  kernel")
        for k in r["kernels"]:
            print(f"{k['ms_per_step']:9.4f} {k['calls_per_step']:5d}  {k['kernel']}")
        t = r["timeline"]
        if t:
            print(f"timeline: span {t['span_ms']} ms a step, idle {t['idle_ms']} ms; what each kernel adds to it:")
            for k in t["advance"]:
                print(f"{k['ms_per_step']:9.4f}        {k['kernel']}")
        print(f"host (cProfile self time per step); synchronizing calls seen: {len(r['syncs'])}")
        for w in r["syncs"][:8]:
            print("   sync:", w)
        for k in r["host"]:
            print(f"{k['ms_per_step']:9.4f} {k['calls_per_step']:5d}  {k['function']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
