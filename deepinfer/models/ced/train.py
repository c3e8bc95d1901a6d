"""Training the CED demo model: a batched twin of ``forward_full``, the losses, evaluation and checkpoints.

The batched forward
    ``forward_full`` loops over the sequences of a batch (it is the oracle and keeps every piece 2-D),
    and its MoE syncs with the host once per layer and sequence. ``forward_rows`` runs the same layer
    pieces (``CEDLayer.query``, ``swa_kv``, ``entries``, ``index_query``, ``out_proj``, ``moe`` and
    ``functional``'s ``select_topk``, ``pool_mask``, ``attend``) once over a batch of *rows*:
    R rows of T positions each, every row reading the compressed entries of one source sequence.
    Training uses one row per sequence; the bounded evaluation uses one short row per scored position
    (see ``bounded_last_hidden``). Position-wise pieces run on the R*T flattened tokens, so the MoE
    and every projection see the whole batch at once. Its semantics are forward_full's, checked by
    tests/test_train.py (same logits to float32 rounding).

Replay cut per row
    Row r has a replay start ``cut[r]``. In the decoder, a query at position i >= cut[r] attends SWA keys
    at positions [max(cut[r], i - n_win + 1), i] of its own row, exactly as forward_full(ids,
    replay_start=cut[r]) does for its decoder pass over [cut[r], N). Queries at i < cut[r] (which
    forward_full does not compute) run with the cut at 0; they never serve as keys of queries >= cut[r],
    so positions >= cut[r] are unaffected, and the losses ignore them. The encoder always runs uncut.

Losses (``lm_loss``)
    ce        mean next-token cross-entropy over the positions >= cut[r] of every row (the positions
              forward_full(ids, replay_start=cut[r]) returns). The training script draws cut[r] per
              sequence: 0 with probability p0, else uniform in [0, N - n_win].
    index_kl  per full/reindex layer and per query (only queries >= cut with at least one visible
              entry): KL(p || q) over the compressed entries visible to the query, where
              p = softmax(q_h . e_j / sqrt(D)) over the visible entries only (no SWA keys, no sink),
              averaged over the H query heads, from the layer's own RoPE'd query and the fake-quantized
              entries it attends, detached (a target); and q = softmax of the indexer scores over the
              same visible entries (for a decoder reindex layer: all visible entries, not only its pool).
              The indexer reads detached inputs (its query latent, hidden state and the compressed
              source), so the KL trains only the indexer weights (wiq, wiw, wik, wzi), and the
              cross-entropy, which cannot reach them through the discrete top-K, never does. The KL of a
              layer is the mean over its queries; index_kl is the mean over the indexer layers.
    loss      ce + kl_weight * index_kl (the script's default kl_weight is 0.1).

Fake quantization stays on (config.fake_quant): ``functional.fake`` is a straight-through estimator
when its input needs a gradient, so the weights see the KV rounding the engine applies and still learn.
Attention, indexer scores and the KL run in float32 even under bf16 autocast, as the engine computes
them.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from . import functional as fn

NEG = -1e30  # a finite -inf: a row with nothing visible stays finite (and its gradient too)


def _fp32(device: torch.device):
    """Disable autocast: attention and indexer math stay in float32, as in the engine."""
    return torch.autocast(device.type, enabled=False) if device.type == "cuda" else nullcontext()


def _index_scores(q, w, k):
    """q [R, T, nh, dh], w [R, T, nh], k [R, J, dh] -> [R, T, J] float32: sum_h w_h * relu(q_h . k_j)."""
    dots = torch.einsum("rthd,rjd->rthj", q.float(), k.float())
    return (w.float()[..., None] * torch.relu(dots)).sum(2)


def _index_k(layer, xg):
    """The indexer K of complete groups xg [G*m, d] (normed), as CEDLayer.entries computes it."""
    c, m = layer.c, layer.m
    wi = fn.group_weights(F.linear(xg, layer.wzi), m) if m > 1 else None
    return fn.fake(fn.compress(F.linear(xg, layer.wik), wi, m), c.index_k_format, c.fake_quant)


def _indexer_kl(q, ents, scores, vis, qmask, scale):
    """KL(dense attention over the visible entries, head-averaged, detached || softmax(indexer scores)).

    q [R, T, H, D]; ents [R, J, D] (each row's source entries); scores [R, T, J] float32; vis [R, T, J];
    qmask [R, T] the queries that count. Returns a scalar (mean over counted queries with an entry)."""
    with torch.no_grad():
        a = torch.einsum("rthd,rjd->rthj", q.float(), ents.float()) * scale
        a = a.masked_fill(~vis[:, :, None, :], NEG)
        p = torch.softmax(a, dim=-1).mean(2)  # [R, T, J]
        p = p * vis
        plogp = torch.where(p > 0, p * torch.log(p.clamp_min(1e-30)), torch.zeros_like(p)).sum(-1)
    logq = torch.log_softmax(scores.masked_fill(~vis, NEG), dim=-1)
    kl = plogp - (p * torch.where(vis, logq, torch.zeros_like(logq))).sum(-1)  # [R, T]
    w = (qmask & vis.any(-1)).float()
    return (kl * w).sum() / w.sum().clamp_min(1.0)


def _layer(model, layer, h, pos, cut, seq, src, ctx, aux, loads):
    """One CED layer over rows.

    h [R, T, d] hidden of the rows; pos [R, T] their positions (negative = padding, never a key);
    cut [R] replay start of each row; seq [R] the source sequence of each row; src [Bs, N, d] the
    hidden a full layer compresses (None: the rows are the source sequences themselves, as in the
    encoder); ctx: this forward's entries, top-K and pools; aux: None or a dict collecting indexer KLs;
    loads: None or a dict collecting the MoE expert ids per layer. Returns [R, T, d].
    """
    c = model.config
    R, T, d = h.shape
    dev = h.device
    W, D = c.n_win, c.head_dim
    hf, pf = h.reshape(R * T, d), pos.reshape(R * T)
    x = fn.rms(hf, layer.attn_norm, c.rms_norm_eps)
    q, cq = layer.query(x, pf)  # [R*T, H, D], [R*T, q_lora]
    kv = layer.swa_kv(x, pf)  # [R*T, D]
    # SWA keys: local positions t-W+1..t of the same row, at or after the query's cut, never padding.
    loc = torch.arange(T, device=dev)[:, None] - (W - 1) + torch.arange(W, device=dev)[None, :]  # [T, W]
    kpos = pos[:, loc.clamp(min=0)]  # [R, T, W]
    qcut = torch.where(pos >= cut[:, None], cut[:, None], torch.zeros_like(pos))  # [R, T]
    smask = (loc >= 0)[None] & (kpos >= qcut[..., None]) & (kpos >= 0)
    kidx = torch.arange(R, device=dev)[:, None, None] * T + loc.clamp(min=0)[None]  # [R, T, W]
    swa, smask = kv[kidx.reshape(R * T, W)], smask.reshape(R * T, W)
    if layer.mode == "swa":
        glob = kv.new_zeros(R * T, 0, D)
        gmask = torch.zeros(R * T, 0, dtype=torch.bool, device=dev)
    else:
        m = layer.m
        srcl = c.source_full(layer.i)
        if layer.mode == "full":
            xs = x.view(R, T, d) if src is None else fn.rms(src, layer.attn_norm, c.rms_norm_eps)  # [Bs, N, d]
            Bs, N = xs.shape[:2]
            J = N // m
            xg = xs[:, : J * m].reshape(Bs * J * m, d)
            e, k = layer.entries(xg, torch.arange(J, device=dev).repeat(Bs))
            if aux is not None:  # the indexer learns from the KL alone: its K reads a detached input
                k = _index_k(layer, xg.detach())
            ctx[("kv", layer.i)] = (e.view(Bs, J, D), k.view(Bs, J, -1))
        ents, ik = ctx[("kv", srcl)]
        J = ents.shape[1]
        vis = torch.arange(J, device=dev)[None, None, :] < torch.div(pos + 1, m, rounding_mode="floor")[..., None]
        if layer.mode in ("full", "reindex"):
            xi, cqi = (x.detach(), cq.detach()) if aux is not None else (x, cq)
            iq, iw = layer.index_query(xi, cqi)
            with _fp32(dev):
                scores = _index_scores(iq.view(R, T, c.index_heads, -1), iw.view(R, T, -1), ik[seq])  # [R, T, J]
            sf, vf = scores.detach().reshape(R * T, J), vis.reshape(R * T, J)
            allowed = vf
            if layer.is_decoder and layer.mode == "reindex":
                allowed = vf & ctx[("pool", srcl)]
            topk = fn.select_topk(sf, allowed, c.index_topk)
            if layer.is_decoder and layer.mode == "full":
                ctx[("pool", layer.i)] = fn.pool_mask(sf, vf, c.pool_block, c.pool_blocks)
            ctx[("topk", layer.i)] = topk
            if aux is not None and J:
                qmask = (pos >= cut[:, None]) & (pos >= 0)
                with _fp32(dev):
                    aux[layer.i] = _indexer_kl(q.detach().view(R, T, c.num_heads, D), ents[seq].detach(), scores,
                                               vis, qmask, D ** -0.5)
        else:
            topk = ctx[("topk", c.source_topk(layer.i))]
        gmask = topk >= 0
        if J:
            seq_q = seq.repeat_interleave(T)  # [R*T]
            glob = ents[seq_q[:, None], topk.clamp(min=0)]  # [R*T, K, D]
        else:
            glob = kv.new_zeros(R * T, topk.shape[1], D)
    with _fp32(dev):
        o = fn.attend(q, swa, smask, glob, gmask, layer.sink, D ** -0.5)
    hf = hf + layer.out_proj(o, pf)
    y, ids = layer.moe(fn.rms(hf, layer.ffn_norm, c.rms_norm_eps))
    if loads is not None:
        loads[layer.i] = ids
    return (hf + y).view(R, T, d)


def encode(model, ids, aux=None, loads=None):
    """Encoder over ids [B, N] -> (final encoder hidden [B, N, d], ctx)."""
    B, N = ids.shape
    c = model.config
    pos = torch.arange(N, device=ids.device).expand(B, N)
    zero = torch.zeros(B, dtype=torch.long, device=ids.device)
    seq = torch.arange(B, device=ids.device)
    h, ctx = model.embed(ids), {}
    for layer in model.layers[: c.num_encoder_layers]:
        h = _layer(model, layer, h, pos, zero, seq, None, ctx, aux, loads)
    return h, ctx


def decode(model, h_enc, h, pos, cut, seq, ctx=None, aux=None, loads=None, collect: Optional[list] = None):
    """Decoder over rows: h [R, T, d] (gathered from h_enc [Bs, N, d]), pos [R, T], cut [R], seq [R].
    ``collect``: a list that receives every decoder layer's output (a DSpark drafter trains on the last ones)."""
    c = model.config
    ctx = {} if ctx is None else ctx
    for layer in model.layers[c.num_encoder_layers:]:
        h = _layer(model, layer, h, pos, cut, seq, h_enc, ctx, aux, loads)
        if collect is not None:
            collect.append(h)
    return h


def forward_rows(model, ids, starts=None, aux=None, loads=None):
    """ids [B, N], starts [B] replay starts (default 0) -> final hidden [B, N, d].

    Positions >= starts[b] of row b equal forward_full(ids[b], replay_start=starts[b], return_hidden=True)'s
    hidden; earlier positions are computed with the cut at 0 and mean nothing for that replay start."""
    B, N = ids.shape
    if starts is None:
        starts = torch.zeros(B, dtype=torch.long, device=ids.device)
    starts = torch.as_tensor(starts, dtype=torch.long, device=ids.device)
    h_enc, ctx = encode(model, ids, aux, loads)
    pos = torch.arange(N, device=ids.device).expand(B, N)
    return decode(model, h_enc, h_enc, pos, starts, torch.arange(B, device=ids.device), ctx, aux, loads)


def bounded_last_hidden(model, h_enc, seq, last, rows_per_chunk: int = 4096):
    """Decoder-only bounded replay for many prompt ends at once.

    h_enc [Bs, N, d] final encoder hidden of the source sequences; seq [R], last [R]: row r is the prompt
    ids[seq[r], :last[r] + 1]. Runs the decoder over its last n_win tokens (replay start
    max(0, last + 1 - n_win), as the engine's prefill does) and returns the hidden at `last`, [R, d]:
    forward_full(ids[seq[r], :last[r] + 1], replay_start=last[r] + 1 - n_win)'s final hidden."""
    W = model.config.n_win
    dev = h_enc.device
    out = []
    for a in range(0, seq.shape[0], rows_per_chunk):
        sq, ls = seq[a:a + rows_per_chunk], last[a:a + rows_per_chunk]
        pos = ls[:, None] - (W - 1) + torch.arange(W, device=dev)[None, :]  # [r, W], negative = padding
        cut = (ls - (W - 1)).clamp(min=0)
        h = h_enc[sq[:, None], pos.clamp(min=0)]
        out.append(decode(model, h_enc, h, pos, cut, sq)[:, -1])
    return torch.cat(out) if out else h_enc.new_zeros(0, h_enc.shape[-1])


def draw_starts(B: int, N: int, n_win: int, p0: float, gen: torch.Generator) -> torch.Tensor:
    """Replay starts for a batch: 0 with probability p0, else uniform in [0, N - n_win] (CPU, int64 [B])."""
    hi = max(0, N - n_win)
    s = torch.randint(0, hi + 1, (B,), generator=gen)
    zero = torch.rand(B, generator=gen) < p0
    return torch.where(zero, torch.zeros_like(s), s)


def lm_loss(model, ids, starts, kl_weight: float = 0.1, loads=None):
    """ids [B, N + 1] (inputs and shifted targets), starts [B] -> (loss, ce, index_kl, per-layer KL dict)."""
    x, y = ids[:, :-1], ids[:, 1:]
    B, N = x.shape
    starts = torch.as_tensor(starts, dtype=torch.long, device=ids.device)
    aux = {} if kl_weight > 0 else None
    h = forward_rows(model, x, starts, aux, loads)
    keep = torch.arange(N, device=ids.device)[None, :] >= starts[:, None]  # [B, N]
    logits = model.logits(h[keep])  # [M, V] float32
    ce = F.cross_entropy(logits, y[keep])
    if aux:
        kl = torch.stack(list(aux.values())).mean()
        loss = ce + kl_weight * kl
    else:
        kl = ce.new_zeros(())
        loss = ce
    return loss, ce, kl, aux or {}


def lr_factor(progress: float, warmup: float = 0.03, final: float = 0.1) -> float:
    """Linear warmup over the first `warmup` of the run, then cosine from 1 down to `final` at progress 1."""
    p = min(max(progress, 0.0), 1.0)
    if p < warmup:
        return max(p / warmup, 1e-3)
    t = (p - warmup) / max(1e-9, 1 - warmup)
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * t))


