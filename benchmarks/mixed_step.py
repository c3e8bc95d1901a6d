"""Step time of a mixed step (B decode rows + one prefill chunk of C tokens, one model call) against a pure
decode step of the same B rows and a prefill of the C tokens alone, in one process.

If the weights were read twice (a model call for the chunk and another for the decode rows), the mixed
step would cost about decode(eager) + prefill(alone); with one call it costs less. Rows: JSONL with every
setting; a short table on stdout.

    python benchmarks/mixed_step.py --model DIR [--batch 64 --chunk 512 --repeats 5 --out rows.jsonl]
    python benchmarks/mixed_step.py --shape llama-3.1-8b --dtype bfloat16   # dummy weights of a real shape (GPU)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.bench import append_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # config.json of real shapes (dummy weights)
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                         tie_word_embeddings=False, torch_dtype="bfloat16"),
}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, repeats: int) -> float:
    """Median seconds of fn over repeats."""
    ts = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(llm, B: int, chunk: int, repeats: int, enforce_eager: bool) -> dict:
    from deepinfer import SamplingParams

    eng, dev = llm.engine, llm.engine.device
    vocab = min(llm.engine.model.vocab_size, 1000)
    g = torch.Generator().manual_seed(0)
    long = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    for i in range(B):
        eng.add_request(f"d{i}", torch.randint(3, vocab, (16,), generator=g).tolist(), long)
    while any(s.num_computed_tokens < s.num_tokens - 1 for r in eng.requests.values() for s in r.seqs):
        eng.step()  # prefill the decode rows
    eng.step()
    t_decode = timed(eng.step, dev, repeats)  # B decode rows (a graph replay when graphs are on)
    rid = [0]

    def mixed():
        rid[0] += 1
        eng.add_request(f"p{rid[0]}", torch.randint(3, vocab, (chunk,), generator=g).tolist(),
                        SamplingParams(max_tokens=1, temperature=0))
        eng.step()

    t_mixed = timed(mixed, dev, repeats)  # B decode rows + the chunk, one model call
    for r in list(eng.requests):
        eng.abort(r)
    while eng.has_unfinished():
        eng.step()

    def alone():
        rid[0] += 1
        eng.add_request(f"a{rid[0]}", torch.randint(3, vocab, (chunk,), generator=g).tolist(),
                        SamplingParams(max_tokens=1, temperature=0))
        eng.step()

    t_prefill = timed(alone, dev, repeats)
    while eng.has_unfinished():
        eng.step()
    return dict(batch=B, chunk=chunk, enforce_eager=enforce_eager, decode_ms=1e3 * t_decode,
                mixed_ms=1e3 * t_mixed, prefill_alone_ms=1e3 * t_prefill,
                mixed_over_sum=t_mixed / (t_decode + t_prefill))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo model, or --shape)")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="dummy weights of a real shape")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from deepinfer import LLM

    model, fmt = args.model, "auto"
    if args.shape:
        d = Path(tempfile.mkdtemp())
        (d / "config.json").write_text(json.dumps(SHAPES[args.shape]))
        from deepinfer.testing.tokenizers import build_test_tokenizer

        build_test_tokenizer(d, vocab_size=512)
        model, fmt = str(d), "dummy"
    rows = []
    for eager in ([False, True] if torch.cuda.is_available() else [True]):
        llm = LLM(model, dtype=args.dtype, load_format=fmt, max_model_len=2048, enforce_eager=eager,
                  overlap_scheduling=False, threads=args.threads, max_num_seqs=max(args.batch) + 4,
                  max_num_batched_tokens=max(args.batch) + args.chunk + 16)
        for B in args.batch:
            r = measure(llm, B, args.chunk, args.repeats, eager)
            r.update(model=args.shape or model or "demo", device=str(llm.engine.device), torch=torch.__version__,
                     threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine(),
                     backend=llm.backend_name)
            rows.append(r)
            print(f"B={B:4d} chunk={args.chunk} eager={eager!s:5}  decode {r['decode_ms']:8.2f} ms  mixed "
                  f"{r['mixed_ms']:8.2f} ms  prefill alone {r['prefill_alone_ms']:8.2f} ms  "
                  f"mixed / (decode + prefill) = {r['mixed_over_sum']:.2f}", flush=True)
        del llm
    if args.out:
        append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
