"""``deepinfer bench serve``: replay a serving workload against any OpenAI-compatible endpoint over HTTP.

The workload is bench_serving.py's (the one ``deepinfer bench --request-rate`` runs in-process): arrivals from
``arrival_times`` (Poisson, or gamma-bursty), lengths from ``draw_lengths`` or a JSONL file, prompts of random
token ids from ``bench.random_prompts`` with the same seed, so ``deepinfer bench`` (the offline engine) and
``deepinfer bench serve`` (the server) run the same requests and their rows compare directly.

Each request streams (``stream_options.include_usage``) with ``ignore_eos`` and ``max_tokens`` = its output
length, greedy unless --temperature says otherwise. A token's time is when the SSE chunk that carried it
arrived; the chunk count gives the ITL samples (one per chunk, as vLLM's benchmark takes them) and the usage
block the token count. TTFT and E2E count from the scheduled arrival, so time a request waits for a
--max-concurrency slot counts, as it would for a client. Metrics are bench_serving.summarize's (p50/p90/p95/p99)
plus errors and, with --gpu-hour-cost C ($/GPU-hour), the cost of a million output tokens:
C x 10^6 / (output tokens/s x 3600).

Prompts go as token ids (/v1/completions accepts them; vLLM and SGLang do too) unless --prompt-format text,
which sends their decoded text (for servers that take text only; its token count is then the server's).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Optional

from ..bench_serving import Timeline, arrival_times, draw_lengths, format_tables, summarize


def read_dataset(path: str, num: Optional[int]) -> tuple:
    """(prompts, output lengths) from JSONL rows {"prompt": text or token ids, "output_len": n}."""
    prompts, outs = [], []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            p, n = row["prompt"], int(row["output_len"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--dataset {path}: line {i + 1} is not {{\"prompt\": ..., \"output_len\": N}} "
                             f"({exc})") from None
        if n < 1 or not (isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p))):
            raise ValueError(f"--dataset {path}: line {i + 1}: prompt must be text or token ids, output_len >= 1")
        prompts.append(p)
        outs.append(n)
    if not prompts:
        raise ValueError(f"--dataset {path} holds no rows")
    if num is not None:
        prompts = [prompts[i % len(prompts)] for i in range(num)]
        outs = [outs[i % len(outs)] for i in range(num)]
    return prompts, outs


def cost_per_million(gpu_hour_cost: Optional[float], output_tok_s: Optional[float]) -> Optional[float]:
    """Dollars per million output tokens at this throughput: cost x 10^6 / (tok/s x 3600)."""
    if gpu_hour_cost is None or not output_tok_s:
        return None
    return gpu_hour_cost * 1e6 / (output_tok_s * 3600.0)


async def _one(client, url: str, body: dict, line: Timeline, start: float, headers: dict, sem) -> None:
    await asyncio.sleep(max(0.0, line.arrival - (time.perf_counter() - start)))
    chunks: list = []
    usage = None
    try:
        async with sem:
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    line.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                    return
                async for raw in resp.aiter_lines():
                    if not raw.startswith("data: ") or raw == "data: [DONE]":
                        continue
                    data = json.loads(raw[6:])
                    if data.get("error"):
                        line.error = str(data["error"])
                        return
                    if data.get("usage"):
                        usage = data["usage"]
                    for ch in data.get("choices") or ():
                        # A token event, even when its text is empty (an incomplete UTF-8 sequence held back, a
                        # token that decodes to nothing): counting only non-empty text drops whole requests.
                        if ch.get("finish_reason") is None or ch.get("text") or (ch.get("delta") or {}).get("content"):
                            chunks.append(time.perf_counter() - start)
    except Exception as exc:  # a refused connection, a reset: this request failed, the run goes on
        line.error = f"{type(exc).__name__}: {exc}"
        return
    n = usage["completion_tokens"] if usage else len(chunks)
    if chunks and n:
        line.token_times = (chunks + [chunks[-1]] * n)[:n]  # one time per token; a chunk's extra tokens share it


async def replay(base_url: str, model: str, prompts: list, out_lens: list, arrivals: list, *, endpoint: str,
                 api_key: Optional[str], max_concurrency: Optional[int], sampling: dict, timeout: float = 600.0
                 ) -> tuple:
    import httpx

    url = base_url.rstrip("/") + ("/completions" if endpoint == "completions" else "/chat/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    lines = [Timeline(a, len(p) if isinstance(p, list) else 0, n) for p, n, a in zip(prompts, out_lens, arrivals)]
    sem = asyncio.Semaphore(max_concurrency or len(prompts))
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        bodies = []
        for p, n in zip(prompts, out_lens):
            body = {"model": model, "max_tokens": n, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True, **sampling}
            if endpoint == "completions":
                body["prompt"] = p
            else:
                body["messages"] = [{"role": "user", "content": p if isinstance(p, str) else json.dumps(p)}]
            bodies.append(body)
        await asyncio.gather(*(_one(client, url, b, ln, start, headers, sem) for b, ln in zip(bodies, lines)))
        duration = max((ln.token_times[-1] for ln in lines if ln.token_times), default=time.perf_counter() - start)
    return lines, duration


def served_model(base_url: str, api_key: Optional[str]) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def bench_serve(base_url: str, model: Optional[str] = None, num_prompts: int = 64, request_rate: float = math.inf,
                burstiness: float = 1.0, input_len: int = 64, output_len: int = 32,
                input_len_range: Optional[tuple] = None, output_len_range: Optional[tuple] = None,
                dataset: Optional[str] = None, tokenizer: Optional[str] = None, prompt_format: str = "ids",
                endpoint: str = "completions", seed: int = 0, api_key: Optional[str] = None,
                max_concurrency: Optional[int] = None, gpu_hour_cost: Optional[float] = None,
                temperature: float = 0.0, warmups: int = 1, out: Optional[str] = None, label: Optional[str] = None,
                echo=print) -> dict:
    """Run the workload against ``base_url`` (ending in /v1), print the tables, append a JSONL row; returns it."""
    from ..bench import append_jsonl, format_table, machine_info, random_prompts  # torch: only when it runs
    from ..models.loader import resolve_model_path
    from ..tokenizer import Tokenizer

    model = model or served_model(base_url, api_key)
    arrivals = arrival_times(num_prompts, request_rate, burstiness, seed)
    if dataset:
        prompts, out_lens = read_dataset(dataset, num_prompts)
        input_len_range = None
    else:
        input_len_range = tuple(input_len_range or (input_len, input_len))
        output_len_range = tuple(output_len_range or (output_len, output_len))
        tok = Tokenizer.from_dir(resolve_model_path(tokenizer))
        in_lens = draw_lengths(num_prompts, *input_len_range, seed, "input")
        out_lens = draw_lengths(num_prompts, *output_len_range, seed, "output")
        prompts = random_prompts(tok, num_prompts, in_lens, seed)
        if prompt_format == "text":
            prompts = [tok.decode(p) for p in prompts]
    sampling = {"temperature": temperature}
    kw = dict(endpoint=endpoint, api_key=api_key, max_concurrency=max_concurrency, sampling=sampling)
    for _ in range(warmups):  # first-call costs (the server's lazy imports, allocator growth) not timed
        asyncio.run(replay(base_url, model, prompts[:4], [min(n, 4) for n in out_lens[:4]], [0.0] * min(4, len(prompts)),
                           **kw))
    lines, duration = asyncio.run(replay(base_url, model, prompts, out_lens, arrivals, **kw))
    row = {"bench": "deepinfer bench serve", "engine": label or "server", "base_url": base_url, "model": model,
           "endpoint": endpoint, "num_prompts": num_prompts, "workload": "serving",
           "request_rate": request_rate if math.isfinite(request_rate) else "inf", "burstiness": burstiness,
           "input_len_range": list(input_len_range) if input_len_range else None,
           "output_len_range": list(output_len_range) if not dataset else None,
           "dataset": str(Path(dataset).resolve()) if dataset else None, "prompt_format": prompt_format,
           "seed": seed, "max_concurrency": max_concurrency, "sampling": {**sampling, "ignore_eos": True},
           "warmups": warmups, **summarize(lines, duration)}
    row["errors"] = row["failed"]
    row["gpu_hour_cost"] = gpu_hour_cost
    row["cost_per_million_output_tokens"] = cost_per_million(gpu_hour_cost, row["output_tok_s"])
    row.update(machine_info())
    if out:
        append_jsonl(out, [row])
    echo(format_tables(row))
    extra = [("errors", "errors", "{}"), ("first error", lambda r: (r["first_error"] or "-")[:60], None),
             ("$/M out tok", "cost_per_million_output_tokens", "{:.4f}")]
    echo("\n" + format_table([row], extra))
    if out:
        echo(f"wrote 1 row to {out}")
    return row


def add_bench_serve_parser(sub) -> None:
    p = sub.add_parser("bench-serve", help="replay a serving workload against an OpenAI-compatible endpoint "
                                           "(also spelled `deepinfer bench serve`)",
                       description="Replay requests against BASE_URL (ours or another engine's) with Poisson or "
                                   "bursty arrivals; report req/s, output tok/s, TTFT, ITL, TPOT and E2E at "
                                   "p50/p90/p95/p99, errors and cost per million output tokens; JSONL rows with "
                                   "--out. The same seed gives `deepinfer bench` (offline) the same requests.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the API root (default %(default)s)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (default; prompts as token ids) or /v1/chat/completions")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (default 64)")
    p.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                   help="requests/s, Poisson arrivals (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, metavar="K",
                   help="gamma shape of the inter-arrival times (1: Poisson; < 1 burstier)")
    p.add_argument("--max-concurrency", type=int, default=None, metavar="N", help="at most N requests in flight")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens, EOS ignored (default 32)")
    p.add_argument("--input-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="prompt lengths uniform on LO..HI")
    p.add_argument("--output-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="output lengths uniform on LO..HI")
    p.add_argument("--dataset", default=None, metavar="FILE",
                   help='JSONL rows {"prompt": text or token ids, "output_len": N} instead of random prompts')
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer of the random prompts (default: the bundled demo model's)")
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="send prompts as token ids (default) or as their decoded text")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrivals (default 0)")
    p.add_argument("--warmups", type=int, default=1, help="short untimed runs first (default 1)")
    p.add_argument("--gpu-hour-cost", type=float, default=None, metavar="USD",
                   help="price of the serving hardware per hour, for $ per million output tokens")
    p.add_argument("--label", default=None, help="the row's engine label (default 'server')")
    p.add_argument("--out", default=None, metavar="FILE", help="JSONL file to append the row to")
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> int:
    from ..cli import UsageError

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UsageError(f"--max-concurrency={args.max_concurrency} is invalid: must be >= 1")
    row = bench_serve(args.base_url, args.model, args.num_prompts, args.request_rate, args.burstiness,
                      args.input_len, args.output_len, args.input_len_range, args.output_len_range, args.dataset,
                      args.tokenizer, args.prompt_format, args.endpoint, args.seed, args.api_key,
                      args.max_concurrency, args.gpu_hour_cost, args.temperature, args.warmups, args.out, args.label)
    return 0 if row["failed"] == 0 else 1
