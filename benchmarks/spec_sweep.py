"""Speculative decoding sweep: steady decode with and without drafts, fixed vs dynamic lengths, over concurrency.

    python benchmarks/spec_sweep.py --out $OUT/spec_sweep.jsonl --commit <sha>        # the H200 run (< 8 min)
    python benchmarks/spec_sweep.py --smoke --out /tmp/spec_sweep.jsonl               # CPU: tiny model, seconds

Targets (``--targets``), each built once per setting and freed before the next:
- ``llama-3.1-8b``: the Llama-3.1-8B shape with random bf16 weights (benchmarks/gpu_bench.py builds it), decode
  memory-bound; settings ``none`` and the n-gram drafter (plugins/deepinfer-ngram) at fixed k (its drafts are
  ragged anyway: a sequence with no match drafts nothing that step).
- ``demo``: the bundled CED demo model with its DSpark drafter: ``none``, ``dspark:K`` (fixed k) and
  ``dspark:K:dynamic`` (CED.md's per-request lengths from the confidences and the step-time curve).
- ``llama-tiny``: the same Llama architecture at a few thousand parameters (``--smoke``).
- ``path``: the CED checkpoint at ``--model`` with its drafter in ``dspark/`` (for a target large enough that
  decode is memory-bound: ``scripts/train_demo.py --size bench`` then ``scripts/train_dspark.py --target``).

Workload, prompt-lookup friendly: each prompt is a random motif repeated to ``--input-len`` tokens; greedy,
ignore_eos. At each concurrency C: C requests at once, stepped until every one has its first token and then
``--warmup-steps`` more (untimed), then ``--steps`` steps timed (with ``--rounds R`` > 1, every setting's engine
stays alive and each is timed in R blocks of ``--steps``, alternating, so machine drift weighs on all alike;
``--fresh-rounds`` starts new requests on new prompts each round, the same for every setting, so each round
compares the settings on the same text). A row gives the measured step rate, the output
tokens actually emitted (accepted drafts plus one target token per row-step: counted, not derived), the draft
accounting of those steps (spec_stats deltas), and ``syncs_per_step``: on CUDA, the synchronizing calls
torch.cuda.set_sync_debug_mode reports over ``--sync-steps`` further steps (benchmarks/profile_decode.py's check;
the collection's event wait is not among them). ``tau_formula`` (1 + k x acceptance) is given only where every
verified row drafted exactly k (fixed length); elsewhere only the measured ``tokens_per_verified_row``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402  (the same shapes and builder)
from deepinfer.bench_sweep import engine_args, load_text, sweep, table  # noqa: E402  (the measurement itself)

DEFAULT_SETTINGS = {"llama-3.1-8b": ["none", "ngram:2", "ngram:4"], "llama-tiny": ["none", "ngram:2"],
                    "demo": ["none", "dspark:4", "dspark:4:dynamic"], "path": ["none", "dspark:4", "dspark:4:dynamic"]}


def build(target: str, spec, args, tmp: Path):
    from deepinfer import LLM

    kw = engine_args(args, spec)
    if target == "demo":
        return LLM(device=args.device, **kw), None
    if target == "path":  # a CED checkpoint with its drafter in dspark/ (scripts/train_demo.py --size bench ...)
        return LLM(args.model, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32", **kw), None
    cfg = gpu_bench.SHAPES[target]
    gpu_bench.write_model_dir(tmp, cfg)
    ns = argparse.Namespace(dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device,
                            backend=None, build_in_dtype="auto")
    return gpu_bench.build_llm(tmp, ns, cfg, **kw)[0], cfg["vocab_size"]


def run(args) -> list:
    rows = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for target in args.targets:
            settings = args.settings or DEFAULT_SETTINGS[target]
            sweep(args, target, settings, lambda spec: build(target, spec, args, Path(tempfile.mkdtemp(dir=d))),
                  rows, t_start)
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", choices=sorted(DEFAULT_SETTINGS), default=None,
                    help="default: llama-3.1-8b demo (--smoke: llama-tiny demo)")
    ap.add_argument("--settings", nargs="+", default=None, help="none | METHOD:K[:dynamic][#LABEL]; default per target")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--motif", type=int, default=24, help="prompts repeat a random motif of this many tokens")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: every setting's engine alive at once, timed in this many alternating blocks of --steps "
                         "(settings compared under the same machine drift; needs memory for all of them)")
    ap.add_argument("--fresh-rounds", action="store_true",
                    help="with --rounds: each round starts new requests on new prompts (the same for every setting), "
                         "warmed up and timed, so a round's ratio compares the settings on the same text (otherwise "
                         "a setting that emitted fewer tokens meets later text, whose drafts stand more or less often)")
    ap.add_argument("--sync-steps", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new measurement starts after this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="spec_sweep.jsonl")
    ap.add_argument("--smoke", action="store_true", help="CPU, llama-tiny and the demo model, a few steps")
    ap.add_argument("--model", default=None, help="the checkpoint of target 'path' (default: the bundled demo)")
    ap.add_argument("--text-prompts", action="store_true",
                    help="prompts from the model's heldout_sample.txt (CED checkpoints) instead of random motifs")
    args = ap.parse_args(argv)
    args.bench = "benchmarks/spec_sweep.py"
    if args.targets and "path" in args.targets and not args.model:
        ap.error("target 'path' needs --model DIR")
    args.text = None
    if args.text_prompts:
        from deepinfer.models.loader import resolve_model_path

        args.text = load_text(args.model or resolve_model_path(None))
    if args.smoke:
        args.device, args.targets = "cpu", args.targets or ["llama-tiny", "demo"]
        args.concurrency, args.input_len, args.motif = [1, 3], 24, 6
        args.steps, args.warmup_steps, args.sync_steps = 4, 2, 0
        DEFAULT_SETTINGS["demo"] = ["none", "dspark:2", "dspark:2:dynamic"]
    args.targets = args.targets or ["llama-3.1-8b", "demo"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(table(rows))
    if rows and not args.smoke:
        ok = [r for r in rows if r["syncs_per_step"] is not None]
        if ok:
            print(f"most synchronizing calls per step: {max(r['syncs_per_step'] for r in ok):.2f}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
