"""CED prefill: bounded replay vs exact mode, and KV bytes per token vs a Llama-3.1-8B shape.

Bounded mode runs the decoder over the last n_win prompt tokens only, so at long prompts prefill
should approach (all layers) / (encoder layers) = about 2x faster for equal halves. Both modes run
in this one process on the same random-weight checkpoint; rows go to JSONL and a table is printed.

    python benchmarks/ced_prefill.py --size small --lengths 512 1024 2048 4096 8192 --out ced_prefill.jsonl

``--pool-impl mask`` runs decoder reindex layers as the slow twin (every entry scored, then masked by the
pool); rows carry the (query, entry) indexer scores each decoder reindex layer computed.
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
    ap.add_argument("--pool-impl", default="gather", choices=["gather", "mask"],
                    help="decoder reindex layers: score the pool only (gather) or every entry, masked (mask)")
    ap.add_argument("--modes", nargs="+", default=["bounded", "exact"], choices=["bounded", "exact"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from deepinfer import LLM, SamplingParams
    from deepinfer.models.ced.cache import CEDCache
    from deepinfer.models.ced.config import SIZES, CEDConfig

    rows = []
    with tempfile.TemporaryDirectory() as d:
        hf = write_checkpoint(Path(d), args.size, args.seed)
        budget = max(args.lengths)
        llms = {mode: LLM(d, hf_overrides={"replay_mode": mode}, max_num_batched_tokens=budget, max_num_seqs=4,
                          max_model_len=budget + 8, block_size=16) for mode in args.modes}
        for llm in llms.values():
            llm.engine.model.pool_impl = args.pool_impl
        modes = getattr(llms[args.modes[0]].engine.model.config, "layer_modes")
        E = llms[args.modes[0]].engine.model.config.num_encoder_layers
        reindex = [i for i, m in enumerate(modes) if m == "reindex" and i >= E]  # decoder reindex layers
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        g = torch.Generator().manual_seed(args.seed)
        for n in args.lengths:
            prompt = torch.randint(5, 500, (n,), generator=g).tolist()
            for mode in list(args.modes) * max(1, args.repeats):
                llm = llms[mode]
                llm.engine.model.reset_counters()
                t0, c0 = time.perf_counter(), time.process_time()
                llm.generate([prompt], sp, use_tqdm=False)
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                c = llm.engine.model.counters
                rows.append({"bench": "ced_prefill", "size": args.size, "mode": mode, "prompt_len": n,
                             "seconds": dt, "cpu_seconds": cpu, "tokens_per_s": n / dt, "pool_impl": args.pool_impl,
                             "decoder_tokens": c["layer_tokens"][-1], "encoder_tokens": c["layer_tokens"][0],
                             "reindex_index_scores": [c["index_scores"][i] for i in reindex],
                             "index_scores": sum(c["index_scores"]),
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
    print(f"pool_impl={args.pool_impl}; reindex scores: (query, entry) scores per decoder reindex layer")
    print(f"{'prompt':>7} {'mode':>8} {'seconds':>9} {'cpu s':>8} {'reindex scores':>15}")
    for n in args.lengths:
        for mode in args.modes:
            r = best[(mode, n)]
            print(f"{n:>7} {mode:>8} {r['seconds']:>9.3f} {r['cpu_seconds']:>8.3f} "
                  f"{r['reindex_index_scores'][0] if reindex else 0:>15}")
    if len(args.modes) == 2:
        print(f"{'prompt':>7} {'exact/bounded':>14}")
        for n in args.lengths:
            print(f"{n:>7} {best[('exact', n)]['seconds'] / best[('bounded', n)]['seconds']:>13.2f}x")
    print(f"KV bytes/token: CED bench {kv['ced_bench_bytes_per_token']:.1f} (+ {kv['ced_bench_ring_bytes_per_seq']} "
          f"ring bytes per sequence) vs Llama-3.1-8B bf16 {kv['llama8b_bf16_bytes_per_token']} "
          f"({kv['llama8b_bf16_bytes_per_token'] / kv['ced_bench_bytes_per_token']:.0f}x smaller)")


if __name__ == "__main__":
    main()
