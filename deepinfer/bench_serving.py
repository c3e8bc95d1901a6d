"""The serving workload behind ``deepinfer bench --request-rate R`` (issue 10).

Requests arrive over time instead of all at once: inter-arrival times are gamma-distributed with shape
``burstiness`` and mean 1/rate (burstiness 1: a Poisson process; below 1 burstier, above 1 more regular;
rate inf: all at time 0), as vLLM's benchmark_serving draws them. Prompt and output lengths are drawn
uniformly from inclusive integer ranges. Arrivals and lengths come from ``seed`` alone.

The loop runs the engine in-process (there is no HTTP server): on one wall clock, every request whose
arrival time has passed is added (streamed, so each step reports the requests it changed), then the engine
steps; when it is idle and the next arrival lies ahead, the loop sleeps until then. Each request runs with
ignore_eos and max_tokens = its drawn output length, so it produces exactly that many tokens.

Definitions (seconds, on one clock from the start of the run):

- arrival: the scheduled arrival time. A request that arrives during a step is added when the step ends;
  that wait counts in its TTFT, as it would in a server.
- a token's time: when ``engine.step()`` returned the output that first held it.
- TTFT: first token time - arrival.  E2E: last token time - arrival.
- TPOT: (last token time - first token time) / (output tokens - 1), per request with 2 tokens or more.
- ITL: the gaps between a request's consecutive deliveries (steps that brought it new tokens), pooled over
  requests. As in vLLM's benchmark, which takes one gap per streamed chunk, a step that delivers several
  tokens of a request gives one gap, not one per token (so a request's ITLs average to its TPOT only when
  each step delivers one token, as DeepInfer's steps do today).
- duration: from the start to the end of the last step; the throughputs divide by it.

Percentiles interpolate linearly between order statistics (numpy's default method; bench.percentile).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .bench import bench_params, format_table, percentile

QUANTILES = (50, 90, 95, 99)


# --- the workload ------------------------------------------------------------------------------------------

def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list:
    """num arrival offsets in seconds, the first at 0, then gaps ~ Gamma(shape=burstiness, mean=1/rate)."""
    if not rate > 0:
        raise ValueError(f"request rate {rate} is invalid: must be > 0 (inf: all at once)")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness {burstiness} is invalid: must be > 0 and finite")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(f"{seed}:arrivals")
    scale = 1.0 / (rate * burstiness)  # mean = shape * scale = 1 / rate; variance = 1 / (burstiness rate^2)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


def draw_lengths(num: int, lo: int, hi: int, seed: int = 0, what: str = "lengths") -> list:
    """num integers uniform on lo..hi (inclusive); ``what`` names an independent stream of the seed."""
    if not 1 <= lo <= hi:
        raise ValueError(f"{what} range {lo}..{hi} is invalid: must satisfy 1 <= LO <= HI")
    rng = random.Random(f"{seed}:{what}")
    return [rng.randint(lo, hi) for _ in range(num)]


# --- the loop ----------------------------------------------------------------------------------------------

@dataclass
class Timeline:
    """One request as the client saw it."""
    arrival: float
    prompt_len: int
    output_len: int  # drawn: its max_tokens
    token_times: list = field(default_factory=list)  # one per output token; a step's tokens share its time
    error: Optional[str] = None


def record_output(line: Timeline, out, t: float) -> None:
    """Fold one streamed RequestOutput, returned by a step at time t, into its request's timeline."""
    if out.error:
        line.error = out.error
        return
    new = len(out.outputs[0].token_ids) - len(line.token_times)
    line.token_times.extend([t] * max(new, 0))


