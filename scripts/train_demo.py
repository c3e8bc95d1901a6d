#!/usr/bin/env python
"""Train the CED demo model on the Python standard library, evaluate it, and write a checkpoint.

    python scripts/train_demo.py --out OUT [--minutes 8]                       # one GPU, ~8 minutes
    python scripts/train_demo.py --out /tmp/ced-smoke --minutes 0.3 --seq-len 64 --batch 4 --max-files 50

Data. Every *.py file under the directory of the running interpreter's ``os.__file__`` (the standard
library), recursively, in sorted relative-path order, skipping site-packages / dist-packages /
__pycache__ (third-party code, not the standard library) and files that are not valid UTF-8. Test
directories (test, tests, idle_test) are included by default: they are ordinary Python and more than
double the data; ``--skip-tests`` leaves them out. The held-out files are a fixed ~2%: the files with
the smallest SHA-256 of "<seed>:<relative path>", so a file's fate does not depend on which other files
exist (the same files are held out on every machine that has them). ``--max-files`` keeps a seeded,
hash-ranked subset first (for smoke runs).

Tokenizer. Byte-level BPE (``tokenizers``), vocab 4096, special tokens <|bos|> <|eos|> <|pad|>
<|im_start|> <|im_end|> (ids 0-4), trained on the training files only. Each file becomes
<|bos|> tokens <|eos|>; the files are concatenated into one stream and cut into training sequences
of --seq-len tokens (plus one target), at a fresh random offset each epoch, in a seeded order.

Model and training. The toy CED configuration (CEDConfig defaults) with tied embeddings and MoE expert
width 96, so the bf16 checkpoint stays under 18 MB. Trained with deepinfer.models.ced.train (a batched
twin of forward_full checked against it at start-up): fake-quantized KV with a straight-through
estimator, the decoder bounded-replay cut drawn per sequence (0 with probability 0.25, else uniform in
[0, N - n_win]) and cross-entropy on the positions at or after it, plus 0.1 x the indexer KL. AdamW
(0.9, 0.95), weight decay 0.1 on matrices, grad clip 1.0, bf16 autocast on CUDA. The learning-rate
schedule (3% linear warmup, cosine to 10%) runs on the fraction of the training time budget used
(or of --steps when given). --minutes bounds the whole run: training stops early enough to leave
time for the evaluation (about --eval-frac of the budget, measured before training) and the writing.

Evaluation (eval.json). On the held-out files (truncated, whole lines, when the evaluation budget
cannot cover them all; eval.json says so): the model in nats/token and bits/byte (total nats / ln 2 /
UTF-8 bytes of the held-out text) in two modes scoring the same targets (see
deepinfer.models.ced.train.eval_stream): "exact" (replay start 0) and "bounded" (every token predicted
as the engine predicts the first token after a prompt ending just before it: the decoder sees only the
last n_win tokens). Baselines on the same text: gzip -9 per file, and an interpolated Kneser-Ney
token trigram (discount 0.75) trained on the training stream. The weights evaluated are the saved
bf16 ones, computed in float32. heldout_sample.txt (20-40 KB of held-out files) is scored the same
way, as one document, for a regression test.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import platform
import random
import shlex
import struct
import sys
import time
import zlib
from pathlib import Path

import torch

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [BOS, EOS, PAD, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- data

def _rank(seed: int, tag: str, rel: str) -> str:
    return hashlib.sha256(f"{seed}:{tag}:{rel}".encode()).hexdigest()


def collect_files(root: Path, skip_tests: bool, max_files: int, seed: int):
    """-> ([(relative path, text)], skipped count), sorted by relative path."""
    rels = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in NOT_STDLIB and not (skip_tests and x in TEST_DIRS))
        for f in sorted(files):
            if f.endswith(".py"):
                rels.append(Path(d, f).relative_to(root).as_posix())
    rels.sort()
    if max_files and len(rels) > max_files:
        rels = sorted(sorted(rels, key=lambda r: _rank(seed, "subset", r))[:max_files])
    out, skipped = [], 0
    for r in rels:
        try:
            out.append((r, (root / r).read_bytes().decode("utf-8")))
        except (UnicodeDecodeError, OSError):
            skipped += 1
    return [(r, t) for r, t in out if t], skipped


def split_heldout(docs, frac: float, seed: int):
    k = max(1, round(frac * len(docs))) if len(docs) > 1 else 0
    held = set(sorted((d[0] for d in docs), key=lambda r: _rank(seed, "heldout", r))[:k])
    return [d for d in docs if d[0] not in held], [d for d in docs if d[0] in held]


def heldout_sample(held, lo: int = 20_000, hi: int = 40_000, target: int = 32_000) -> str:
    """Whole held-out files in order until >= lo bytes; a file that would pass hi is cut (whole lines) at target."""
    out = ""
    for _, text in held:
        if len(out.encode()) >= lo:
            break
        if len((out + text).encode()) > hi:
            keep = []
            size = len(out.encode())
            for line in text.splitlines(keepends=True):
                if size + len(line.encode()) > target:
                    break
                keep.append(line)
                size += len(line.encode())
            text = "".join(keep)
        out += text if not out or out.endswith("\n") else "\n" + text
    return out


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos)])
    return tok


# The bench size's weights with narrow attention: training bench itself gathers [rows, 512 entries, 512] per
# layer (its index_topk x head_dim), which outgrows a 140 GB GPU at a useful batch. (max_position_embeddings:
# the training length's, not bench's 65536.)
LARGE_NARROWER = dict(head_dim=128, out_group_dim=256, index_heads=8, index_head_dim=64, index_topk=64,
                      pool_blocks=32, max_position_embeddings=0)


def write_tokenizer(tok, out: Path, max_len: int) -> dict:
    tok.save(str(out / "tokenizer.json"))
    ids = {name: tok.token_to_id(t) for name, t in (("bos", BOS), ("eos", EOS), ("pad", PAD), ("im_end", IM_END))}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
           "additional_special_tokens": [IM_START, IM_END], "add_bos_token": True, "add_eos_token": False,
           "clean_up_tokenization_spaces": False, "model_max_length": max_len, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    gen = {"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"], ids["im_end"]], "pad_token_id": ids["pad"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return ids


def to_stream(tok, texts, bos: int, eos: int) -> torch.Tensor:
    """Each text -> [bos] + tokens + [eos], concatenated: int64 [L]."""
    texts, out = list(texts), []
    for a in range(0, len(texts), 256):  # in chunks: an Encoding keeps strings and offsets per token
        for enc in tok.encode_batch(texts[a:a + 256], add_special_tokens=False):
            out.append(bos)
            out.extend(enc.ids)
            out.append(eos)
    return torch.tensor(out, dtype=torch.long)


def cap_docs(tok, docs, max_tokens: int):
    """Held-out docs truncated (whole lines) so their streams hold at most max_tokens tokens in all."""
    out, used = [], 0
    for rel, text in docs:
        n = len(tok.encode(text, add_special_tokens=False).ids) + 2
        if used + n <= max_tokens:
            out.append((rel, text))
            used += n
            continue
        lines = text.splitlines(keepends=True)
        lo, hi = 0, len(lines)  # largest line count that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if used + len(tok.encode("".join(lines[:mid]), add_special_tokens=False).ids) + 2 <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        if lo:
            out.append((rel, "".join(lines[:lo])))
        break
    return out


def batches(stream: torch.Tensor, N: int, B: int, gen: torch.Generator):
    """Endless [B, N + 1] batches (as start offsets into the stream): each epoch a random offset in [0, N)
    (0 in the first), chunks at stride N, in a random order. Short streams repeat chunks."""
    L = int(stream.shape[0])
    if L < N + 1:
        raise SystemExit(f"training stream has {L} tokens, fewer than --seq-len + 1 = {N + 1}; use more files")
    epoch, pending = 0, []
    while True:
        while len(pending) < B:
            off = 0 if epoch == 0 else int(torch.randint(0, N, (1,), generator=gen))
            n = max(1, (L - 1 - off) // N)
            off = min(off, L - 1 - N)
            pending += (off + N * torch.randperm(n, generator=gen)).tolist()
            epoch += 1
        yield torch.tensor(pending[:B]), epoch
        pending = pending[B:]


# ---------------------------------------------------------------- baselines

def gzip_bits(texts) -> tuple[int, int]:
    """(compressed bits, raw bytes) of gzip -9 applied to each text on its own."""
    bits = sum(8 * len(gzip.compress(t.encode(), compresslevel=9, mtime=0)) for t in texts)
    return bits, sum(len(t.encode()) for t in texts)


def _lookup(keys: torch.Tensor, vals: torch.Tensor, q: torch.Tensor):
    if keys.numel() == 0:
        return torch.zeros_like(q, dtype=vals.dtype), torch.zeros_like(q, dtype=torch.bool)
    i = torch.searchsorted(keys, q).clamp(max=keys.numel() - 1)
    hit = keys[i] == q
    return torch.where(hit, vals[i], torch.zeros((), dtype=vals.dtype)), hit


def kneser_ney_logprobs(train: torch.Tensor, test: torch.Tensor, V: int, pad: int, D: float = 0.75) -> torch.Tensor:
    """Interpolated Kneser-Ney token trigram: log p(test[t] | test[t-2], test[t-1]) for t = 1..L-1 (natural log).

    Highest order from counts, lower orders from continuation counts, the unigram interpolated with the
    uniform distribution over V, one absolute discount D. The context of t = 1 is (pad, test[0])."""
    a = torch.cat([torch.tensor([pad]), train.long().cpu()])
    tri = (a[:-2] * V + a[1:-1]) * V + a[2:]
    tri_u, tri_c = torch.unique(tri, return_counts=True)  # sorted
    ab_u, ab_inv = torch.unique(tri_u // V, return_inverse=True)
    ab_cnt = torch.zeros(ab_u.numel(), dtype=torch.long).scatter_add_(0, ab_inv, tri_c)  # C(ab.)
    ab_types = torch.bincount(ab_inv, minlength=ab_u.numel())  # |{c: C(abc) > 0}|
    bc_u, bc_n = torch.unique(tri_u % (V * V), return_counts=True)  # N1+(. b c)
    b_u, b_inv = torch.unique(bc_u // V, return_inverse=True)
    b_dot = torch.zeros(b_u.numel(), dtype=torch.long).scatter_add_(0, b_inv, bc_n)  # N1+(. b .)
    b_types = torch.bincount(b_inv, minlength=b_u.numel())  # |{c: N1+(. b c) > 0}|
    c_n = torch.bincount(bc_u % V, minlength=V).double()  # N1+(. c)
    n_bt = float(bc_u.numel())
    p1 = (c_n - D).clamp(min=0) / n_bt + D * float((c_n > 0).sum()) / n_bt / V  # [V]

    x = torch.cat([torch.tensor([pad]), test.long().cpu()])
    ctx_a, ctx_b, tgt = x[:-2], x[1:-1], x[2:]
    p = p1[tgt]
    bd, hit_b = _lookup(b_u, b_dot, ctx_b)
    bt, _ = _lookup(b_u, b_types, ctx_b)
    n_bc, _ = _lookup(bc_u, bc_n, ctx_b * V + tgt)
    bd = bd.double().clamp(min=1)
    p = torch.where(hit_b, (n_bc.double() - D).clamp(min=0) / bd + D * bt.double() / bd * p, p)
    abk = ctx_a * V + ctx_b
    ac, hit_ab = _lookup(ab_u, ab_cnt, abk)
    at, _ = _lookup(ab_u, ab_types, abk)
    n_abc, _ = _lookup(tri_u, tri_c, abk * V + tgt)
    ac = ac.double().clamp(min=1)
    p = torch.where(hit_ab, (n_abc.double() - D).clamp(min=0) / ac + D * at.double() / ac * p, p)
    return torch.log(p)


# ---------------------------------------------------------------- plot

_FONT = {  # 3x5 digits for the fallback PNG's axis labels
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "k": "100101110101101",
}


def _png(path: Path, img: list, w: int, h: int) -> None:
    raw = b"".join(b"\x00" + bytes(row) for row in img)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _fallback_plot(path: Path, series: list) -> None:
    """A plain RGB line plot without matplotlib: series = [(xs, ys, (r, g, b))]; y from 0, x from 0."""
    W, H, L, Bm, T, R = 800, 480, 40, 24, 10, 10
    img = [[255] * (3 * W) for _ in range(H)]

    def put(x, y, col):
        if 0 <= x < W and 0 <= y < H:
            img[y][3 * x:3 * x + 3] = col

    xmax = max([max(xs) for xs, _, _ in series if xs] + [1])
    ymax = max([max(ys) for _, ys, _ in series if ys] + [1e-9]) * 1.05
    px = lambda x: L + int((W - L - R - 1) * x / xmax)  # noqa: E731
    py = lambda y: H - Bm - int((H - Bm - T - 1) * min(max(y, 0.0), ymax) / ymax)  # noqa: E731

    def text(s, x, y):
        for ch in s:
            bits = _FONT.get(ch)
            if bits:
                for k, b in enumerate(bits):
                    if b == "1":
                        for dx in range(2):
                            for dy in range(2):
                                put(x + 2 * (k % 3) + dx, y + 2 * (k // 3) + dy, (0, 0, 0))
            x += 8

    step = 10 ** math.floor(math.log10(ymax)) if ymax > 0 else 1
    while ymax / step > 8:
        step *= 2
    v = 0.0
    while v <= ymax:
        for x in range(L, W - R):
            put(x, py(v), (225, 225, 225))
        text(f"{v:g}"[:4], 2, py(v) - 5)
        v += step
    for x in range(L, W - R):
        put(x, H - Bm, (0, 0, 0))
    for y in range(T, H - Bm):
        put(L, y, (0, 0, 0))
    text(f"{xmax / 1000:.0f}k" if xmax >= 1000 else f"{xmax:.0f}", W - R - 40, H - Bm + 6)
    for xs, ys, col in series:
        prev = None
        for x, y in zip(xs, ys):
            if not math.isfinite(y):
                continue
            cur = (px(x), py(y))
            if prev is not None:
                n = max(abs(cur[0] - prev[0]), abs(cur[1] - prev[1]), 1)
                for k in range(n + 1):
                    put(prev[0] + (cur[0] - prev[0]) * k // n, prev[1] + (cur[1] - prev[1]) * k // n, col)
            prev = cur
    _png(path, img, W, H)


def plot_loss(path: Path, rows: list, vals: list, evals: dict) -> str:
    steps = [r["step"] for r in rows]
    vs, vy = [v["step"] for v in vals], [v["val_ce"] for v in vals]
    ce = [r["ce"] for r in rows]
    kl = [r["index_kl"] for r in rows]
    ema, sm = [], None
    for v in ce:
        sm = v if sm is None else 0.95 * sm + 0.05 * v
        ema.append(sm)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        _fallback_plot(path, [(steps, ce, (170, 200, 240)), (steps, ema, (20, 60, 200)), (steps, kl, (220, 40, 40)),
                              (vs, vy, (20, 150, 40))])
        return ("fallback (no matplotlib): light blue = train CE, blue = its EMA, green = held-out CE (first windows, "
                "exact), red = indexer KL; y in nats, x in steps")
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.plot(steps, ce, color="#aac8f0", lw=0.8, label="train CE (nats/token)")
    ax.plot(steps, ema, color="#1f3cc8", lw=1.5, label="train CE, EMA 0.95")
    ax.plot(steps, kl, color="#dc2828", lw=1.0, label="indexer KL (mean over layers)")
    if vs:
        ax.plot(vs, vy, "o-", color="#149628", ms=3, lw=1, label="held-out CE, first windows (exact)")
    for mode, ls in (("exact", "--"), ("bounded", ":")):
        if mode in evals:
            ax.axhline(evals[mode]["nats_per_token"], color="k", ls=ls, lw=1, label=f"held-out {mode} (nats/token)")
    ax.set_xlabel("step")
    ax.set_ylabel("nats")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("CED demo model on the Python standard library")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output checkpoint directory")
    ap.add_argument("--data-dir", default=os.path.dirname(os.__file__), help="default: the standard library")
    ap.add_argument("--skip-tests", action="store_true", help="leave out test/tests/idle_test directories")
    ap.add_argument("--max-files", type=int, default=0, help="use a seeded subset of this many files (0 = all)")
    ap.add_argument("--heldout-frac", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the whole run")
    ap.add_argument("--steps", type=int, default=0, help="fixed step count for the schedule (0 = time-based)")
    ap.add_argument("--min-steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--final-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=float, default=0.03, help="warmup fraction of the run")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--kl-weight", type=float, default=0.1)
    ap.add_argument("--p0", type=float, default=0.25, help="probability of replay start 0")
    ap.add_argument("--moe-ffn", type=int, default=0, help="expert width (moe_intermediate_size; 0: 96 for the toy "
                    "size, the size's own otherwise)")
    ap.add_argument("--size", choices=("toy", "small", "bench", "large"), default="toy",
                    help="models/ced/config.SIZES (toy is the demo), or large: the bench size's weights (d 2048, "
                         "16 layers, 32 experts x 512) with attention and indexer narrow enough to train on one "
                         "GPU; decode memory-bound there, for the speculative-decoding sweep (issue 15), not shipped")
    ap.add_argument("--bias-update", type=float, default=0.0,
                    help="MoE gate-bias balancing rate (0 = off, gate_bias stays 0)")
    ap.add_argument("--eval-frac", type=float, default=0.1, help="share of the budget kept for evaluation")
    ap.add_argument("--eval-batch", type=int, default=0, help="windows per evaluation batch (0 = --batch)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-bf16", action="store_true", help="train in float32 on CUDA too")
    ap.add_argument("--path", choices=("rows", "full"), default="rows",
                    help="rows: batched twin of forward_full (default); full: model.forward_full itself (slow, no KL)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads when training on the CPU (0 = 1: the ops are tiny and extra threads spin)")
    ap.add_argument("--log-every-s", type=float, default=20.0)
    ap.add_argument("--val-every-s", type=float, default=30.0, help="held-out CE on a few windows, for the curve")
    ap.add_argument("--val-windows", type=int, default=8)
    ap.add_argument("--sample-tokens", type=int, default=48, help="greedy sample for the README (0 = none)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    t0 = time.time()
    args = parse_args(argv)
    from deepinfer.models.ced import train as T
    from deepinfer.models.ced.config import SIZES, CEDConfig
    from deepinfer.models.ced.model import CEDForCausalLM

    budget = args.minutes * 60.0
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    N, B = args.seq_len, args.batch
    log(f"[train_demo] device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else platform.processor() or 'cpu'}), "
        f"torch {torch.__version__}, python {platform.python_version()}, budget {budget:.0f}s")

    # Data.
    root = Path(args.data_dir)
    docs, skipped = collect_files(root, args.skip_tests, args.max_files, args.seed)
    if len(docs) < 2:
        raise SystemExit(f"found {len(docs)} usable .py files under {root}; need at least 2")
    train_docs, held_docs = split_heldout(docs, args.heldout_frac, args.seed)
    (out / "heldout_files.txt").write_text("".join(r + "\n" for r, _ in held_docs))
    sample = heldout_sample(held_docs)
    (out / "heldout_sample.txt").write_text(sample, encoding="utf-8")
    nbytes = lambda ds: sum(len(t.encode()) for _, t in ds)  # noqa: E731
    log(f"[data] {root}: {len(docs)} files ({nbytes(docs) / 1e6:.1f} MB, {skipped} not UTF-8 skipped, tests "
        f"{'skipped' if args.skip_tests else 'included'}); held out {len(held_docs)} ({nbytes(held_docs) / 1e3:.0f} KB), "
        f"sample {len(sample.encode()) / 1e3:.1f} KB")

    # Tokenizer.
    t = time.time()
    tok = train_tokenizer([x for _, x in train_docs], args.vocab)
    ids = write_tokenizer(tok, out, max(4096, N))
    train_stream = to_stream(tok, [x for _, x in train_docs], ids["bos"], ids["eos"])
    sample_stream = to_stream(tok, [sample], ids["bos"], ids["eos"])
    log(f"[tokenizer] vocab {tok.get_vocab_size()} in {time.time() - t:.1f}s; train stream {train_stream.numel() / 1e6:.2f}M "
        f"tokens ({nbytes(train_docs) / max(1, train_stream.numel()):.2f} bytes/token)")

    # Model.
    # toy: CEDConfig's defaults (an empty dict); large: bench's, narrower
    size = dict(SIZES[args.size]) if args.size in SIZES else dict(SIZES["bench"], **LARGE_NARROWER)
    size["max_position_embeddings"] = max(4096, N, size.get("max_position_embeddings", 0))
    if args.moe_ffn or args.size == "toy":
        size["moe_intermediate_size"] = args.moe_ffn or 96
    cfg = CEDConfig(vocab_size=args.vocab, tie_word_embeddings=True, **size)
    model = CEDForCausalLM(cfg)
    model.init_weights(args.seed)
    model.to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[model] CED {args.size}: {n_params:,} parameters, {n_params * 2 / 1e6:.2f} MB in bf16 "
        f"(d {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.n_routed_experts} experts x {cfg.moe_intermediate_size})")

    # Self-check: the batched path against forward_full (float32, two sequences, a random cut).
    gen = torch.Generator().manual_seed(args.seed)
    chk_ids = train_stream[:2 * N].view(2, N).to(dev) if train_stream.numel() >= 2 * N else train_stream[:N][None].to(dev)
    chk_s = T.draw_starts(chk_ids.shape[0], chk_ids.shape[1], cfg.n_win, 0.0, gen)
    with torch.no_grad():
        h = T.forward_rows(model, chk_ids, chk_s.to(dev))
        diff = max(float((model.forward_full(chk_ids[b], replay_start=int(chk_s[b]))
                          - model.logits(h[b, int(chk_s[b]):])).abs().max()) for b in range(chk_ids.shape[0]))
    log(f"[check] batched path vs forward_full: max |logit diff| {diff:.2e}" + ("  WARNING: large" if diff > 1e-2 else ""))

    # Evaluation cost, measured now so training leaves time for it.
    eb = args.eval_batch or B
    probe = min(eb, 4)
    wins = torch.randint(0, args.vocab, (probe * N,), generator=gen).to(dev)
    if dev.type == "cuda":  # the first call loads kernels; time the second
        T.eval_stream(model, wins, N, probe, max_windows=probe)
        torch.cuda.synchronize()
    t = time.time()
    T.eval_stream(model, wins, N, probe, max_windows=probe)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    per_window = (time.time() - t) / probe * (0.6 if eb > probe and dev.type == "cuda" else 1.0)
    eval_budget = args.eval_frac * budget
    cap_windows = max(2, int(eval_budget / max(per_window, 1e-4)))
    sample_windows = len(T.window_plan(sample_stream.numel(), N))
    held_windows = max(1, cap_windows - min(sample_windows, cap_windows // 2))
    eval_docs = cap_docs(tok, held_docs, held_windows * max(1, N // 2) + N // 2)
    kept = dict(eval_docs)
    truncated = [r for r, x in held_docs if kept.get(r) != x]
    eval_stream_ids = to_stream(tok, [x for _, x in eval_docs], ids["bos"], ids["eos"])
    eval_bytes = nbytes(eval_docs)
    log(f"[eval plan] {per_window * 1e3:.0f} ms/window -> {len(eval_docs)}/{len(held_docs)} held-out files, "
        f"{eval_stream_ids.numel():,} tokens, {eval_bytes / 1e3:.0f} KB" + (" (truncated)" if truncated else ""))

    # Baselines on the same text.
    t = time.time()
    gz_bits, gz_bytes = gzip_bits([x for _, x in eval_docs])
    kn = kneser_ney_logprobs(train_stream, eval_stream_ids, args.vocab, ids["pad"])
    kn_nats = float(-kn.sum())
    baselines = {"gzip9": {"bits_per_byte": gz_bits / max(1, gz_bytes)},
                 "kneser_ney_trigram": {"nats_per_token": kn_nats / max(1, kn.numel()),
                                        "bits_per_byte": kn_nats / math.log(2) / max(1, eval_bytes), "discount": 0.75}}
    log(f"[baselines] gzip -9 {baselines['gzip9']['bits_per_byte']:.3f} bits/byte, KN trigram "
        f"{baselines['kneser_ney_trigram']['bits_per_byte']:.3f} bits/byte ({time.time() - t:.1f}s)")

    # Training.
    tail = 5.0 + 0.02 * budget
    deadline = t0 + budget - eval_budget - tail
    use_amp = dev.type == "cuda" and not args.no_bf16
    opt = torch.optim.AdamW(T.param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                            **({"fused": True} if dev.type == "cuda" else {}))
    data = train_stream.to(dev)
    arange = torch.arange(N + 1, device=dev)
    stream_batches = batches(train_stream, N, B, gen)
    rows, vals, step, tokens, epoch, n_bad = [], [], 0, 0, 0, 0
    val_windows = min(args.val_windows, len(T.window_plan(int(eval_stream_ids.numel()), N)))
    val_stream = eval_stream_ids.to(dev)

    def val_ce():  # exact-mode CE on the first held-out windows: a cheap curve, not the reported result
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_amp):
            r = T.eval_stream(model, val_stream, N, eb, modes=("exact",), max_windows=val_windows)["exact"]
        return r["nats"] / max(1, r["tokens"])

    t_train = time.time()
    t_log = t_val = t_train
    tps_t, tps_tok = None, 0
    log_f = open(out / "train_log.jsonl", "w")
    log(f"[train] batch {B} x {N}, lr {args.lr}, kl weight {args.kl_weight}, path {args.path}, "
        f"{'bf16 autocast' if use_amp else 'float32'}, training until {deadline - t0:.0f}s")
    model.train()
    while True:
        now = time.time()
        if args.steps and step >= args.steps:
            break
        if step >= args.min_steps and now >= deadline:
            break
        progress = step / args.steps if args.steps else (now - t_train) / max(1e-6, deadline - t_train)
        lr = args.lr * T.lr_factor(progress, args.warmup, args.final_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        starts_cpu, epoch = next(stream_batches)
        batch = data[starts_cpu.to(dev)[:, None] + arange]  # [B, N + 1]
        cuts = T.draw_starts(B, N, cfg.n_win, args.p0, gen)
        loads = {} if args.bias_update > 0 else None
        opt.zero_grad(set_to_none=True)
        try:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_amp):
                if args.path == "rows":
                    loss, ce, kl, per = T.lm_loss(model, batch, cuts.to(dev), args.kl_weight, loads)
                else:
                    s = int(cuts[0])
                    logits = model.forward_full(batch[:, :-1], replay_start=s)
                    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                           batch[:, 1 + s:].reshape(-1))
                    loss, kl, per = ce, ce.new_zeros(()), {}
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            bad = not bool(torch.isfinite(loss.detach()) & torch.isfinite(gnorm))
        except ValueError as exc:  # the KV quantizers refuse inf/NaN: a diverged step
            if "finite" not in str(exc):
                raise
            bad = True
        if bad:  # skip the update, keep going; give up training (not the run) if it keeps happening
            n_bad += 1
            opt.zero_grad(set_to_none=True)
            log(f"[train] step {step + 1}: non-finite loss or gradient, update skipped ({n_bad} so far)")
            if n_bad >= 20:
                log("[train] too many non-finite steps: stopping training early")
                break
            continue
        opt.step()
        if loads:
            T.update_gate_bias(model, loads, args.bias_update)
        step += 1
        tokens += B * N
        rec = {"step": step, "tokens": tokens, "loss": loss.item(), "ce": ce.item(), "index_kl": kl.item(), "lr": lr,
               "elapsed": round(time.time() - t_train, 3), "grad_norm": float(gnorm), "epoch": epoch,
               "kl_layers": {str(k): round(float(v.detach()), 5) for k, v in per.items()}}
        rows.append(rec)
        log_f.write(json.dumps(rec) + "\n")
        now = time.time()
        if val_windows and now - t_val >= args.val_every_s:
            t_val = now
            vals.append({"step": step, "tokens": tokens, "elapsed": round(now - t_train, 3), "val_ce": val_ce()})
            log_f.write(json.dumps(vals[-1]) + "\n")
        if step == 3:  # throughput from here on (skips warm-up)
            tps_t, tps_tok = time.time(), tokens
        if step == 1 or now - t_log >= args.log_every_s:
            t_log = now
            tps = (tokens - tps_tok) / (now - tps_t) if tps_t and now > tps_t else tokens / (now - t_train)
            val = f" | val {vals[-1]['val_ce']:.3f}" if vals and vals[-1]["step"] == step else ""
            log(f"[train] step {step} | {tokens / 1e6:.2f}M tok | ce {rec['ce']:.3f} | kl {rec['index_kl']:.3f}{val} | "
                f"lr {lr:.2e} | {tps / 1e3:.1f}k tok/s | {now - t0:.0f}/{budget:.0f}s")
    if rows and val_windows and not (vals and vals[-1]["step"] == step):
        vals.append({"step": step, "tokens": tokens, "elapsed": round(time.time() - t_train, 3), "val_ce": val_ce()})
        log_f.write(json.dumps(vals[-1]) + "\n")
    log_f.close()
    train_s = time.time() - t_train
    tps = (tokens - tps_tok) / (time.time() - tps_t) if tps_t and tokens > tps_tok else tokens / max(1e-6, train_s)
    last = rows[-min(20, len(rows)):]
    log(f"[train] done: {step} steps, {tokens / 1e6:.2f}M tokens ({tokens / max(1, train_stream.numel()):.2f} epochs) in "
        f"{train_s:.0f}s, {tps / 1e3:.1f}k tok/s, last-20 ce {sum(r['ce'] for r in last) / len(last):.3f}")

    # Save (before evaluating, so a checkpoint exists whatever happens next).
    model.eval()
    info = T.save_checkpoint(model, out, {"dtype": "bfloat16", "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
                                          "pad_token_id": ids["pad"]})
    log(f"[save] {', '.join(info['files'])}: {info['params']:,} parameters, {info['bytes'] / 1e6:.2f} MB")

    # Evaluate the saved (bf16) weights in float32.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    t = time.time()
    res = T.summarize(T.eval_stream(model, eval_stream_ids.to(dev), N, eb), eval_bytes)
    left = budget - (time.time() - t0) - 2.0
    smp_windows = sample_windows if left > 2 * sample_windows * per_window else max(1, int(left / max(per_window, 1e-4) / 2))
    smp = T.summarize(T.eval_stream(model, sample_stream.to(dev), N, eb, max_windows=smp_windows), len(sample.encode()))
    if smp_windows < sample_windows:  # out of time: only a prefix was scored, so bits/byte has no denominator
        for r in smp.values():
            r["bits_per_byte"] = None
    log(f"[eval] held-out exact {res['exact']['bits_per_byte']:.3f} bits/byte ({res['exact']['nats_per_token']:.3f} "
        f"nats/token), bounded {res['bounded']['bits_per_byte']:.3f} bits/byte ({res['bounded']['nats_per_token']:.3f}); "
        f"sample exact {smp['exact']['nats_per_token']:.3f} nats/token ({time.time() - t:.1f}s)")

    # Greedy sample for the model card: each token as the engine predicts it after a prompt (bounded replay).
    sample_text = None
    if args.sample_tokens and budget - (time.time() - t0) > 15:
        prompt = "import os\n\n\ndef "
        seq = [ids["bos"]] + tok.encode(prompt, add_special_tokens=False).ids
        with torch.no_grad():
            for _ in range(args.sample_tokens):
                x = torch.tensor(seq, device=dev)
                nxt = int(model.forward_full(x, replay_start=max(0, len(seq) - cfg.n_win))[-1].argmax())
                if nxt in (ids["eos"], ids["im_end"]):
                    break
                seq.append(nxt)
        sample_text = tok.decode(seq[1:], skip_special_tokens=True)

    eval_json = {
        "model": {"architecture": "CEDForCausalLM", "parameters": info["params"], "checkpoint_bytes": info["bytes"],
                  "files": info["file_bytes"], "config": cfg.to_hf()},
        "data": {"root": str(root), "python": platform.python_version(), "files": len(docs), "skipped_not_utf8": skipped,
                 "tests_included": not args.skip_tests, "train_files": len(train_docs), "train_bytes": nbytes(train_docs),
                 "train_tokens": int(train_stream.numel()), "heldout_files": len(held_docs),
                 "heldout_bytes": nbytes(held_docs), "eval_files": len(eval_docs), "eval_bytes": eval_bytes,
                 "eval_tokens": int(eval_stream_ids.numel()), "eval_truncated": bool(truncated)},
        "training": {"steps": step, "tokens": tokens, "epochs": tokens / max(1, train_stream.numel()),
                     "seconds": train_s, "tokens_per_s": tps, "batch": B, "seq_len": N, "seed": args.seed,
                     "lr": args.lr, "kl_weight": args.kl_weight, "p0": args.p0, "path": args.path,
                     "bf16_autocast": use_amp, "device": str(dev),
                     "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                     "final_ce_last20": sum(r["ce"] for r in last) / len(last),
                     "final_index_kl_last20": sum(r["index_kl"] for r in last) / len(last),
                     "self_check_max_abs_logit_diff": diff},
        "heldout": {**res, "protocol": "windows of seq_len at stride seq_len/2, each target scored once; exact: replay "
                    "start 0; bounded: decoder over the last n_win tokens before each target (engine prefill)"},
        "baselines": baselines,
        "heldout_sample": {"bytes": len(sample.encode()), "tokens": int(sample_stream.numel()), **smp,
                           "protocol": "one document <|bos|> sample <|eos|>, same windows and modes as heldout",
                           "windows_scored": smp_windows, "windows_total": sample_windows},
        "sample_generation": sample_text,
        "wall_seconds": time.time() - t0,
    }
    (out / "eval.json").write_text(json.dumps(eval_json, indent=2) + "\n")
    try:
        how = plot_loss(out / "loss.png", rows, vals, res)
    except Exception as exc:  # the plot is a nicety; never lose the run over it
        how = f"failed: {exc}"
    write_readme(out, args, argv, eval_json, how)
    log(f"[done] {out} in {time.time() - t0:.0f}s (plot: {how.split(':')[0]})")
    return eval_json


def write_readme(out: Path, args, argv, ev: dict, plot_how: str) -> None:
    cmd = "python scripts/train_demo.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    d, tr, m, h, b = ev["data"], ev["training"], ev["model"], ev["heldout"], ev["baselines"]
    c = m["config"]
    rows = [("CED demo, exact (replay start 0)", h["exact"]["bits_per_byte"], h["exact"]["nats_per_token"]),
            (f"CED demo, bounded (decoder over last {c['n_win']} tokens)", h["bounded"]["bits_per_byte"],
             h["bounded"]["nats_per_token"]),
            ("Kneser-Ney token trigram (same tokenizer)", b["kneser_ney_trigram"]["bits_per_byte"],
             b["kneser_ney_trigram"]["nats_per_token"]),
            ("gzip -9 per file", b["gzip9"]["bits_per_byte"], None)]
    table = "\n".join(f"| {n} | {bpb:.3f} | {'' if npt is None else f'{npt:.3f}'} |" for n, bpb, npt in rows)
    s = ev["heldout_sample"]
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    gen = ev.get("sample_generation")
    text = f"""# CED demo model (toy DeepSeek-V4.1-Flash architecture)

