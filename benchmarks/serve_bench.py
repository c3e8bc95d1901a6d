"""The server against the offline engine on one workload, and the server's latency at three request rates.

    python benchmarks/serve_bench.py --model demo --out docs/results/serve_cpu.jsonl            # the CPU table
    python benchmarks/serve_bench.py --model llama-3.1-8b --device cuda --dtype bfloat16 \\
        --num-prompts 512 --concurrency 64 --input-len-range 256 1024 --output-len-range 128 256 \\
        --rates 8 16 32 --out /tmp/out/serve_h200.jsonl                                          # the H200 one

1. offline: the engine in this process (bench_serving.serve, the loop behind ``deepinfer bench --request-rate``),
   every request at once, at most --concurrency running (max_num_seqs);
2. server: this script again as a server process (``--serve-only``: the same LLM, built the same way, behind
   ``deepinfer serve``'s app), driven over HTTP by ``deepinfer bench serve`` with the same requests (same seed)
   at rate inf and --max-concurrency = --concurrency.

Both engines stay loaded and the two runs alternate --repeats times (the idle one blocks, costing nothing; the
order flipped every pair), so a shared machine's drift hits both alike; each pair draws its own prompts (the same
for both phases), so neither meets prompts an earlier run left in its prefix cache; the API's overhead is 1 - median(server tok/s / offline tok/s) over the
pairs. Each row also has the CPU seconds its engine's process spent per output token (/proc: the server process
alone, not the client), a measure that other work on a shared machine disturbs far less than wall time. Then the server alone at each of --rates (Poisson arrivals). On a GPU both processes hold the model:
give the KV pool a fixed size (--kv-gb) so neither profiles the other's memory. Models: ``demo`` (the bundled
checkpoint) or a gpu_bench shape with random weights (``llama-3.1-8b``: d 4096, 32 layers, GQA 32/8, vocab 128256).
Rows (JSONL, one per run, with ``phase``: offline | server) go to --out; a table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(args, model_dir):
    """The LLM both phases serve: the demo checkpoint, or a gpu_bench shape with dummy weights."""
    kw = dict(max_num_seqs=args.concurrency, max_model_len=args.max_model_len, recipe=args.recipe)
    if args.kv_gb:
        kw["kv_cache_memory_gb"] = args.kv_gb
    if args.threads:
        kw["threads"] = args.threads
    if args.model == "demo":
        from deepinfer import LLM

        return LLM(None, device=args.device, dtype=args.dtype, **kw)
    import gpu_bench

    ns = argparse.Namespace(dtype=args.dtype or "bfloat16", device=args.device or "cuda", backend=None,
                            build_in_dtype="auto")
    return gpu_bench.build_llm(Path(model_dir), ns, gpu_bench.SHAPES[args.model], **kw)[0]


def model_dir(args) -> str:
    if args.model == "demo":
        from deepinfer.models.loader import resolve_model_path

        return str(resolve_model_path(None))
    import gpu_bench

    d = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    cfg = dict(gpu_bench.SHAPES[args.model])
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), args.max_model_len)
    gpu_bench.write_model_dir(d, cfg)
    return str(d)


def workload(args, tokenizer):
    from deepinfer.bench import random_prompts
    from deepinfer.bench_serving import arrival_times, draw_lengths

    in_lens = draw_lengths(args.num_prompts, *args.input_len_range, args.seed, "input")
    out_lens = draw_lengths(args.num_prompts, *args.output_len_range, args.seed, "output")
    prompts = random_prompts(tokenizer, args.num_prompts, in_lens, args.seed)
    return prompts, out_lens, arrival_times(args.num_prompts, math.inf, 1.0, args.seed)


def proc_cpu_s(pid: int, children: bool = True) -> float:
    """User + system CPU seconds so far (Linux /proc) of a process, all its threads, and (children) its live
    children (the server's engine process)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if not children:
        return own
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids.update(int(x) for x in (task / "children").read_text().split())
        except OSError:
            pass
    return own + sum(proc_cpu_s(k) for k in kids if Path(f"/proc/{k}").exists())


def offline(args, llm, repeat: int, seed: int) -> dict:
    from deepinfer.bench import engine_settings, machine_info
    from deepinfer.bench_serving import serve, summarize

    prompts, out_lens, arrivals = workload(argparse.Namespace(**{**vars(args), "seed": seed}), llm.tokenizer)
    cpu0 = proc_cpu_s(os.getpid(), children=False)  # not the idle server process, a child of this one
    lines, duration, steps = serve(llm.engine, prompts, out_lens, arrivals)
    cpu = proc_cpu_s(os.getpid(), children=False) - cpu0
    summary = summarize(lines, duration)
    return {"bench": "benchmarks/serve_bench.py", "phase": "offline", "engine": "offline", "repeat": repeat,
            "shape": args.model, **engine_settings(llm), "num_prompts": args.num_prompts, "request_rate": "inf",
            "concurrency": args.concurrency, "input_len_range": args.input_len_range,
            "output_len_range": args.output_len_range, "seed": seed, "steps": steps, **summary,
            "cpu_s": cpu, "cpu_ms_per_output_token": 1000 * cpu / max(summary["output_tokens"], 1), **machine_info()}


def engine_process(args) -> bool:
    from deepinfer.entrypoints.engine_process import wanted

    return wanted(args.engine_process, args.device)


def build_for_child(args_json: dict, model_dir: str):
    """The engine process's factory (AsyncLLM engine_factory): the LLM build() makes, from JSON arguments."""
    return build(argparse.Namespace(**args_json), model_dir)


def serve_only(args) -> None:
    import uvicorn

    from deepinfer.entrypoints import AsyncLLM
    from deepinfer.entrypoints.server import ServerSettings, build_app

    common = dict(stream_interval=args.stream_interval, gil_switch_interval=args.gil_switch_interval or None)
    if engine_process(args):  # the engine process builds the same LLM through build_for_child
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (here, os.environ.get("PYTHONPATH")) if x)
        engine = AsyncLLM(engine_process=True, engine_factory="serve_bench:build_for_child",
                          args_json={k: v for k, v in vars(args).items() if k != "func"}, model_dir=args.model_dir,
                          **common)
    else:
        engine = AsyncLLM(llm=build(args, args.model_dir), **common)
    app = build_app(engine, ServerSettings(model_name=args.model))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False))
    from deepinfer.entrypoints.cli_serve import _announce

    _announce(server, args, args.model)
    server.run()
    engine.shutdown()


