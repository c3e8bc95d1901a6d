"""What a short CED step costs on the host: ops and Python per step when compute is negligible.

    python benchmarks/ced_host_overhead.py --label before --out docs/results/cpu_ced_host_overhead.jsonl
    TRITON_INTERPRET=1 python benchmarks/ced_host_overhead.py --cuda-path   # launch counts of the CUDA dispatch

The bench config's layer count and modes (SIZES["bench"]: 16 layers, 2 swa, 3 full, 1 reindex) at toy widths
(ced_decode_op_count.TOY), so each op's arithmetic is a few microseconds and the step's time is dispatch and
Python. Two cases, each a row:
- ``hit``: a prompt of ``--prefix`` tokens plus one is served first (the encoder-SWA pool snapshots its state
  at the prefix, a block boundary), then prompts of that prefix plus a fresh ``--chunk``-token suffix: each is
  a prefix-cache hit whose encoder state is restored, computed in one prefill step (engine_path.forward_engine);
- ``decode``: B sequences decoding, one steady step (decode_path.forward_decode) at each ``--batches`` size.
Per case: ``ops`` (aten ops per forward that are not views or allocations, about one kernel launch each on
CUDA; Triton launches counted once each), ``copies`` (host-to-device copies of the CED paths' index lists per
forward, ``to_device`` calls in models/ced), ``forward_ms`` (the model's forward, median of ``--repeats``),
``step_ms`` (the whole engine step: schedule, forward, sample, bookkeeping) and the top Python functions by
cumulative time under cProfile. Default: the reference backend on the CPU, timed. ``--cuda-path`` (with
TRITON_INTERPRET=1): the nvidia backend's CUDA dispatch, interpreted, counted only (its times are the
interpreter's).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))

import torch  # noqa: E402

import ced_decode_op_count as opc  # noqa: E402  (TOY widths, the op counter)
from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.bench import append_jsonl, format_table, machine_info  # noqa: E402
from deepinfer.models.ced import decode_path, engine_path  # noqa: E402
from deepinfer.models.ced.config import SIZES  # noqa: E402
from deepinfer.testing.ced import as_on_cuda, build_ced_checkpoint  # noqa: E402

COLUMNS = (("label", "label", "{}"), ("case", "case", "{}"), ("batch", "batch", "{}"), ("chunk", "chunk", "{}"),
           ("path", "path", "{}"), ("ops/step", "ops", "{}"), ("h2d copies", "copies", "{}"),
           ("forward ms", "forward_ms", "{:.2f}"),
           ("step ms", "step_ms", "{:.2f}"), ("us/op", "us_per_op", "{:.1f}"))


class Probe:
    """Wraps a module's forward function: while ``mode`` is set, each call is timed, op-counted or profiled."""

    def __init__(self, module, name: str, cuda_path: bool):
        self.module, self.name, self.inner, self.cuda_path = module, name, getattr(module, name), cuda_path
        self.mode, self.times, self.counter, self.prof = None, [], None, None

    def __call__(self, *a):
        if self.mode == "count":
            self.counter = opc.OpCounter()
            with self.counter, self.counter.triton_launches() if self.cuda_path else contextlib.nullcontext(), \
                    count_copies() as self.copies:
                return self.inner(*a)
        if self.mode == "profile":
            self.prof.enable()
            try:
                return self.inner(*a)
            finally:
                self.prof.disable()
        t0 = time.perf_counter()
        try:
            return self.inner(*a)
        finally:
            if self.mode == "time":
                self.times.append(time.perf_counter() - t0)

    def __enter__(self):
        setattr(self.module, self.name, self)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.inner)


@contextlib.contextmanager
def count_copies():
    """Host-to-device copies of the CED paths' host lists (``to_device`` in engine_path and the cache, and the
    step's index lists through ``staged_copy``), counted."""
    from deepinfer.models.ced import cache as ced_cache

    seen = [0]
    saved = [(m, n, getattr(m, n)) for m, n in ((engine_path, "to_device"), (engine_path, "staged_copy"),
                                                (ced_cache, "to_device"))]

    def wrap(f):
        def counted(*a, **k):
            seen[0] += 1
            return f(*a, **k)
        return counted

    for m, n, f in saved:
        setattr(m, n, wrap(f))
    try:
        yield seen
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


