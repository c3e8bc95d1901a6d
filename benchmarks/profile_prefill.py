"""Where a prefix-cache hit's prefill step goes on the GPU: the CED bench config (or a gpu_bench shape) with a
long cached prefix and a short fresh suffix, the case whose TTFT the per-step overhead bounds.

    python benchmarks/profile_prefill.py --shape ced-bench --prefix 16384 --out $OUT/profile_prefill  # device

Prints and writes (``OUT.txt``, ``OUT.jsonl``): the hit's wall time; under torch.profiler the top ops by
self CPU time and by device time, the number of kernel launches, of host-to-device copies and of synchronising
CUDA calls (the whole request's, and those of the model's forward alone: ``forward``); under cProfile the top
Python functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402
import prefix_bench  # noqa: E402

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


def forward_only(llm, prompt: list) -> dict:
    """One more hit with only the model's forward calls watched: torch's sync debug mode counts the synchronising
    CUDA calls they make (deepinfer.testing.syncs), the profiler their host-to-device copies and kernel launches."""
    from deepinfer.testing.syncs import synchronizing_calls

    model = llm.engine.model
    inner = model.forward
    seen = {"syncs": 0, "h2d": 0, "launches": 0}

    def watched(*a, **k):
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        out = []
        with torch.profiler.profile(activities=acts) as prof:
            seen["syncs"] += len(synchronizing_calls(lambda: out.append(inner(*a, **k)), 1))
        ev = prof.key_averages()
        seen["h2d"] += sum(e.count for e in ev if e.key.startswith("Memcpy HtoD"))
        seen["launches"] += sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                   "cudaLaunchKernelExC"))
        return out[0]

    model.forward = watched
    try:
        prefix_bench.ttft(llm, prompt, "forward")
    finally:
        del model.forward
    return seen


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="ced-bench")
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="profile_prefill")
    args = ap.parse_args()
    args.device, args.threads, args.kv_gb = "cuda", None, None
    args.max_len = args.prefix + args.suffix + 64
    report = io.StringIO()

    def say(*a):
        print(*a, flush=True)
        print(*a, file=report)

    with tempfile.TemporaryDirectory() as d:
        path, cfg = prefix_bench.model_dir(args.shape, Path(d), args.max_len)
        llm = prefix_bench.build(path, cfg, args, host_cache_gb=8.0)
        vocab = min(cfg["vocab_size"], 32000)
        rng = random.Random(0)
        prefix = gpu_bench.random_ids(rng, vocab, args.prefix)
        sfx = lambda: gpu_bench.random_ids(rng, vocab, args.suffix)  # noqa: E731
        for i in range(3):  # cold, then hits: kernels compiled for every shape the measured hits use
            prefix_bench.ttft(llm, prefix + sfx(), f"warm{i}")
        walls = [prefix_bench.ttft(llm, prefix + sfx(), f"hit{i}") for i in range(3)]
        say(f"hit TTFT ms: {[round(w * 1e3, 1) for w in walls]}")
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            prefix_bench.ttft(llm, prefix + sfx(), "prof")
        ev = prof.key_averages()
        launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        syncs = {e.key: e.count for e in ev if any(e.key.startswith(s.strip()) for s in SYNCS)}
        h2d = sum(e.count for e in ev if e.key.startswith("Memcpy HtoD"))
        say(f"kernel launches {launches}; synchronising calls {syncs} (the whole request: ttft's own "
            f"synchronize, the sampled token's read); host-to-device copies {h2d}")
        fwd = forward_only(llm, prefix + sfx())
        say(f"inside the model's forward: synchronising calls {fwd['syncs']}, host-to-device copies {fwd['h2d']}, "
            f"kernel launches {fwd['launches']}")
        say(ev.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        say(ev.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        prefix_bench.ttft(llm, prefix + sfx(), "cprof")
        pr.disable()
        say(f"cProfile run {1e3 * (time.perf_counter() - t0):.1f} ms")
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
        say(s.getvalue())
        row = {"bench": "profile_prefill", "shape": args.shape, "prefix": args.prefix, "suffix": args.suffix,
               "hit_ms": [round(w * 1e3, 2) for w in walls], "kernel_launches": launches, "syncs": syncs,
               "h2d_copies": h2d, "forward": fwd}
    Path(args.out + ".txt").write_text(report.getvalue())
    Path(args.out + ".jsonl").write_text(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