def start_server(args, mdir):
    cmd = [sys.executable, __file__, "--serve-only", "--model-dir", mdir] + [a for a in sys.argv[1:]
                                                                            if a != "--serve-only"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log: list = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        m = re.search(r"on (http://[\d.]+:\d+) \(ready\)", "".join(log))
        if m:
            return proc, m.group(1) + "/v1"
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start:\n" + "".join(log[-40:]))


def table(rows: list) -> str:
    from deepinfer.bench import format_table

    cols = (("phase", "phase", "{}"), ("rate", "request_rate", "{}"), ("done", "completed", "{}"),
            ("err", "failed", "{}"), ("req/s", "request_throughput", "{:.2f}"), ("out tok/s", "output_tok_s", "{:.1f}"),
            ("vs offline", "output_tok_s_vs_offline", "{:.3f}"), ("repeat", "repeat", "{}"),
            ("CPU ms/tok", "cpu_ms_per_output_token", "{:.2f}"), ("TTFT p50", "ttft_p50_s", "ms"),
            ("TTFT p95", "ttft_p95_s", "ms"), ("TTFT p99", "ttft_p99_s", "ms"), ("ITL p50", "itl_p50_s", "ms"),
            ("ITL p95", "itl_p95_s", "ms"), ("ITL p99", "itl_p99_s", "ms"), ("E2E p50", "e2e_p50_s", "ms"),
            ("E2E p95", "e2e_p95_s", "ms"), ("E2E p99", "e2e_p99_s", "ms"), ("$/M tok", "cost_per_million_output_tokens",
                                                                             "{:.3f}"))
    return format_table(rows, cols)


def plot(rows: list, path: str) -> None:
    """TTFT, ITL and E2E (p50/p95/p99) of the server's rows at finite rates, against the rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot written: matplotlib is not installed", file=sys.stderr)
        return
    pts = sorted((r for r in rows if r.get("phase") == "server" and r.get("request_rate") != "inf"),
                 key=lambda r: r["request_rate"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, metric in zip(axes, ("ttft", "itl", "e2e")):
        for q in (50, 95, 99):
            ax.plot([r["request_rate"] for r in pts], [1000 * r[f"{metric}_p{q}_s"] for r in pts], marker="o",
                    label=f"p{q}")
        ax.set_title(metric.upper())
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.legend()
    fig.suptitle(f"deepinfer serve, {pts[0]['model'] if pts else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", help="demo, or a gpu_bench shape such as llama-3.1-8b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--recipe", default="default")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16, help="max_num_seqs, and the client's max concurrency")
    ap.add_argument("--input-len-range", type=int, nargs=2, default=[32, 96])
    ap.add_argument("--output-len-range", type=int, nargs=2, default=[16, 48])
    ap.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0, 4.0], help="request rates (req/s); none: skip")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="alternating offline/server pairs at rate inf")
    ap.add_argument("--full-warmup", action="store_true",
                    help="one untimed pass of the whole workload through each engine before the pairs (on a GPU the "
                         "first pass compiles kernels for the workload's shapes, which the other process then finds "
                         "in the on-disk cache: without it the first pair is unfair to whichever runs first)")
    ap.add_argument("--kv-gb", type=float, default=None, help="KV pool size of each engine (GB)")
    ap.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval (default 1)")
    ap.add_argument("--gil-switch-interval", type=float, default=0.0005,
                    help="the server's --gil-switch-interval (seconds; 0 leaves Python's 5 ms)")
    ap.add_argument("--engine-process", choices=("auto", "on", "off"), default="auto",
                    help="the server's --engine-process (auto: on for CUDA)")
    ap.add_argument("--gpu-hour-cost", type=float, default=None)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None, metavar="FILE", help="only print the table of FILE's rows")
    ap.add_argument("--png", default=None, metavar="FILE", help="with --table: plot the server's latency "
                                                                  "percentiles against the request rate (matplotlib)")
    ap.add_argument("--serve-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.max_model_len is None:
        args.max_model_len = args.input_len_range[1] + args.output_len_range[1] + 8
    if args.serve_only:
        serve_only(args)
        return 0
    if args.table:
        rows = [json.loads(x) for x in Path(args.table).read_text().splitlines() if x.strip()]
        print(table(rows))
        if args.png:
            plot(rows, args.png)
        return 0
    from deepinfer.bench import append_jsonl
    from deepinfer.entrypoints.bench_client import bench_serve

    from deepinfer.bench import warmup

    mdir = model_dir(args)
    llm = build(args, mdir)
    warmup(llm, workload(args, llm.tokenizer)[0], 4)
    proc, url = start_server(args, mdir)
    rows, ratios, cpu_ratios = [], [], []
    try:
        common = dict(num_prompts=args.num_prompts, input_len_range=args.input_len_range,
                      output_len_range=args.output_len_range, tokenizer=mdir, seed=args.seed,
                      gpu_hour_cost=args.gpu_hour_cost, echo=lambda *a: None)

        def server_row(rate, repeat=None, seed=args.seed):
            if repeat == 0:  # the warm-up, outside the CPU count
                bench_serve(url, args.model, request_rate=rate, num_prompts=4, output_len_range=(4, 4),
                            **{k: v for k, v in common.items() if k not in ("num_prompts", "output_len_range")})
            cpu0 = proc_cpu_s(proc.pid)
            row = bench_serve(url, args.model, request_rate=rate, label="server", warmups=0,
                              max_concurrency=args.concurrency if math.isinf(rate) else None,
                              **{**common, "seed": seed})
            cpu = proc_cpu_s(proc.pid) - cpu0  # the server process only: the client's CPU is not the API's cost
            return {**row, "stream_interval": args.stream_interval,
                    "gil_switch_interval": args.gil_switch_interval, "engine_process": engine_process(args), "cpu_s": cpu, "cpu_ms_per_output_token": 1000 * cpu / max(row["output_tokens"], 1),
                    "phase": "server", "repeat": repeat, "shape": args.model, "concurrency": args.concurrency,
                    "recipe": args.recipe, "server_max_num_seqs": args.concurrency}

        if args.full_warmup:
            offline(args, llm, -1, args.seed)
            server_row(math.inf, -1)
        for k in range(args.repeats):
            # Pair k: its own prompts (seed + 1 + k), the same for both phases, so no phase meets prompts an
            # earlier run left in its prefix cache; the order flipped every pair, so drift hits both alike.
            seed = args.seed + 1 + k
            if k % 2 == 0:
                off = offline(args, llm, k, seed)
                srv = server_row(math.inf, k, seed)
            else:
                srv = server_row(math.inf, k, seed)
                off = offline(args, llm, k, seed)
            srv["output_tok_s_vs_offline"] = srv["output_tok_s"] / off["output_tok_s"]
            srv["cpu_per_token_vs_offline"] = srv["cpu_ms_per_output_token"] / off["cpu_ms_per_output_token"]
            ratios.append(srv["output_tok_s_vs_offline"])
            cpu_ratios.append(srv["cpu_per_token_vs_offline"])
            rows += [off, srv]
        for rate in args.rates:
            rows.append(server_row(rate))
    finally:
        proc.terminate()
        proc.wait(60)
    ratio = statistics.median(ratios)
    cpu_ratio = statistics.median(cpu_ratios)
    for r in rows:
        r.setdefault("median_server_over_offline", ratio)
        r.setdefault("median_cpu_per_token_server_over_offline", cpu_ratio)
    if args.out:
        append_jsonl(args.out, rows)
    print(table(rows))
    print(f"API overhead at rate inf, concurrency {args.concurrency}: {100 * (1 - ratio):.1f}% of the offline "
          f"output tok/s (median server/offline ratio {ratio:.3f} over {len(ratios)} alternating pairs: "
          f"{', '.join(f'{x:.3f}' for x in ratios)})")
    print(f"CPU time per output token, server process / offline process: median {cpu_ratio:.3f} "
          f"({', '.join(f'{x:.3f}' for x in cpu_ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