A {m['parameters'] / 1e6:.2f}M-parameter causal encoder-decoder (CED) trained from scratch for
{tr['seconds'] / 60:.1f} minutes on the Python standard library, written by `scripts/train_demo.py`.
It exists to exercise every mechanism of the architecture in DeepInfer (compressed sparse attention
with its indexer, MoE, FP4/FP8 KV, bounded SWA replay) with weights that predict real text; it is
not a useful code model.

## Command

```
{cmd}
```

Seed {tr['seed']}; {tr['device_name']}; Python {d['python']}; wall clock {ev['wall_seconds']:.0f} s.

## Data

All `*.py` files under `{d['root']}` (Python {d['python']}'s standard library), recursively, sorted,
without site-packages/dist-packages/__pycache__; test directories
{'included' if d['tests_included'] else 'left out'}; {d['skipped_not_utf8']} non-UTF-8 files skipped.
{d['files']} files; {d['heldout_files']} held out ({d['heldout_bytes'] / 1e3:.0f} KB, the files with the smallest
SHA-256 of "seed:heldout:path"; listed in `heldout_files.txt`); training on {d['train_files']} files,
{d['train_bytes'] / 1e6:.1f} MB, {d['train_tokens'] / 1e6:.2f}M tokens.

Tokenizer: byte-level BPE trained on the training files, vocab {c['vocab_size']}, special tokens
`<|bos|> <|eos|> <|pad|> <|im_start|> <|im_end|>` (ids 0-4); each file is `<|bos|>` text `<|eos|>`.
A ChatML-style chat template is included, but the model has never seen a conversation.

## Model

CEDConfig defaults (d {c['hidden_size']}, {c['num_layers']} layers = {c['num_encoder_layers']} encoder +
{c['num_layers'] - c['num_encoder_layers']} decoder, modes {', '.join(c['layer_modes'])}, {c['num_heads']} heads x
{c['head_dim']}, rope {c['rope_dim']}, n_win {c['n_win']}, indexer {c['index_heads']}x{c['index_head_dim']}
top-{c['index_topk']}, pool {c['pool_blocks']} blocks x {c['pool_block']}, MoE {c['n_routed_experts']} routed
top-{c['num_experts_per_tok']} + {c['n_shared_experts']} shared, expert width {c['moe_intermediate_size']}),
tied embeddings. {m['parameters']:,} parameters, {m['checkpoint_bytes'] / 1e6:.2f} MB of bf16 weights
({', '.join(m['files'])}).

## Training

{tr['steps']} steps of {tr['batch']} x {tr['seq_len']} tokens ({tr['tokens'] / 1e6:.1f}M tokens,
{tr['epochs']:.1f} epochs, {tr['tokens_per_s'] / 1e3:.0f}k tokens/s), AdamW lr {tr['lr']} (warmup, cosine to 10%),
weight decay 0.1, grad clip 1.0, {'bf16 autocast' if tr['bf16_autocast'] else 'float32'}. Engine semantics:
KV fake-quantized as the cache stores it (straight-through gradients); the decoder replay start drawn per
sequence (0 with probability {tr['p0']}, else uniform in [0, N - n_win]) with the loss on the positions
after it; indexer trained by KL to the head-averaged dense attention over the visible compressed entries
(weight {tr['kl_weight']}). Final train CE (mean of the last 20 steps) {tr['final_ce_last20']:.3f} nats/token,
indexer KL {tr['final_index_kl_last20']:.3f}. Loss curve: `loss.png` ({plot_how}). `train_log.jsonl`: one
line per step (step, tokens, loss, ce, index_kl, lr, elapsed in s, grad_norm, epoch, KL per indexer layer)
and, every ~30 s, a line (step, tokens, elapsed, val_ce) with the exact-mode CE on the first
held-out windows.

## Held-out results

{d['eval_files']} held-out files, {d['eval_bytes'] / 1e3:.0f} KB, {d['eval_tokens']:,} tokens
{'(truncated to the evaluation budget)' if d['eval_truncated'] else ''}. bits/byte = total nats / ln 2 / UTF-8 bytes.

| model | bits/byte | nats/token |
|---|---|---|
{table}

Protocol: windows of {tr['seq_len']} tokens at stride {tr['seq_len'] // 2}, each target scored once. Exact: replay
start 0. Bounded: each target predicted as the engine predicts the first token after a prompt ending
just before it (the decoder runs over the last {c['n_win']} tokens only); the least decoder context the engine
uses. The bf16 weights as saved, computed in float32.

Regression sample `heldout_sample.txt` ({s['bytes']} bytes, {s['tokens']} tokens as one document):
exact {s['exact']['nats_per_token']:.4f} nats/token ({fmt(s['exact']['bits_per_byte'])} bits/byte), bounded
{s['bounded']['nats_per_token']:.4f} nats/token, over {s['windows_scored']}/{s['windows_total']} windows.
"""
    if gen:
        text += f"\nGreedy sample (bounded replay, prompt `import os\\n\\n\\ndef `):\n\n```python\n{gen}\n```\n"
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
