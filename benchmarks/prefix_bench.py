"""Prefix caching: time to first token of a request whose long prefix is cached in each tier, against cold
prefill; an agent-like workload of growing turns with and without caching; the work bounded replay saves
over exact replay on a CED hit. JSONL rows and a table.

    python benchmarks/prefix_bench.py --model llama-3.1-8b --prefixes 8192 32768 --out $OUT/prefix.jsonl  # H200
    python benchmarks/prefix_bench.py --model ced-bench --prefixes 16384 65536 --out $OUT/prefix.jsonl      # H200
    python benchmarks/prefix_bench.py --model demo --prefixes 256 1024 --out prefix_cpu.jsonl               # CPU

Tiers, for one prefix of P tokens followed by a fresh suffix (``--suffix``, 64 tokens), each timed as the
time from submitting the request until its first token (TTFT, the engine stepped until the token is out):
- ``cold``: nothing cached (the engine's cache reset);
- ``device``: the prefix's blocks still in device memory;
- ``host``: evicted to the host pool (``host_cache_gb``) by filling the pool, then found there;
- ``disk``: a fresh engine on the same ``cache_dir`` (a restart, then two unrelated requests sharing a prefix
  of the same length, a miss and a hit, as a restarted server would have served, so the measured hit pays no
  first-request compilation), nothing of the measured prefix in device or host memory; it hits the prefix of
  every round in turn (``--repeats`` + 1 disk reads, the warm-up round's prefix included; with
  ``--profile-dir`` the last one is profiled instead of timed, as is one more device hit).
For CED, ``device`` and ``host`` hit a prefix that an earlier request crossed mid-chunk (bounded replay), and
``device+swa`` / ``host+swa`` one that an earlier request ended at (P + 1 tokens), whose encoder window state
the encoder-SWA pool (core/swa_pool.py) restores. ``fetch_ms``: time spent in the prefix-cache lookup
(finding the blocks and copying them back from a slower tier).
Each tier is measured ``--repeats`` times (median reported). ``speedup`` is cold / tier.

Agent workload (``--turns``): one conversation whose context grows by a random 200-500 tokens per turn plus
the turn's 32 generated tokens; total seconds with caching on and off, each engine warmed up first by an
untimed conversation of its own (the first measurement of a process otherwise pays the kernels' compilation).

CED replay work (CED models): on a device hit, the encoder tokens each replay mode runs (the model's
counters) and the TTFT, for swa_replay mode "bounded" and "exact".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import cProfile
import io
import json
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402  (model shapes and the dummy-weight builder)


def model_dir(name: str, d: Path, max_len: int):
    """(path, hf config or None) of the model to serve: a gpu_bench shape, ced-bench, or the demo model."""
    if name == "demo":
        from deepinfer.models.loader import resolve_model_path

        return str(resolve_model_path(None)), None
    cfg = gpu_bench.ced_config("bench", max_len) if name == "ced-bench" else dict(gpu_bench.SHAPES[name])
    if name != "ced-bench":
        cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), max_len)
    gpu_bench.write_model_dir(d, cfg)
    return str(d), cfg


def build(path, cfg, args, **kw):
    from deepinfer import LLM

    kw.setdefault("max_model_len", args.max_len)
    kw.setdefault("enforce_eager", True)  # TTFT is prefill: no decode graphs to capture at every (re)start
    if cfg is None:
        return LLM(path, device=args.device, threads=args.threads, **kw)
    if args.kv_gb:
        kw.setdefault("kv_cache_memory_gb", args.kv_gb)
    ns = argparse.Namespace(dtype=args.dtype, device=args.device, backend=None, build_in_dtype="always")
    return gpu_bench.build_llm(Path(path), ns, cfg, **kw)[0]


OUT = None  # the JSONL file rows are appended to as they are measured (a run cut short keeps them)


def emit(rows: list, row: dict) -> None:
    rows.append(row)
    if OUT:
        with open(OUT, "a") as f:
            f.write(json.dumps(row) + "\n")
    print("row", json.dumps(row), flush=True)


def timed_lookups(llm) -> list:
    """Wrap the engine's prefix-cache lookup so each call's seconds are appended to the returned list."""
    cache, spent = llm.engine.prefix_cache, []
    inner = cache.lookup

    def lookup(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            spent.append(time.perf_counter() - t0)

    cache.lookup = lookup
    return spent


def ttft(llm, prompt: list, rid: str) -> float:
    from deepinfer import SamplingParams

    eng = llm.engine
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    req = eng.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0))
    while not req.finished:
        eng.step()
    eng.sync()
    dt = time.perf_counter() - t0
    assert req.error is None, req.error
    return dt


@contextlib.contextmanager
def profiled(args, name):
    """cProfile what runs inside into ``--profile-dir``/prefix_NAME.txt (top functions by cumulative time);
    nothing without --profile-dir or with name None."""
    if not args.profile_dir or name is None:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        text = io.StringIO()
        st = pstats.Stats(prof, stream=text).sort_stats("cumulative")
        st.print_stats(45)
        st.print_stats("kv_tiers|kv_offload|prefix_cache|swa_pool|engine.py|scheduler", 40)  # the cache's own part
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.profile_dir) / f"prefix_{name}.txt").write_text(text.getvalue())


def release() -> None:
    """Give a deleted engine's device memory back before the next one is built (its KV cache sits in reference
    cycles: gc first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def evict_device(llm) -> None:
    """Push every free cached block out of device memory (to the host/disk tiers) by filling the pool."""
    pool = llm.engine.pool
    got = pool.allocate(pool.num_free)
    pool.free(got)
    llm.engine.prefix_cache.drain()  # stored in the tiers, the disk's background writes done
    llm.reset_prefix_cache()


