"""Structured outputs: what the constraint costs a decode step, what compiling costs, what jump-forward saves.

Three measurements, one run, JSONL rows (``--out``) and a table:

1. ``step``: decode step time at each batch size (default 1, 16, 64) with every row constrained by a JSON
   schema (an array of objects that does not complete within the run) and with no constraint, runs
   interleaved (plain, constrained, plain, ...) so both see the same machine; reported as the fastest run's
   mean decode step time of each and their ratio, plus the host time spent inside the constrain stage (catch
   up, fill, apply; on a GPU it overlaps the forward). Greedy, the
   same prompts, EOS ignored by the plain rows (the constrained ones cannot end: their grammar is open).
2. ``compile``: cold compile time (xgrammar's cache off) of the 100 JSON schemas of
   tests/test_structured_schemas.py for the model's tokenizer: p50, p99, max.
3. ``jump``: a schema with many fixed keys (disable_any_whitespace), greedy, with and without jump_forward:
   model steps, sampled tokens, output tokens, wall time.

On the CPU: ``python benchmarks/structured_bench.py --threads 2 --out rows.jsonl`` (the bundled demo model).
On a GPU: ``--llama8b-dummy`` builds the Llama-3.1-8B shape with random weights (load_format="dummy") and the
demo tokenizer, whose grammars are compiled for the model's 128256-entry vocabulary (ids past the tokenizer's
4096 are never allowed), so the mask is filled and applied at that width.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deepinfer import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

OPEN_SCHEMA = {"type": "array", "minItems": 500, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["new", "old", "sale"]}, "maxItems": 2}},
    "required": ["name", "qty", "tags"]}}
KEYS = ["identifier", "display_name", "created_at", "updated_at", "owner_email", "is_active", "priority_level",
        "category_name", "region_code", "retry_count", "last_error", "checksum"]
FIXED_KEYS_SCHEMA = {"type": "object", "properties": {k: {"enum": ["a", "b"]} if i % 2 else
                                                       {"type": "integer", "minimum": 0, "maximum": 9}
                                                       for i, k in enumerate(KEYS)}, "required": KEYS}
LLAMA8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
               vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
               tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
               torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)


class Timed:
    """A stage wrapped to add its host time to a counter (the engine calls stage(state), reads name/writes). No
    device sync: on a GPU this is the host's fill and launch time, which overlaps the forward."""

    def __init__(self, stage, acc: list):
        self._stage, self._acc = stage, acc

    def __getattr__(self, name):
        return getattr(self._stage, name)

    def __call__(self, state):
        t = time.perf_counter()
        try:
            return self._stage(state)
        finally:
            self._acc[0] += time.perf_counter() - t


def sync(llm):
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()


def decode_run(llm, batch: int, steps: int, constrained: bool, skip: int = 2) -> dict:
    """Add `batch` requests and step until done. The decode steps after the first `skip` (the prefill) are timed
    as one stretch, without syncs between steps (overlap scheduling keeps its overlap): time / steps."""
    eng = llm.engine
    so = StructuredOutputsParams(json=OPEN_SCHEMA) if constrained else None
    params = SamplingParams(max_tokens=steps + skip, temperature=0.0, ignore_eos=not constrained,
                            structured_outputs=so)
    acc = [0.0]
    stages = eng.stages["step"]
    k = next(i for i, s in enumerate(stages) if s.name == "grammar")
    stages[k] = Timed(stages[k], acc)
    try:
        for i in range(batch):
            eng.add_request(f"b{batch}-{constrained}-{time.perf_counter_ns()}-{i}", f"items_{i} = ", params)
        for _ in range(skip):
            eng.step()
        sync(llm)
        acc[0], n = 0.0, 0
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            n += 1
        sync(llm)
        elapsed = time.perf_counter() - t
    finally:
        stages[k] = stages[k]._stage
    return {"step_s": elapsed / max(n, 1), "steps": n, "grammar_s_per_step": acc[0] / max(n, 1)}


def bench_steps(llm, batches, steps: int, repeats: int, common: dict) -> list:
    rows = []
    for b in batches:
        decode_run(llm, b, 4, True)  # warm up: compile, first-call costs
        decode_run(llm, b, 4, False)
        got = {True: [], False: []}
        for _ in range(repeats):
            for c in (False, True):
                got[c].append(decode_run(llm, b, steps, c))
        # The fastest of the repeats: on a shared machine other work only ever adds time.
        plain = min(r["step_s"] for r in got[False])
        cons = min(r["step_s"] for r in got[True])
        fill = statistics.median(r["grammar_s_per_step"] for r in got[True])
        rows.append(dict(common, bench="step", batch=b, steps=steps, repeats=repeats, plain_step_ms=plain * 1e3,
                         constrained_step_ms=cons * 1e3, ratio=cons / plain, grammar_stage_ms=fill * 1e3))
    return rows


