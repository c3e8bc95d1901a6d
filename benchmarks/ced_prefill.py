"""CED prefill: bounded replay vs exact mode, and KV bytes per token vs a Llama-3.1-8B shape.

Bounded mode runs the decoder over the last n_win prompt tokens only, so at long prompts prefill
should approach (all layers) / (encoder layers) = about 2x faster for equal halves. Both modes run
in this one process on the same random-weight checkpoint; rows go to JSONL and a table is printed.

    python benchmarks/ced_prefill.py --size small --lengths 512 1024 2048 4096 8192 --out ced_prefill.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch


def write_checkpoint(out: Path, size: str, seed: int) -> dict:
    from safetensors.torch import save_file

    from deepinfer.models.ced.config import SIZES, CEDConfig
    from deepinfer.models.ced.model import CEDForCausalLM
    from deepinfer.testing.tokenizers import build_test_tokenizer

    tok = build_test_tokenizer(out, vocab_size=512)
    cfg = CEDConfig(**{**SIZES[size], "vocab_size": tok.vocab_size, "max_position_embeddings": 65536})
    model = CEDForCausalLM(cfg.to_hf())
    model.init_weights(seed)
    (out / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_file(model.hf_state_dict(), str(out / "model.safetensors"))
    return cfg.to_hf()


def llama8b_bytes_per_token(dtype_bytes: int = 2) -> int:
    layers, kv_heads, head_dim = 32, 8, 128  # Llama-3.1-8B
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["toy", "small", "bench"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="ced_prefill.jsonl")
    args = ap.parse_args(argv)

    from deepinfer import LLM, SamplingParams
    from deepinfer.models.ced.cache import CEDCache
    from deepinfer.models.ced.config import SIZES, CEDConfig

    rows = []
    with tempfile.TemporaryDirectory() as d:
        hf = write_checkpoint(Path(d), args.size, args.seed)
        budget = max(args.lengths)
        llms = {mode: LLM(d, hf_overrides={"replay_mode": mode}, max_num_batched_tokens=budget, max_num_seqs=4,
                          max_model_len=budget + 8, block_size=16) for mode in ("bounded", "exact")}
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        g = torch.Generator().manual_seed(args.seed)
        for n in args.lengths:
            prompt = torch.randint(5, 500, (n,), generator=g).tolist()
            for mode in ("bounded", "exact", "bounded", "exact")[: 2 * max(1, args.repeats)]:
                llm = llms[mode]
                llm.engine.model.reset_counters()
                t0 = time.perf_counter()
                llm.generate([prompt], sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                c = llm.engine.model.counters
                rows.append({"bench": "ced_prefill", "size": args.size, "mode": mode, "prompt_len": n,
                             "seconds": dt, "tokens_per_s": n / dt,
                             "decoder_tokens": c["layer_tokens"][-1], "encoder_tokens": c["layer_tokens"][0],
                             "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
                             "machine": platform.machine(), "seed": args.seed})
    # Keep the best of the repeats per (mode, length).
    best = {}
    for r in rows:
        k = (r["mode"], r["prompt_len"])
        if k not in best or r["seconds"] < best[k]["seconds"]:
            best[k] = r
    cfg = CEDConfig(**SIZES[args.size])
    enc, L = cfg.num_encoder_layers, cfg.num_layers
    bench_cfg = CEDConfig(**SIZES["bench"])
    kv = {"bench": "ced_kv_bytes", "ced_bench_bytes_per_token": CEDCache.exact_bytes_per_token(bench_cfg),
          "ced_bench_ring_bytes_per_seq": CEDCache.ring_bytes_per_seq(bench_cfg),
          "llama8b_bf16_bytes_per_token": llama8b_bytes_per_token()}
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.write(json.dumps(kv) + "\n")
    print(f"CED {args.size}: {enc} encoder + {L - enc} decoder layers, n_win={cfg.n_win}; "
          f"predicted bounded/exact speedup at long prompts ~ {L / enc:.2f}x")
    print(f"{'prompt':>7} {'exact s':>9} {'bounded s':>10} {'speedup':>8}")
    for n in args.lengths:
        e, b = best[("exact", n)]["seconds"], best[("bounded", n)]["seconds"]
        print(f"{n:>7} {e:>9.3f} {b:>10.3f} {e / b:>7.2f}x")
    print(f"KV bytes/token: CED bench {kv['ced_bench_bytes_per_token']:.1f} (+ {kv['ced_bench_ring_bytes_per_seq']} "
          f"ring bytes per sequence) vs Llama-3.1-8B bf16 {kv['llama8b_bf16_bytes_per_token']} "
          f"({kv['llama8b_bf16_bytes_per_token'] / kv['ced_bench_bytes_per_token']:.0f}x smaller)")


if __name__ == "__main__":
    main()