def tiers(args, path, cfg, P: int, vocab: int, rows: list) -> None:
    rng = random.Random(P)
    cache_dir = tempfile.mkdtemp(prefix="deepinfer-prefix-bench-")
    kw = dict(host_cache_gb=args.host_gb, cache_dir=cache_dir)
    llm = build(path, cfg, args, **kw)
    swa = llm.engine.swa_pool is not None
    spent = timed_lookups(llm)
    times: dict = {t: [] for t in ("cold", "device", "host") + (("device+swa", "host+swa") if swa else ())}
    fetch: dict = {t: [] for t in times}
    written = []  # every round's prefix, on disk too (write-through): the restarted engine hits each
    for r in range(args.repeats + 1):  # the first round warms up kernels and allocator
        prefix, ended = gpu_bench.random_ids(rng, vocab, P), gpu_bench.random_ids(rng, vocab, P)
        written.append(prefix)
        sfx = lambda: gpu_bench.random_ids(rng, vocab, args.suffix)  # noqa: E731
        got = {"cold": ttft(llm, prefix + sfx(), f"cold{P}-{r}")}
        got["device"] = ttft(llm, prefix + sfx(), f"dev{P}-{r}")
        if swa:
            ttft(llm, ended + sfx()[:1], f"end{P}-{r}")  # ends at P + 1: its state at P is snapshotted
            got["device+swa"] = ttft(llm, ended + sfx(), f"devswa{P}-{r}")
        evict_device(llm)
        for tier, pre in (("host", prefix), ("host+swa", ended)):
            if tier in times:
                del spent[:]
                got[tier] = ttft(llm, pre + sfx(), f"{tier}{P}-{r}")
                fetch[tier].append(sum(spent))
        if r:
            for k, v in got.items():
                times[k].append(v)
    if args.profile_dir:  # one more device hit, profiled and not timed
        with profiled(args, f"{P}_device"):
            ttft(llm, prefix + gpu_bench.random_ids(rng, vocab, args.suffix), f"devprof{P}")
    evict_device(llm)  # the last prefix goes to disk too (write-through)
    del llm, spent
    release()
    fresh = build(path, cfg, args, cache_dir=cache_dir)  # a restart: disk only
    other = gpu_bench.random_ids(rng, vocab, P)  # unrelated traffic first: a miss, then a hit on it, so the
    ttft(fresh, other + gpu_bench.random_ids(rng, vocab, args.suffix), f"warm{P}")  # disk hit compiles nothing
    ttft(fresh, other + gpu_bench.random_ids(rng, vocab, args.suffix), f"warmhit{P}")
    spent = timed_lookups(fresh)
    times["disk"], fetch["disk"] = [], []
    for i, pre in enumerate(written):  # each a disk read: the restarted engine has none of them in memory
        del spent[:]
        if args.profile_dir and i == len(written) - 1:  # the last one profiled, not timed
            with profiled(args, f"{P}_disk"):
                ttft(fresh, pre + gpu_bench.random_ids(rng, vocab, args.suffix), f"diskprof{P}")
            continue
        times["disk"].append(ttft(fresh, pre + gpu_bench.random_ids(rng, vocab, args.suffix), f"disk{P}-{i}"))
        fetch["disk"].append(sum(spent))
    stats = fresh.cache_stats()
    disk_reads = fresh.engine.prefix_cache.mover.store.stats().disk_hits  # runs read: the warm-up requests miss or hit the device
    cold = statistics.median(times["cold"])
    for tier, ts in times.items():
        med = statistics.median(ts)
        extra = {"fetch_ms": round(statistics.median(fetch[tier]) * 1e3, 2)} if fetch.get(tier) else {}
        if tier == "disk":
            extra["disk_tier_hit_blocks"] = stats["tier_hit_blocks"]
            extra["disk_entries_read"] = disk_reads
        emit(rows, {"bench": "prefix_ttft", "model": args.model, "prefix": P, "suffix": args.suffix, "tier": tier,
                     "ttft_s": round(med, 5), "speedup": round(cold / med, 2), "repeats": len(ts),
                     "all_s": [round(t, 5) for t in ts], **extra})
    del fresh, spent
    release()
    shutil.rmtree(cache_dir, ignore_errors=True)