def load_test_schemas() -> list:
    spec = importlib.util.spec_from_file_location("schemas", REPO / "tests" / "test_structured_schemas.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SCHEMAS


def bench_compile(llm, common: dict) -> list:
    import xgrammar as xgr

    from deepinfer.structured.compiler import tokenizer_info

    info = tokenizer_info(llm.get_tokenizer(), llm.engine.model.vocab_size)
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    rows = []
    for ws in (True, False):
        times = []
        for s in load_test_schemas():
            t = time.perf_counter()
            comp.compile_json_schema(json.dumps(s), any_whitespace=ws)
            times.append(time.perf_counter() - t)
        times.sort()
        q = lambda p: times[min(len(times) - 1, int(p * len(times)))]  # noqa: E731
        rows.append(dict(common, bench="compile", schemas=len(times), any_whitespace=ws, p50_ms=q(0.5) * 1e3,
                         p99_ms=q(0.99) * 1e3, max_ms=times[-1] * 1e3))
    return rows


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def bench_jump(llm, batch: int, common: dict) -> list:
    rows = []
    for jump in (False, True, False, True):
        so = StructuredOutputsParams(json=FIXED_KEYS_SCHEMA, disable_any_whitespace=True, jump_forward=jump)
        p = SamplingParams(max_tokens=400, temperature=0.0, structured_outputs=so)
        steps0 = llm.engine.stats["steps"]
        sync(llm)
        t = time.perf_counter()
        outs = llm.generate([f"record_{i} = " for i in range(batch)], p, use_tqdm=False)
        sync(llm)
        wall = time.perf_counter() - t
        ok = sum(o.outputs[0].finish_reason == "stop" and _is_object(o.outputs[0].text) for o in outs)
        rows.append(dict(common, bench="jump", jump_forward=jump, batch=batch, keys=len(KEYS), valid=ok,
                         steps=llm.engine.stats["steps"] - steps0,
                         output_tokens=sum(len(o.outputs[0].token_ids) for o in outs), wall_s=wall))
    return rows[2:]  # the second pair: warm


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    ap.add_argument("--llama8b-dummy", action="store_true", help="Llama-3.1-8B shape, random weights, demo tokenizer")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=24, help="decode steps per run (default 24)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--jump-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip", nargs="*", default=[], choices=["step", "compile", "jump"])
    ap.add_argument("--out", default=None, help="append JSONL rows here")
    args = ap.parse_args(argv)
    tmp = None
    kw = dict(max_model_len=1024, max_num_seqs=max(args.batches + [args.jump_batch]), threads=args.threads)
    model = args.model
    if args.llama8b_dummy:
        from deepinfer.models.loader import DEMO_DIR

        tmp = Path(tempfile.mkdtemp())
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DEMO_DIR / f, tmp / f)
        (tmp / "config.json").write_text(json.dumps(LLAMA8B))
        model, kw = str(tmp), dict(kw, load_format="dummy", dtype="bfloat16")
    try:
        llm = LLM(model, **kw)
        eng = llm.engine
        common = dict(model=model or "demo", vocab=eng.model.vocab_size, device=str(eng.device),
                      backend=type(eng.ops).__name__, overlap=eng.overlap, threads=torch.get_num_threads(),
                      torch=torch.__version__, xgrammar=importlib.metadata.version("xgrammar"),
                      time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        rows = []
        if "step" not in args.skip:
            rows += bench_steps(llm, args.batches, args.steps, args.repeats, common)
        if "compile" not in args.skip:
            rows += bench_compile(llm, common)
        if "jump" not in args.skip:
            rows += bench_jump(llm, args.jump_batch, common)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"{common['model']} on {common['device']} ({common['backend']}, overlap={common['overlap']}, "
          f"{common['threads']} threads)")
    for r in rows:
        if r["bench"] == "step":
            print(f"  step  batch {r['batch']:>3}: plain {r['plain_step_ms']:8.2f} ms  constrained "
                  f"{r['constrained_step_ms']:8.2f} ms  ratio {r['ratio']:.3f}  (grammar stage "
                  f"{r['grammar_stage_ms']:.2f} ms/step)")
        elif r["bench"] == "compile":
            print(f"  compile {r['schemas']} schemas (any_whitespace={r['any_whitespace']}): p50 {r['p50_ms']:.2f} ms"
                  f"  p99 {r['p99_ms']:.2f} ms  max {r['max_ms']:.2f} ms")
        else:
            print(f"  jump_forward={r['jump_forward']!s:5}: {r['steps']} steps, {r['output_tokens']} output tokens, "
                  f"{r['valid']}/{r['batch']} valid, {r['wall_s']:.2f} s")


if __name__ == "__main__":
    main()