def measure(probe: Probe, run, repeats: int) -> dict:
    """run() drives the engine through one probed forward (or more: every call counts): ops, times, profile."""
    probe.mode = "count"
    run()
    ops, copies = sum(probe.counter.ops.values()), probe.copies[0]
    top = probe.counter.ops.most_common(12)
    if probe.cuda_path:  # interpreted kernels: their times mean nothing
        return {"ops": ops, "copies": copies, "top_ops": [[f"{w}:{o}", n] for (w, o), n in top]}
    probe.mode, probe.times, steps = "time", [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = run()
        steps.append((time.perf_counter() - t0) / n)
    probe.mode, probe.prof = "profile", cProfile.Profile()
    run()
    s = io.StringIO()
    st = pstats.Stats(probe.prof, stream=s)
    funcs = sorted(((ct, f"{f[0].split('/')[-1]}:{f[1]}({f[2]})", nc) for f, (_, nc, _, ct, _) in st.stats.items()),
                   reverse=True)[:16]
    probe.mode = None
    fwd = statistics.median(probe.times)
    return {"ops": ops, "copies": copies, "forward_ms": 1e3 * fwd, "step_ms": 1e3 * statistics.median(steps),
            "us_per_op": 1e6 * fwd / max(ops, 1), "top_ops": [[f"{w}:{o}", n] for (w, o), n in top],
            "top_functions": [[name, round(1e3 * ct, 3), nc] for ct, name, nc in funcs]}


def hit_case(llm, args, vocab: int) -> dict:
    eng, rng = llm.engine, random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix)]
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prefix + [5]], sp, use_tqdm=False)  # ends at prefix + 1: its state at the prefix is kept
    seen = {"n": 0}

    def run():
        seen["n"] += 1
        rid = f"hit{seen['n']}"
        req = eng.add_request(rid, {"prompt_token_ids": prefix + [rng.randrange(3, vocab) for _ in
                                                                  range(args.chunk)]}, sp)
        steps = 0
        while not req.finished:
            eng.step()
            steps += 1
        hit = max(s.num_cached_tokens for s in req.seqs)
        assert req.error is None and hit == args.prefix, (req.error, hit)
        return steps

    with Probe(engine_path, "forward_engine", args.cuda_path) as probe:
        run()  # warm
        row = measure(probe, run, args.repeats)
    row["restores"] = llm.cache_stats()["swa_restores"]
    return {"case": "hit", "batch": 1, "prefix": args.prefix, "chunk": args.chunk, **row}


def decode_case(llm, B: int, args, vocab: int) -> dict:
    eng, rng = llm.engine, random.Random(B)
    sp = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    rids = [f"d{B}-{i}" for i in range(B)]
    for r in rids:
        eng.add_request(r, {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.decode_len)]}, sp)
    for _ in range(4):  # every sequence past its prefill
        eng.step()

    def run():
        eng.step()
        return 1

    with Probe(decode_path, "forward_decode", args.cuda_path) as probe:
        row = measure(probe, run, args.repeats)
    for r in rids:
        eng.abort(r)
    while eng.has_unfinished():
        eng.step()
    return {"case": "decode", "batch": B, "chunk": 1, **row}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--chunk", type=int, nargs="+", default=[4, 64])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cuda-path", action="store_true", help="the nvidia backend's CUDA dispatch, interpreted")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None, help="append the rows as JSONL")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b = SIZES["bench"]
    ov = dict(opc.TOY, num_layers=b["num_layers"], num_encoder_layers=b["num_encoder_layers"],
              layer_modes=b["layer_modes"], max_position_embeddings=args.prefix + 256)
    rows = []
    with tempfile.TemporaryDirectory() as d, as_on_cuda() if args.cuda_path else contextlib.nullcontext():
        cfg = build_ced_checkpoint(d, seed=0, **ov)
        llm = LLM(d, dtype=args.dtype, device="cpu", block_size=16, num_kv_blocks=args.prefix // 16 * 3 + 64,
                  max_num_seqs=max(args.batches + [1]), host_cache_gb=0.05, max_model_len=args.prefix + 256,
                  backend="nvidia" if args.cuda_path else None)
        for k in args.chunk:
            args.chunk = k
            rows.append(hit_case(llm, args, cfg.vocab_size))
            print("measured", rows[-1]["case"], k, rows[-1]["ops"], flush=True)
        for B in args.batches:
            rows.append(decode_case(llm, B, args, cfg.vocab_size))
            print("measured decode", B, rows[-1]["ops"], flush=True)
    info = machine_info()
    path = "cuda (interpreted)" if args.cuda_path else "cpu"
    for r in rows:
        r.update(bench="benchmarks/ced_host_overhead.py", label=args.label, path=path, dtype=args.dtype,
                 layers=b["num_layers"], widths="ced_decode_op_count.TOY", **info)
    print(format_table(rows, COLUMNS))
    for r in rows:
        print(f"\n{r['case']} B{r['batch']} chunk {r['chunk']}: top ops", r["top_ops"][:8])
        for name, ms, nc in r.get("top_functions", [])[:12]:
            print(f"  {ms:8.3f} ms {nc:6d}  {name}")
    if args.out:
        append_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
