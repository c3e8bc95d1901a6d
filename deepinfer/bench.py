"""The offline throughput workload behind ``deepinfer bench`` (and benchmarks/hf_compare.py); the serving
workload (``--request-rate``, requests arriving over time) is in bench_serving.py.

N prompts of random token ids (or texts from a file), greedy, a fixed number of
output tokens each, all submitted at once. Measured: wall time, output and
total tokens/s, time to first token (from each RequestOutput's metrics), and
per-step engine overhead: (wall time of the run - time inside the model's
forward and compute_logits) / steps. The model time comes from wrapping
``engine.model`` for the duration of the run; the engine is not modified.

Results are JSONL rows that carry every setting needed to reproduce them,
plus a short table for the terminal (plots come from the rows).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from .core.params import SamplingParams


# --- device and ids (shared with benchmarks/gpu_bench.py and bench_sweep.py) ----------------------------------

def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def random_ids(rng: random.Random, vocab: int, n: int) -> list:
    return [rng.randrange(vocab) for _ in range(n)]


# --- prompts -------------------------------------------------------------------------------------------

def random_prompts(tokenizer, num_prompts: int, input_len, seed: int = 0) -> list:
    """num_prompts lists of token ids drawn uniformly from the non-special vocabulary; input_len is one length
    for all, or a list of num_prompts lengths."""
    lens = [input_len] * num_prompts if isinstance(input_len, int) else list(input_len)
    if num_prompts < 1 or len(lens) != num_prompts or min(lens) < 1:
        raise ValueError(f"bench needs num_prompts >= 1 and input lengths >= 1, got {num_prompts} and {input_len}")
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(tokenizer.vocab_size) if i not in special]
    rng = random.Random(seed)
    return [rng.choices(pool, k=n) for n in lens]


def read_prompts_file(path: str | os.PathLike, num_prompts: Optional[int] = None) -> list:
    """One prompt text per non-empty line; with num_prompts, cycle or cut the list to that many."""
    lines = [ln.rstrip("\n") for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    texts = [ln for ln in lines if ln.strip()]
    if not texts:
        raise ValueError(f"--prompts-file {str(path)!r} holds no non-empty line")
    if num_prompts is not None:
        texts = [texts[i % len(texts)] for i in range(num_prompts)]
    return texts


def as_token_ids(tokenizer, prompts: Sequence) -> list:
    """Texts -> token id lists (token id lists pass through), so every engine gets the same ids."""
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


# --- timing the model inside the engine ------------------------------------------------------------------

class ModelTimer:
    """Wraps a model's forward and compute_logits (instance attributes, removed on exit) to add up their time."""

    def __init__(self, model, device=None, methods: Sequence[str] = ("forward", "compute_logits")):
        self.model = model
        self.sync = torch.device(device).type == "cuda" if device is not None else False
        self.methods = [m for m in methods if callable(getattr(model, m, None))]
        self.seconds = 0.0
        self.calls = 0

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            if self.sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync:
                    torch.cuda.synchronize()
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed

    def __enter__(self) -> "ModelTimer":
        for name in self.methods:
            setattr(self.model, name, self._wrap(getattr(self.model, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name in self.methods:
            if name in self.model.__dict__:
                delattr(self.model, name)


# --- the run ----------------------------------------------------------------------------------------------

def bench_params(output_len: int, ban_eos: bool = False, sampling: Optional[dict] = None) -> SamplingParams:
    """Greedy (or ``sampling``'s SamplingParams fields, e.g. temperature), exactly output_len tokens. ban_eos=True
    masks EOS like HF's min_new_tokens instead of sampling through it (ignore_eos); hf_compare uses it so both
    engines choose among the same tokens."""
    kw = {"temperature": 0.0, **(sampling or {})}
    if ban_eos:
        return SamplingParams(max_tokens=output_len, min_tokens=output_len, **kw)
    return SamplingParams(max_tokens=output_len, ignore_eos=True, **kw)


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between order statistics (numpy's default); xs must not be empty."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run(llm, prompts: Sequence, output_len: int, ban_eos: bool = False, sampling: Optional[dict] = None) -> dict:
    """Generate for every prompt (token id lists or texts) at once; return the measurements and outputs.

    The returned dict's ``token_ids`` holds each prompt's output ids (not for the JSONL row).
    """
    engine = llm.engine
    params = bench_params(output_len, ban_eos, sampling)
    reqs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
    steps0, step_time0 = engine.stats["steps"], engine.stats["step_time"]
    with ModelTimer(engine.model, engine.device) as timer:
        t0 = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"bench: {len(failed)} request(s) failed, first: {failed[0]}")
    steps = engine.stats["steps"] - steps0
    step_time = engine.stats["step_time"] - step_time0
    in_tok = sum(len(o.prompt_token_ids) for o in outs)
    out_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    per_step = lambda s: 1000.0 * s / steps if steps else float("nan")  # noqa: E731
    return {
        "wall_s": wall,
        "steps": steps,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "output_tok_s": out_tok / wall,
        "total_tok_s": (in_tok + out_tok) / wall,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_max_s": max(ttft),
        "step_ms": per_step(step_time),  # inside Engine.step's timed part (stages + fold)
        "model_ms_per_step": per_step(timer.seconds),  # model forward + compute_logits
        "overhead_ms_per_step": per_step(wall - timer.seconds),  # everything else, scheduling included
        "stage_overhead_ms_per_step": per_step(step_time - timer.seconds),  # the stages and fold, minus the model
        "preemptions": sum(o.metrics.get("num_preemptions", 0) for o in outs),
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def warmup(llm, prompts: Sequence, output_len: int = 4) -> None:
    """A short run so first-call costs (allocator, kernels, lazy imports) are not timed."""
    llm.generate([{"prompt_token_ids": list(p)} if not isinstance(p, str) else p for p in prompts[:4]],
                 bench_params(min(output_len, 4)), use_tqdm=False)


# --- provenance -------------------------------------------------------------------------------------------

def git_commit(path: str | os.PathLike | None = None) -> Optional[str]:
    """HEAD of the repository holding ``path`` (default: this package), with '-dirty' if it has changes."""
    cwd = str(path or Path(__file__).resolve().parent)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """Where a number was measured: library versions, threads, CPU/GPU."""
    info = {
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git_commit": git_commit(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    from . import __version__

    info["deepinfer_version"] = __version__
    return info


def engine_settings(llm) -> dict:
    """The engine's side of a row: checkpoint, backend, device, dtype, batch and cache settings."""
    eng, cfg = llm.engine, llm.config
    archs = llm.hf_config.get("architectures") or [None]
    return {
        "model": str(Path(llm.model_path).resolve()),
        "arch": archs[0],
        "backend": llm.backend_name,
        "device": str(eng.device),
        "dtype": str(next(eng.model.parameters()).dtype).removeprefix("torch."),
        "recipe": llm.pipeline.recipe,
        "stages": llm.pipeline.stage_names("step"),
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "block_size": cfg.block_size,
        "num_kv_blocks": eng.pool.num_blocks,
        "max_model_len": eng.max_model_len,
    }


# --- output -----------------------------------------------------------------------------------------------

def append_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=False, default=str) + "\n")


TABLE_COLUMNS = (
    ("engine", "engine", "{}"),
    ("prompts", "num_prompts", "{}"),
    ("in/out", None, None),
    ("threads", "torch_threads", "{}"),
    ("wall s", "wall_s", "{:.2f}"),
    ("out tok/s", "output_tok_s", "{:.1f}"),
    ("total tok/s", "total_tok_s", "{:.1f}"),
    ("TTFT mean ms", "ttft_mean_s", "ms"),
    ("TTFT p50 ms", "ttft_p50_s", "ms"),
    ("steps", "steps", "{}"),
    ("model ms/step", "model_ms_per_step", "{:.2f}"),
    ("overhead ms/step", "overhead_ms_per_step", "{:.2f}"),
)


def _cell(row: dict, key, fmt) -> str:
    if callable(key):
        return key(row)
    if key is None:  # in/out lengths; prompts from a file have no fixed input length: show the mean
        inp = row.get("input_len")
        if inp is None and row.get("input_tokens") and row.get("num_prompts"):
            inp = f"~{row['input_tokens'] / row['num_prompts']:.0f}"
        return f"{inp if inp is not None else '?'}/{row.get('output_len', '?')}"
    v = row.get(key)
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if fmt == "ms":
        return f"{1000.0 * v:.1f}"
    return fmt.format(v)


def format_table(rows: Sequence[dict], columns=TABLE_COLUMNS) -> str:
    """A plain aligned table (also valid Markdown) of bench rows."""
    head = [c[0] for c in columns]
    body = [[_cell(r, key, fmt) for _, key, fmt in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(head), sep] + [line(b) for b in body])


# --- the whole command -------------------------------------------------------------------------------------

def bench(model: Optional[str] = None, num_prompts: int = 32, input_len: int = 64, output_len: int = 64,
          prompts_file: Optional[str] = None, seed: int = 0, recipe: str = "throughput",
          max_num_seqs: Optional[int] = None, max_num_batched_tokens: Optional[int] = None,
          dtype: Optional[str] = None, max_model_len: Optional[int] = None, warmups: int = 1,
          out: Optional[str] = None, threads: Optional[int] = None, request_rate: Optional[float] = None,
          burstiness: float = 1.0, input_len_range: Optional[Sequence[int]] = None,
          output_len_range: Optional[Sequence[int]] = None, sampling: Optional[dict] = None, echo=print) -> dict:
    """Load, warm up, run once, write a JSONL row (only when ``out`` is given) and print the table; returns
    the row. ``threads``: torch CPU threads (``LLM(threads=)``). ``sampling``: SamplingParams fields over greedy.

    With ``request_rate`` (inf: all at once) or a length range, the serving workload of bench_serving.py:
    requests arrive over time, lengths drawn from the (LO, HI) ranges (default: the fixed lengths)."""
    from . import bench_serving as serving
    from .core.llm import LLM

    if output_len < 1:
        raise ValueError(f"bench output_len={output_len} is invalid: must be >= 1")
    is_serving = request_rate is not None or input_len_range is not None or output_len_range is not None
    if is_serving:
        if prompts_file and input_len_range:
            raise ValueError("--input-len-range does not apply to --prompts-file (its prompts have their lengths)")
        input_len_range = None if prompts_file else tuple(input_len_range or (input_len, input_len))
        output_len_range = tuple(output_len_range or (output_len, output_len))
        request_rate = float("inf") if request_rate is None else request_rate
        arrivals = serving.arrival_times(num_prompts, request_rate, burstiness, seed)
        in_lens = serving.draw_lengths(num_prompts, *input_len_range, seed, "input") if input_len_range else None
        out_lens = serving.draw_lengths(num_prompts, *output_len_range, seed, "output")
    else:
        in_lens, out_lens = input_len, [output_len] * num_prompts
    kwargs = {}
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    texts = read_prompts_file(prompts_file, num_prompts) if prompts_file else None
    if max_model_len is None:
        # Size the KV pool for this workload: the default (max_num_seqs full contexts) allocates far more.
        if texts is not None:
            from .models.loader import resolve_model_path
            from .tokenizer import Tokenizer

            longest = max(len(ids) for ids in as_token_ids(Tokenizer.from_dir(resolve_model_path(model)), texts))
        else:
            longest = max(in_lens) if is_serving else input_len
        max_model_len = longest + max(out_lens)
    llm = LLM(model=model, recipe=recipe, dtype=dtype, max_model_len=max_model_len, threads=threads, **kwargs)
    if texts is not None:
        prompts = as_token_ids(llm.tokenizer, texts)
    else:
        prompts = random_prompts(llm.tokenizer, num_prompts, in_lens, seed)
    for _ in range(warmups):
        warmup(llm, prompts, max(out_lens))
    row = {"bench": "deepinfer bench", "engine": "deepinfer", **engine_settings(llm), "num_prompts": len(prompts)}
    params = {"temperature": 0.0, **(sampling or {}), "ignore_eos": True}
    if is_serving:
        lines, duration, steps = serving.serve(llm.engine, prompts, out_lens, arrivals, sampling)
        row.update({
            "workload": "serving",
            "request_rate": request_rate if math.isfinite(request_rate) else "inf",  # JSON has no inf
            "burstiness": burstiness,
            "input_len_range": list(input_len_range) if input_len_range else None,
            "output_len_range": list(output_len_range),
            "prompts_file": str(Path(prompts_file).resolve()) if prompts_file else None,
            "seed": seed,
            "sampling": params,  # max_tokens: each request's drawn output length
            "warmups": warmups,
            "steps": steps,
            **serving.summarize(lines, duration),
        })
    else:
        res = run(llm, prompts, output_len, sampling=sampling)
        res.pop("token_ids")
        row.update({
            "input_len": input_len if texts is None else None,
            "output_len": output_len,
            "prompts_file": str(Path(prompts_file).resolve()) if prompts_file else None,
            "seed": seed,
            "sampling": {**params, "max_tokens": output_len},
            "warmups": warmups,
            **res,
        })
    row.update(machine_info())
    if out:
        append_jsonl(out, [row])
    echo(serving.format_tables(row) if is_serving else format_table([row]))
    if out:
        echo(f"wrote 1 row to {out}")
    return row
