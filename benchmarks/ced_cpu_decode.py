"""The bundled demo model (a toy CED) decoding on the CPU: steady decode tokens/s at batch 1 and 16.

    python benchmarks/ced_cpu_decode.py --threads 1 --out docs/results/cpu_issue12_ced_decode.jsonl
    PYTHONPATH=/path/to/other/tree python benchmarks/ced_cpu_decode.py --threads 1 --label before ...

Each measurement submits B prompts of ``--input-len`` random token ids at once (greedy, EOS ignored,
``--output-len`` tokens each) and times the steady decode with gpu_bench's measure_decode: the tokens generated
after every sequence has its first token, over the time from that moment to the last token. The batch sizes take
turns (1, 16, 1, 16, ...) for ``--repeats`` rounds, so each sees the same machine; a row per batch reports the
median and the best round, and the median tokens per second of this process's CPU time (``decode_tok_per_cpu_s``,
one torch thread by default). On a shared machine both swing with the other load (on the 2-core VM, one tree's
rounds spread over +-30%): compare trees by many interleaved runs, not one. The deepinfer that runs is whichever
``import deepinfer`` finds, so PYTHONPATH can point at another checkout (a before/after pair); each row records its
path and git commit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # gpu_bench, beside this file
sys.path.append(str(HERE.parent))  # this checkout's deepinfer, last: PYTHONPATH or an installed one comes first

import gpu_bench  # noqa: E402

from deepinfer.bench import append_jsonl, format_table, machine_info  # noqa: E402

COLUMNS = (("label", "label", "{}"), ("commit", lambda r: (r.get("git_commit") or "?")[:12], None),
           ("batch", "batch", "{}"), ("in/out", None, None), ("threads", "torch_threads", "{}"),
           ("decode tok/s (median)", "decode_tok_s", "{:.1f}"), ("best", "decode_tok_s_best", "{:.1f}"),
           ("tok per CPU s", "decode_tok_per_cpu_s", "{:.1f}"),
           ("ms/step", "step_ms", "{:.1f}"), ("rounds", "rounds", "{}"))


def measure(llm, batches, input_len: int, output_len: int, repeats: int, seed: int) -> dict:
    """{batch: [measure_decode result per round]}, the batches interleaved within each round."""
    vocab = llm.engine.model.vocab_size
    for B in batches:
        gpu_bench.warm(llm, vocab, B=B, in_len=input_len, out_len=3)
    runs = {B: [] for B in batches}
    for rnd in range(repeats):
        for B in batches:
            r = gpu_bench.measure_decode(llm, B, input_len, output_len, time.perf_counter() + 600, seed + rnd, vocab)
            if "decode_tok_s" not in r:
                raise RuntimeError(f"batch {B}: no steady decode measured ({r.get('note')})")
            runs[B].append(r)
    return runs


def rows_of(runs: dict, label: str, extra: dict) -> list:
    out = []
    for B, rs in runs.items():
        rates = [r["decode_tok_s"] for r in rs]
        mid = sorted(rs, key=lambda r: r["decode_tok_s"])[len(rs) // 2]  # the median round (upper for even)
        out.append({"bench": "benchmarks/ced_cpu_decode.py", "label": label, "batch": B,
                    "input_len": mid["input_len"], "output_len": mid["output_len"], "rounds": len(rs),
                    "decode_tok_s": statistics.median(rates), "decode_tok_s_best": max(rates),
                    "decode_tok_s_all": rates, "per_user_tok_s": statistics.median(r["per_user_tok_s"] for r in rs),
                    "decode_tok_per_cpu_s": statistics.median(r.get("decode_tok_per_cpu_s", 0.0) for r in rs),
                    "decode_tok_per_cpu_s_all": [r.get("decode_tok_per_cpu_s") for r in rs],
                    "step_ms": mid["step_ms"], "ttft_mean_s": mid["ttft_mean_s"], **extra})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the batch sizes")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the shared 2-core VM)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="", help="a name for this tree's rows (before / after)")
    ap.add_argument("--out", default=None, help="JSONL file to append the rows to")
    a = ap.parse_args(argv)
    import deepinfer
    from deepinfer import LLM

    llm = LLM(a.model, device="cpu", threads=a.threads, max_num_seqs=max(a.batches),
              max_model_len=a.input_len + a.output_len + 8)
    runs = measure(llm, a.batches, a.input_len, a.output_len, a.repeats, a.seed)
    extra = {**machine_info(), "deepinfer_path": str(Path(deepinfer.__file__).resolve().parent),
             "model": a.model or "bundled demo", "dtype": str(next(llm.engine.model.parameters()).dtype),
             "backend": llm.backend_name}
    rows = rows_of(runs, a.label, extra)
    if a.out:
        append_jsonl(a.out, rows)
    print(format_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