def serve(engine, prompts: Sequence, output_lens: Sequence[int], arrivals: Sequence[float],
          sampling: Optional[dict] = None, clock: Callable[[], float] = time.perf_counter,
          sleep: Callable[[float], None] = time.sleep) -> tuple:
    """Run the requests (token id lists) against ``engine`` as they arrive; returns (timelines, duration, steps)."""
    lines = [Timeline(a, len(p), n) for p, n, a in zip(prompts, output_lens, arrivals)]
    by_id: dict = {}
    nxt, steps = 0, 0
    start = clock()
    while nxt < len(lines) or engine.has_unfinished():
        now = clock() - start
        while nxt < len(lines) and arrivals[nxt] <= now:
            rid = f"serve-{nxt}"
            engine.add_request(rid, {"prompt_token_ids": list(prompts[nxt])},
                               bench_params(output_lens[nxt], sampling=sampling), stream=True)
            by_id[rid] = lines[nxt]
            nxt += 1
        if not engine.has_unfinished():
            sleep(arrivals[nxt] - now)  # idle until the next arrival
            continue
        outs = engine.step()
        steps += 1
        t = clock() - start
        for out in outs:
            if out.request_id in by_id:
                record_output(by_id[out.request_id], out, t)
    return lines, clock() - start, steps


# --- the metrics (pure) ------------------------------------------------------------------------------------

def delivery_gaps(token_times: Sequence[float]) -> list:
    """ITL samples of one request: gaps between consecutive distinct token times (one per delivering step)."""
    ts = sorted(set(token_times))
    return [b - a for a, b in zip(ts, ts[1:])]


def tpot(token_times: Sequence[float]) -> Optional[float]:
    """Time per output token after the first; None with fewer than 2 tokens."""
    if len(token_times) < 2:
        return None
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def _stats(name: str, xs: list) -> dict:
    """{name_mean_s, name_p50_s, ...}; None for each when xs is empty."""
    row = {f"{name}_mean_s": statistics.fmean(xs) if xs else None}
    row.update({f"{name}_p{q}_s": percentile(xs, q) if xs else None for q in QUANTILES})
    return row


def summarize(lines: Sequence[Timeline], duration: float) -> dict:
    """Counts, throughputs and latency statistics of a run; failed or tokenless requests count as not completed."""
    done = [ln for ln in lines if ln.error is None and ln.token_times]
    failed = [ln for ln in lines if ln.error is not None]
    in_tok = sum(ln.prompt_len for ln in done)
    out_tok = sum(len(ln.token_times) for ln in done)
    per_s = lambda x: x / duration if duration > 0 else None  # noqa: E731
    row = {
        "completed": len(done),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "duration_s": duration,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "request_throughput": per_s(len(done)),
        "output_tok_s": per_s(out_tok),
        "total_tok_s": per_s(in_tok + out_tok),
    }
    row.update(_stats("ttft", [ln.token_times[0] - ln.arrival for ln in done]))
    row.update(_stats("itl", [g for ln in done for g in delivery_gaps(ln.token_times)]))
    row.update(_stats("tpot", [x for x in map(tpot, (ln.token_times for ln in done)) if x is not None]))
    row.update(_stats("e2e", [ln.token_times[-1] - ln.arrival for ln in done]))
    return row


# --- the report --------------------------------------------------------------------------------------------

def _span(r) -> str:
    return "file" if r is None else f"{r[0]}" if r[0] == r[1] else f"{r[0]}-{r[1]}"


SUMMARY_COLUMNS = (
    ("rate req/s", "request_rate", "{}"),
    ("burstiness", "burstiness", "{}"),
    ("prompts", "num_prompts", "{}"),
    ("in/out", lambda r: f"{_span(r['input_len_range'])}/{_span(r['output_len_range'])}", None),
    ("completed", "completed", "{}"),
    ("duration s", "duration_s", "{:.2f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_tok_s", "{:.1f}"),
    ("total tok/s", "total_tok_s", "{:.1f}"),
)
LATENCY_COLUMNS = (("ms", "metric", "{}"), ("mean", "mean", "ms")) + tuple((f"p{q}", f"p{q}", "ms") for q in QUANTILES)


def format_tables(row: dict) -> str:
    """A summary line and a latency table (TTFT, ITL, TPOT, E2E by mean and percentile)."""
    lat = [{"metric": name.upper(), **{k: row[f"{name}_{k}_s"] for k in ["mean"] + [f"p{q}" for q in QUANTILES]}}
           for name in ("ttft", "itl", "tpot", "e2e")]
    return format_table([row], SUMMARY_COLUMNS) + "\n\n" + format_table(lat, LATENCY_COLUMNS)
