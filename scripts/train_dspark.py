#!/usr/bin/env python
"""Train a DSpark drafter (models/ced/dspark.py) for the bundled CED demo model (or --target), backbone frozen.

    python scripts/train_dspark.py --out deepinfer/assets/demo/dspark --minutes 4 --device cuda   # the H200
    python scripts/train_dspark.py --out /tmp/dspark-smoke --minutes 0.1 --max-files 30 --device cpu

Data: the demo model's training files (the Python standard library of the running interpreter, as
scripts/train_demo.py collects it, minus the demo's held-out files listed in heldout_files.txt), tokenized
with the demo's tokenizer, cut into sequences of --seq-len tokens. The held-out files are the evaluation set.

Per batch, the frozen target runs once (exact replay: every position through the decoder) and gives, at
every position, the hidden states after its last ``target_layers`` layers and its next-token distribution.
Anchors are drawn at random positions i >= 1: the drafter reads the hidden states at i - 1 (the position
whose logits produced token i) and the embedding of token i, and predicts tokens i + 1 .. i + P.
Losses (CED.md): cross-entropy of q_k = softmax(base_k + markov(token i + k)) (teacher-forced Markov input)
against token i + k + 1, weighted exp(-k / gamma); the confidence head by binary cross-entropy against
1 - TV(q_k, p_k), p_k the target's distribution at position i + k. AdamW, cosine schedule over the time
budget, bf16 autocast on CUDA.

Written: config.json, model.safetensors (bf16), train_log.jsonl, eval.json (held out: per draft position
the top-1 agreement of q_k with the target's argmax and the mean 1 - TV(q_k, p_k), which is the expected
acceptance of a sampled draft at temperature 1), README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_demo  # noqa: E402  (the demo's data collection)


def target_states(target, ids, layers: int):
    """Frozen target over ids [B, N]: (hidden after its last `layers` layers [B, N, layers * d], log p [B, N, V])."""
    from deepinfer.models.ced import train as ced_train

    B, N = ids.shape
    with torch.no_grad():
        h_enc, ctx = ced_train.encode(target, ids)
        kept: list = []
        pos = torch.arange(N, device=ids.device).expand(B, N)
        zero = torch.zeros(B, dtype=torch.long, device=ids.device)
        h = ced_train.decode(target, h_enc, h_enc, pos, zero, torch.arange(B, device=ids.device), ctx,
                             collect=kept)
        return torch.cat(kept[-layers:], dim=-1), target.logits(h).log_softmax(dim=-1)


def anchor_batch(ids, H, logp, P: int, per_seq: int, gen):
    """Random anchors: (context [A, L*d], anchor ids [A], prev ids [A, P], targets [A, P], target log p [A, P, V])."""
    B, N = ids.shape
    i = torch.randint(1, N - P, (B, per_seq), generator=gen).to(ids.device)  # anchor positions
    b = torch.arange(B, device=ids.device)[:, None].expand_as(i)
    k = torch.arange(P, device=ids.device)
    ctx = H[b, i - 1]
    anchor = ids[b, i]
    prev = ids[b[..., None], i[..., None] + k]  # token i + k: the Markov input of position k
    tgt = ids[b[..., None], i[..., None] + k + 1]
    lp = logp[b[..., None], i[..., None] + k]  # the target's distribution of token i + k + 1
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    return flat(ctx), flat(anchor), flat(prev), flat(tgt), flat(lp)


def losses(net, target, batch, gamma: float):
    ctx, anchor, prev, tgt, lp = batch
    base, conf = net(ctx, anchor, target)
    q_logits = base + net.markov(prev)  # [A, P, V]
    logq = q_logits.log_softmax(dim=-1)
    P = base.shape[1]
    w = torch.exp(-torch.arange(P, device=base.device, dtype=torch.float32) / gamma)
    ce = -(logq.gather(-1, tgt[..., None])[..., 0])  # [A, P]
    with torch.no_grad():
        tv = 0.5 * (logq.exp() - lp.exp()).abs().sum(-1)  # [A, P]
        agree = (q_logits.argmax(-1) == lp.argmax(-1)).float()
    bce = F.binary_cross_entropy_with_logits(conf, (1 - tv).clamp(0, 1))
    return (ce * w).sum(-1).mean() / w.sum(), bce, tv, agree


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default=None, help="a scripts/train_demo.py checkpoint (default: the bundled demo); "
                    "its drafter then goes in TARGET/dspark to be found by the engine")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=24, help="anchors per sequence")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--gamma", type=float, default=2.5)
    ap.add_argument("--max-files", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    from deepinfer import LLM
    from deepinfer.models.ced.dspark import DSpark, DSparkConfig, save_dspark
    from deepinfer.models.loader import resolve_model_path

    t_start = time.time()
    torch.manual_seed(args.seed)
    demo = Path(args.target) if args.target else Path(resolve_model_path(None))
    for need in ("tokenizer.json", "heldout_files.txt"):  # written by scripts/train_demo.py
        if not (demo / need).is_file():
            raise SystemExit(f"train_dspark: --target {str(demo)!r} has no {need} (a scripts/train_demo.py output)")
    target = LLM(str(demo), device=args.device, dtype="float32", num_kv_blocks=16, enforce_eager=True).engine.model
    target.requires_grad_(False)
    c = target.config
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    held_names = set((demo / "heldout_files.txt").read_text().split())
    import os

    docs, _ = train_demo.collect_files(Path(os.__file__).parent, False, args.max_files, args.seed)
    train_docs = [t for r, t in docs if r not in held_names]
    held_docs = [t for r, t in docs if r in held_names] or [t for _, t in docs[:3]]
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    stream = train_demo.to_stream(tok, train_docs, bos, eos)
    held = train_demo.to_stream(tok, held_docs, bos, eos)[: 64 * (args.seq_len + 1)]
    print(f"train tokens {stream.numel()}, held-out tokens {held.numel()}", flush=True)

    cfg = DSparkConfig(target_hidden=c.hidden_size, vocab_size=c.vocab_size, hidden=args.hidden,
                       num_blocks=args.blocks, num_heads=4, ffn=2 * args.hidden)
    net = DSpark(cfg)
    net.init_weights(args.seed)
    net.to(args.device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60
    N, P = args.seq_len, cfg.positions
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "train_log.jsonl", "w")
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if args.device.startswith("cuda") else torch.autocast(
        "cpu", enabled=False)
    step, t0 = 0, time.time()
    for offs, _ in train_demo.batches(stream, N, args.batch, gen):
        frac = (time.time() - t0) / budget
        if frac >= 1:
            break
        lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        for g in opt.param_groups:
            g["lr"] = lr
        ids = torch.stack([stream[o:o + N + 1] for o in offs.tolist()])[:, :N].to(args.device)
        H, logp = target_states(target, ids, cfg.target_layers)
        with amp:
            ce, bce, tv, agree = losses(net, target, anchor_batch(ids, H, logp, P, args.anchors, gen), args.gamma)
            loss = ce + bce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        if step % 25 == 0:
            row = {"step": step, "t": round(time.time() - t0, 1), "lr": round(lr, 6), "ce": round(ce.item(), 4),
                   "bce": round(bce.item(), 4), "agree_by_pos": [round(x, 3) for x in agree.mean(0).tolist()]}
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(row, flush=True)
        step += 1
    log.close()
    train_seconds = round(time.time() - t0, 1)
    # Held-out evaluation.
    net.eval()
    tvs, agrees = [], []
    egen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for a in range(0, held.numel() - N - 1, N * 8):
            ids = torch.stack([held[o:o + N] for o in range(a, min(a + N * 8, held.numel() - N), N)]).to(args.device)
            H, logp = target_states(target, ids, cfg.target_layers)
            _, _, tv, agree = losses(net, target, anchor_batch(ids, H, logp, P, args.anchors, egen), args.gamma)
            tvs.append(1 - tv)
            agrees.append(agree)
    acc = torch.cat(tvs).mean(0).tolist() if tvs else []
    top1 = torch.cat(agrees).mean(0).tolist() if agrees else []
    nbytes = save_dspark(net, out)
    ev = {"steps": step, "train_seconds": train_seconds, "weights_bytes": nbytes,
          "expected_acceptance_by_position": [round(x, 4) for x in acc],
          "top1_agreement_by_position": [round(x, 4) for x in top1],
          "heldout_tokens": int(held.numel()), "device": args.device,
          "command": "python scripts/train_dspark.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    (out / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")
    (out / "README.md").write_text(
        "# DSpark drafter for the CED demo model\n\n"
        f"Trained by `{ev['command']}` ({step} steps, {ev['train_seconds']} s on {args.device}; backbone frozen). "
        f"{nbytes / 1e6:.2f} MB of bf16 weights (config.json, model.safetensors). On held-out standard-library "
        f"files, per draft position: top-1 agreement with the target {ev['top1_agreement_by_position']}, "
        f"expected acceptance of a sampled draft (1 - TV) {ev['expected_acceptance_by_position']}. "
        "See models/ced/dspark.py and README.md, \"Speculative decoding\".\n")
    print(json.dumps(ev), flush=True)
    print(f"total {time.time() - t_start:.0f} s", flush=True)
    return ev


if __name__ == "__main__":
    main()