def param_groups(model, weight_decay: float):
    """AdamW groups: decay on matrices (and the embedding), none on norms, sinks and biases."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


@torch.no_grad()
def update_gate_bias(model, loads: dict, rate: float) -> None:
    """Auxiliary-loss-free balancing: raise the selection bias of underloaded experts, lower overloaded ones."""
    if rate <= 0:
        return
    for i, ids in loads.items():
        layer = model.layers[i]
        E = layer.gate_bias.shape[0]
        counts = torch.zeros(E, device=ids.device).scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), device=ids.device))
        layer.gate_bias.add_(rate * torch.sign(counts.mean() - counts))


# ---------------------------------------------------------------- evaluation

def window_plan(L: int, N: int) -> list:
    """Windows covering a stream of L tokens: [(start, length, first scored target in the window)].

    Windows of N tokens at stride N/2; the first scores every target from index 1, each later one only
    the targets after the previous window's end, so every target 1..L-1 is scored exactly once with at
    least N/2 tokens of context (except at the start). A stream shorter than N is one window."""
    if L < 2:
        return []
    if L <= N:
        return [(0, L, 1)]
    S = max(1, N // 2)
    plan, cover, a = [], 1, 0
    while cover < L:
        a = min(a, L - N)
        plan.append((a, N, cover - a))
        cover = a + N
        a += S
    return plan


@torch.no_grad()
def eval_stream(model, stream: torch.Tensor, N: int, batch: int, modes=("exact", "bounded"),
                max_windows: Optional[int] = None) -> dict:
    """Next-token log-loss of a token stream [L] (on the model's device) under each mode.

    exact:   forward with replay start 0; every target predicted from its window's full decoder.
    bounded: every target predicted as the engine predicts the token after a prompt that ends just
             before it: the decoder sees only the last n_win tokens (replay start = prompt length - n_win;
             the least decoder context the engine ever uses, since decode steps keep that start).
    Both modes score the same targets with the same encoder context. Returns {mode: {"nats", "tokens"}}."""
    plan = window_plan(int(stream.shape[0]), N)
    if max_windows is not None:
        plan = plan[:max_windows]
    dev = stream.device
    out = {m: {"nats": 0.0, "tokens": 0} for m in modes}
    groups: dict = {}
    for w in plan:  # equal lengths batch together (only a stream shorter than N has another length)
        groups.setdefault(w[1], []).append(w)
    for n, ws in groups.items():
        for a in range(0, len(ws), batch):
            chunk = ws[a:a + batch]
            ids = torch.stack([stream[s:s + n] for s, _, _ in chunk])  # [b, n]
            seq = torch.cat([torch.full((n - f,), b, dtype=torch.long) for b, (_, _, f) in enumerate(chunk)]).to(dev)
            tgt = torch.cat([torch.arange(f, n) for _, _, f in chunk]).to(dev)  # target index in window
            labels = ids[seq, tgt]
            h_enc, ctx = encode(model, ids)
            for mode in modes:
                if mode == "exact":
                    pos = torch.arange(n, device=dev).expand(len(chunk), n)
                    zero = torch.zeros(len(chunk), dtype=torch.long, device=dev)
                    h = decode(model, h_enc, h_enc, pos, zero, torch.arange(len(chunk), device=dev), dict(ctx))
                    hs = h[seq, tgt - 1]
                else:
                    hs = bounded_last_hidden(model, h_enc, seq, tgt - 1)
                nll = F.cross_entropy(model.logits(hs).float(), labels, reduction="sum")
                out[mode]["nats"] += float(nll)
                out[mode]["tokens"] += int(labels.numel())
    return out


def summarize(res: dict, n_bytes: int) -> dict:
    """{mode: {nats, tokens}} -> add nats/token and bits/byte (total nats / ln 2 / UTF-8 bytes)."""
    out = {}
    for mode, r in res.items():
        t = max(1, r["tokens"])
        out[mode] = {"nats_per_token": r["nats"] / t, "bits_per_byte": r["nats"] / math.log(2) / max(1, n_bytes),
                     "tokens": r["tokens"], "total_nats": r["nats"]}
    return out


# ---------------------------------------------------------------- checkpoints

def save_checkpoint(model, out_dir, extra_config: Optional[dict] = None, max_shard_bytes: int = 15 * 10**6,
                    dtype=torch.bfloat16) -> dict:
    """Write config.json and the weights in `dtype` as model.safetensors, or as shards
    model-0000i-of-0000n.safetensors plus model.safetensors.index.json when one file would exceed
    max_shard_bytes. Removes weights of an earlier save in out_dir. Returns {files, bytes, params}."""
    root = Path(out_dir)
    tensors = {n: t.detach().to(dtype).cpu().contiguous() for n, t in model.hf_state_dict().items()}
    files, total = write_safetensors(tensors, root, max_shard_bytes)
    cfg = {**model.config.to_hf(), **(extra_config or {})}
    (root / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"files": files, "bytes": total, "params": sum(t.numel() for t in tensors.values()),
            "file_bytes": {f: (root / f).stat().st_size for f in files}}


def write_safetensors(tensors: dict, root, max_shard_bytes: int) -> tuple:
    """Write ``tensors`` (CPU, contiguous) as model.safetensors, or as shards model-0000i-of-0000n.safetensors
    plus model.safetensors.index.json when one file would exceed max_shard_bytes; removes weights of an earlier
    save in root. Returns (file names, total bytes)."""
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for old in list(root.glob("model*.safetensors")) + list(root.glob("model.safetensors.index.json")):
        old.unlink()
    nbytes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    total = sum(nbytes.values())
    budget = max_shard_bytes - 64 * 1024  # room for the JSON header
    shards, cur, size = [], {}, 0
    for n, t in tensors.items():
        if cur and size + nbytes[n] > budget:
            shards.append(cur)
            cur, size = {}, 0
        cur[n] = t
        size += nbytes[n]
    if cur:
        shards.append(cur)
    meta = {"format": "pt"}
    files = []
    if len(shards) == 1:
        save_file(shards[0], str(root / "model.safetensors"), metadata=meta)
        files.append("model.safetensors")
    else:
        weight_map = {}
        for k, sh in enumerate(shards, 1):
            name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(sh, str(root / name), metadata=meta)
            files.append(name)
            weight_map.update({n: name for n in sh})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for f in files:
        (root / f).chmod(0o644)  # safetensors writes 0600
    return files, total