def agent(args, path, cfg, vocab: int, rows: list) -> None:
    from deepinfer import SamplingParams

    for on in (False, True):
        llm = build(path, cfg, args, enable_prefix_caching=on)
        # Warm-up (kernels compiled for every prompt length bucket, the allocator grown): one untimed
        # conversation of a few turns, on its own random tokens.
        warm, wrng = [], random.Random(1)
        for _ in range(3):
            warm += gpu_bench.random_ids(wrng, vocab, 500)
            llm.generate([warm], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
        rng = random.Random(0)
        ctx: list = []
        t0 = time.perf_counter()
        for turn in range(args.turns):
            ctx += gpu_bench.random_ids(rng, vocab, rng.randint(200, 500))
            if len(ctx) + 40 > args.max_len:
                break
            out = llm.generate([ctx], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)[0]
            ctx += out.outputs[0].token_ids
        emit(rows, {"bench": "agent", "model": args.model, "caching": on, "turns": turn + 1,
                     "context": len(ctx), "total_s": round(time.perf_counter() - t0, 3),
                     "hit_rate": round(llm.cache_stats().get("hit_rate", 0.0), 3)})
        del llm
        release()


def replay_work(args, path, cfg, P: int, vocab: int, rows: list) -> None:
    from deepinfer.core.graph import Pipeline

    for mode in ("bounded", "exact"):
        llm = build(path, cfg, args, pipeline=Pipeline.from_recipe("default").with_args("swa_replay", mode=mode))
        model = llm.engine.model
        rng = random.Random(P)
        prefix = gpu_bench.random_ids(rng, vocab, P)
        ttft(llm, prefix + gpu_bench.random_ids(rng, vocab, args.suffix), "warm")
        ts = []
        for r in range(args.repeats):
            model.reset_counters()
            ts.append(ttft(llm, prefix + gpu_bench.random_ids(rng, vocab, args.suffix), f"{mode}{r}"))
        enc = model.counters["layer_tokens"][: model.config.num_encoder_layers]
        emit(rows, {"bench": "replay_work", "model": args.model, "prefix": P, "mode": mode,
                     "encoder_tokens_per_layer": max(enc), "all_layer_tokens": sum(model.counters["layer_tokens"]),
                     "ttft_s": round(statistics.median(ts), 5)})
        del llm
        release()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b", help="a gpu_bench shape, ced-bench, or demo")
    ap.add_argument("--prefixes", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--host-gb", type=float, default=32.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (the demo model on the CPU)")
    ap.add_argument("--kv-gb", type=float, default=None, help="KV cache size (default: the engine's sizing)")
    ap.add_argument("--profile-dir", default=None, help="cProfile the last device hit and the last disk hit here")
    ap.add_argument("--skip", nargs="*", default=[], choices=["tiers", "agent", "replay"])
    ap.add_argument("--out", default="prefix_bench.jsonl")
    args = ap.parse_args()
    global OUT
    OUT = args.out
    # Room for the longest prefix and for the agent's context (it stops growing at max_len).
    args.max_len = max(max(args.prefixes) + args.suffix + 64, args.turns * 532 + 64)
    rows: list = []
    with tempfile.TemporaryDirectory() as d:
        path, cfg = model_dir(args.model, Path(d), args.max_len)
        from deepinfer.models.loader import load_config

        hf = cfg or load_config(Path(path))
        if cfg is None:  # a real checkpoint: its own context length
            args.max_len = min(args.max_len, hf.get("max_position_embeddings", args.max_len))
        vocab = min(hf["vocab_size"], 32000)
        if "tiers" not in args.skip:
            for P in args.prefixes:
                tiers(args, path, cfg, P, vocab, rows)
        if "agent" not in args.skip:
            agent(args, path, cfg, vocab, rows)
        if hf.get("architectures", [""])[0] == "CEDForCausalLM" and "replay" not in args.skip:
            replay_work(args, path, cfg, args.prefixes[0], vocab, rows)
    print(f"\n{'bench':12} {'what':34} {'value':>12}  note")
    for r in rows:
        if r["bench"] == "prefix_ttft":
            what = f"{r['prefix']} tokens cached, {r['tier']}"
            fetch = f", fetch {r['fetch_ms']} ms" if "fetch_ms" in r else ""
            print(f"{'prefix_ttft':12} {what:34} {r['ttft_s'] * 1e3:10.1f}ms  {r['speedup']}x vs cold{fetch}")
        elif r["bench"] == "agent":
            what = "caching " + ("on" if r["caching"] else "off")
            print(f"{'agent':12} {what:34} {r['total_s']:11.2f}s  {r['turns']} turns, context {r['context']}, "
                  f"hit rate {r['hit_rate']}")
        else:
            what = r["mode"] + " replay on a hit"
            print(f"{'replay_work':12} {what:34} {r['ttft_s'] * 1e3:10.1f}ms  {r['encoder_tokens_per_layer']} "
                  f"encoder tokens per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
