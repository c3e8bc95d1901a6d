"""How long the host takes from ``generate()`` to the CED forward for a cold prompt, with the model's layers stubbed
(CPU; what a GPU would wait for before its first kernel of the step).

    python benchmarks/host_before_forward.py --tokens 16384 --repeats 15 --out rows.jsonl

The CED bench config's layer modes (16 layers, 8 encoder; index_topk 512, n_win 128) at the small config's widths
and random weights: the scheduler, the prefix cache's lookup, the engine's inputs, then forward_engine's layout
(Pass objects, compression plans, the step's one copy) all run as they do on a GPU host; the layers return their
input. Each repeat sends a fresh random prompt (a cold prefix lookup) and one step computes it. Rows: ms from
generate() to forward_engine's entry (``to_forward_ms``) and the whole generate (``generate_ms``), and the host ms
a step spends building its passes (``passes_ms``: engine_path.Pass, every pass together) and laying its compression
plans out (``plan_ms``: engine_path._plan_step, since the 37th session after the SWA-only layers are queued),
medians of ``--repeats``; a table prints them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))

import gpu_bench  # noqa: E402
from deepinfer.bench import format_table  # noqa: E402


def build(tokens: int):
    from deepinfer import LLM
    from deepinfer.models.ced.config import SIZES, CEDConfig

    cfg = dict(SIZES["small"])
    b = SIZES["bench"]
    cfg.update(num_layers=b["num_layers"], num_encoder_layers=b["num_encoder_layers"], layer_modes=b["layer_modes"],
               index_topk=b["index_topk"], n_win=b["n_win"], pool_block=b["pool_block"], pool_blocks=b["pool_blocks"],
               max_position_embeddings=2 * tokens)
    d = Path(tempfile.mkdtemp())
    gpu_bench.write_model_dir(d, CEDConfig(**cfg).to_hf())
    return LLM(str(d), device="cpu", max_model_len=2 * tokens, enforce_eager=True, load_format="dummy",
               max_num_batched_tokens=tokens + 16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from deepinfer import SamplingParams
    from deepinfer.models.ced import engine_path

    llm = build(a.tokens)
    entered = []
    real = engine_path.forward_engine

    def timed(model, input_ids, meta, cache):
        entered.append(time.perf_counter())
        return real(model, input_ids, meta, cache)

    engine_path.forward_engine = timed  # (the model looks it up at each call)
    spent = {"passes": 0.0, "plan": 0.0}

    def clocked(key, f):
        def run(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                spent[key] += (time.perf_counter() - t) * 1e3
        return run

    engine_path.Pass.__init__ = clocked("passes", engine_path.Pass.__init__)
    engine_path._plan_step = clocked("plan", engine_path._plan_step)
    engine_path.layer_engine = lambda model, layer, h, *args, pending=None, defer=False: (h, None) if defer else h
    engine_path.decoder_layers = lambda model, h, *args: (h, [])
    rng = random.Random(0)
    to_fwd, total, passes, plan = [], [], [], []
    for _ in range(a.repeats):
        ids = [rng.randrange(100, 1000) for _ in range(a.tokens)]
        entered.clear()
        spent.update(passes=0.0, plan=0.0)
        t0 = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        total.append((time.perf_counter() - t0) * 1e3)
        to_fwd.append((entered[0] - t0) * 1e3)
        passes.append(spent["passes"])
        plan.append(spent["plan"])
    row = dict(bench="host_before_forward", label=a.label, tokens=a.tokens, repeats=a.repeats,
               to_forward_ms=statistics.median(to_fwd), generate_ms=statistics.median(total),
               passes_ms=statistics.median(passes), plan_ms=statistics.median(plan))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    print(format_table([row], [("label", "label", "{}"), ("tokens", "tokens", "{}"),
                               ("to forward ms", "to_forward_ms", "{:.2f}"), ("passes ms", "passes_ms", "{:.2f}"),
                               ("plan ms", "plan_ms", "{:.2f}"), ("generate ms", "generate_ms", "{:.2f}")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
