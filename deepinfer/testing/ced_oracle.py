"""An independent oracle of the CED forward (DeepSeek-V4.1-Flash), written from /work/shared/CED.md and
docs/decisions.md alone: plain, dense, float64, whole sequence, explicit masks, no paging, no rings.

It shares no function with ``deepinfer.models`` or ``deepinfer.backends`` (tests/test_ced_oracle.py reads its
imports): the weights are a plain dict of tensors under the checkpoint's names (``load_ced_checkpoint`` reads
config.json and model.safetensors, or pass ``model.hf_state_dict()``), the config a plain dict (config.json).
A mistake in the CED arithmetic of the engine therefore cannot appear on both sides.

    oracle = CEDOracle(weights, config)
    run = oracle(tokens, replay_start=s, fake_quant=True)  # run.logits [N - s, V] float64, positions s..N-1

With ``fake_quant=False`` (the default) nothing is rounded. With ``fake_quant=True`` the three caches' storage
formats are applied where the spec stores them (``quantize`` below, written from the format definitions):
SWA KV in FP8 E4M3 with a power-of-two scale per 32 channels, global KV in FP4 E2M1 with an E4M3 scale per 16
channels, indexer keys in MXFP4 (``fp32`` / ``bf16`` round to that dtype). The engine always stores its caches
in these formats, so it is compared with ``fake_quant=True``.

Besides the logits, a run records every discrete choice, per layer and query position (``run.layers[l]``):
the indexer's scores, what was allowed and the chosen top-K entry ids (full and reindex layers), the
decoder's candidate pool and its block scores (the decoder's full layer), the experts chosen and every
expert's selection score; and every quantized vector, with its input and the position where it is computed
(``run.quant``), so a test can tell a near-tie from a real difference.

The function, as CED.md and decisions.md state it
--------------------------------------------------
- L layers, the first ``num_encoder_layers`` the encoder. Every layer: x = RMSNorm(h); attention; h += out;
  h += MoE(RMSNorm(h)). Final RMSNorm and the LM head (the embedding when ``tie_word_embeddings``).
- Query: W_qa, RMSNorm, W_qb -> H heads of the latent width D; RoPE on the last ``rope_dim`` channels,
  adjacent pairs. K = V = one shared latent (MQA): the SWA latent is RoPE(RMSNorm(W_kv x)).
- One softmax per query over its SWA keys (positions in [max(cut, i - n_win + 1), i]), its top-K compressed
  entries and the sink (a learned logit per head that only joins the denominator). Inverse RoPE on the
  attended latent, then the grouped projection (``out_groups`` groups of consecutive heads) and the final one.
- Compressor (full layers, ratio m: encoder ``encoder_ratio``, decoder ``decoder_ratio``): non-overlapping
  groups of m tokens, entry j = RMSNorm(sum_t softmax_over_group(W_z x_t) * W_kv x_t) (channel-wise; for m = 1
  RMSNorm(W_kv x)); an incomplete trailing group is not emitted; entry j is visible to query i iff
  j < floor((i + 1) / m); its RoPE position is j * m. It shares W_kv and its RMSNorm with the SWA latent
  (decisions.md). Indexer keys: the same grouping of W_ik x with their own gate W_zi; no norm, no RoPE.
- Indexer: q_h from the query latent (after W_qa and its norm) by W_iq; w_h = (W_iw x)_h * index_heads^-0.5
  (decisions.md); score(i, j) = sum_h w_h ReLU(q_h . k_j); top-K of the allowed entries, ties toward the lower
  entry id, -1 padding when fewer are allowed.
- Modes: full (own entries, indexer K and Q, fresh top-K), reindex (the latest full layer's entries and
  indexer K of the same part, own Q, fresh top-K), reuse (the latest full layer's entries, the latest full or
  reindex layer's top-K of the same part), swa (no global branch).
- Decoder: its full layer (the first decoder layer) compresses the final encoder state of every token
  (normed by its own attention norm) and builds, per query, the candidate pool: blocks of ``pool_block``
  entries scored by their best visible score, the ``pool_blocks`` best kept, the newest block always among
  them; a decoder reindex layer picks its top-K only from that pool.
- Replay: the decoder runs over positions >= s only (bounded: s = N - n_win, exact: s = 0) and its SWA is cut
  at s; the encoder runs over every token with no cut.
- MoE: router logits x W_g; score = sqrt(softplus(logits)); top-k on score + bias (the bias only chooses);
  weights = the chosen scores / their sum x ``routed_scaling_factor``; SwiGLU experts silu(min(g, c)) *
  clamp(u, -c, c) with c = ``swiglu_limit``; plus the shared expert (width moe_intermediate_size x
  n_shared_experts) with the same clamp.

Points CED.md and decisions.md leave open, as the engine decided them (read from its code, written anew here)
-----------------------------------------------------------------------------------------------------
- RMSNorm: x * (mean(x^2) + eps)^-1/2 * w, eps = ``rms_norm_eps``, everywhere (query latent, latent, entries).
- RoPE frequencies theta^(-2k / rope_dim) for pair k of the rotary channels; a pair (a, b) turns into
  (a cos - b sin, b cos + a sin); the inverse rotates by -pos, at the query's own position.
- Attention scale head_dim^-1/2. Quantization happens after RoPE (SWA and global KV), and the attention
  reads the rounded values; the indexer keys are quantized after the compressor.
- A full layer compresses its own attention input (the attention RMSNorm of its hidden states; for the
  decoder's full layer, of the final encoder states); the gate weights W_z and W_zi exist only for m > 1; the
  entries' RMSNorm comes after the weighted sum.
- The candidate pool's blocks are blocks of entries (entry ids j // pool_block); the newest block is the one
  holding the last visible entry; a block with no visible entry is never kept; among equal block scores the
  lower block wins. The pool is built from the full layer's own visible scores.
- The expert weights' renormalisation divides by (sum + 1e-20); the router runs in at least float32 (here
  float64); top-k on selection scores, ties unspecified (a test treats them as near-ties).
- Format details (backends/reference/lowbit.py's definitions, written anew in ``quantize``): rounding to the
  nearest code, ties to the even code; the FP4 scale is amax / 6 rounded up onto the E4M3 grid (so the group
  maximum never clips), with no second-level scale; MXFP4's shared exponent is floor(log2 amax) - 2 with
  values saturating at +-6; the FP8 scale is the smallest power of two that brings amax within 448.
- Weight layouts (the checkpoint's): w13 [E, 2F, d] (gate rows, then up rows), w2 [E, d, F]; shared_w13
  [2F_s, d]; wo_a [G, group_dim, H/G x D]; wq_b [H x D, q_lora] (head-major); wiq [nh x dh, q_lora].
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

F64 = torch.float64

# The config fields the oracle reads (config.json names).
CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_encoder_layers", "num_heads", "head_dim",
                 "rope_dim", "rope_theta", "q_lora_rank", "out_groups", "n_win", "layer_modes", "encoder_ratio",
                 "decoder_ratio", "index_heads", "index_head_dim", "index_topk", "pool_block", "pool_blocks",
                 "use_sink", "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "swiglu_limit",
                 "rms_norm_eps", "tie_word_embeddings", "global_kv_format", "index_k_format", "swa_kv_format",
                 "replay_mode")


def load_ced_checkpoint(path) -> tuple:
    """(weights, config) of a checkpoint directory: every tensor of model*.safetensors, and config.json."""
    from safetensors.torch import load_file

    d = Path(path)
    config = json.loads((d / "config.json").read_text())
    weights = {}
    for f in sorted(d.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return weights, config


# --------------------------------------------------------------------------------------------------------
# Storage formats, from their definitions (all in float64; every representable value is exact in it).

def _e4m3_values() -> torch.Tensor:
    """Every non-negative finite float8 E4M3 (fn) value, ascending: exponent bias 7, 3 mantissa bits,
    subnormals m/8 * 2^-6, the top code (exponent 15, mantissa 7) is NaN, so the largest is 448."""
    vals = [m / 8 * 2.0 ** -6 for m in range(8)]
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return torch.tensor(vals, dtype=F64)


def _round_e4m3(q: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3 value, ties to an even mantissa, saturating at +-448."""
    a = q.abs()
    _, e = torch.frexp(a)  # a = f * 2^e, f in [0.5, 1): the binade [2^(e-1), 2^e) has step 2^(e-1-3)
    step = torch.pow(2.0, (e - 4).clamp(min=-9).to(F64))  # subnormals (a < 2^-6): step 2^-9
    r = torch.round(a / step) * step  # torch.round: half to even, = even mantissa bit
    return torch.copysign(r.clamp(max=448.0), q)


def _round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP4 E2M1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even code, saturating at
    +-6. Codes are evenly spaced within [0, 2) (step 0.5), [2, 4) (step 1) and [4, 6] (step 2), and the code's
    parity is that of the multiple of the step."""
    a = q.abs().clamp(max=6.0)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(F64)
    r = torch.round(a / step) * step
    return torch.copysign(r, q)


def _groups(x: torch.Tensor, g: int) -> torch.Tensor:
    if x.shape[-1] % g:
        raise ValueError(f"{x.shape[-1]} channels are not a multiple of the format's group of {g}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Store x [..., C] in ``fmt`` and read it back, in float64: the value the cache holds.

    - fp8_e4m3_pow2: per 32 channels a power-of-two scale 2^k, k the smallest integer with amax / 2^k <= 448
      (clamped to [-127, 127]); values x / 2^k rounded to E4M3.
    - fp4_e2m1_e4m3: per 16 channels a scale s, the smallest E4M3 value with 6 s >= amax (at most 448); values
      x / s rounded to E2M1 (saturating).
    - mxfp4 (OCP MX): per 32 channels the scale 2^(floor(log2 amax) - 2) (exponent clamped to [-127, 127]);
      values x / scale rounded to E2M1, saturating at +-6.
    - fp32 / bf16: rounded to that dtype.
    An all-zero group reads back as zeros.
    """
    x = x.to(F64)
    if fmt == "fp32":
        return x.float().to(F64)
    if fmt == "bf16":
        return x.bfloat16().to(F64)
    if fmt == "fp8_e4m3_pow2":
        xg = _groups(x, 32)
        amax = xg.abs().amax(-1, keepdim=True)
        k = torch.ceil(torch.log2(torch.where(amax > 0, amax, 1.0) / 448.0))
        k = k + (amax / torch.pow(2.0, k) > 448).to(F64) - (amax / torch.pow(2.0, k - 1) <= 448).to(F64)
        scale = torch.pow(2.0, k.clamp(-127, 127))
        y = _round_e4m3(xg / scale) * scale
    elif fmt == "fp4_e2m1_e4m3":
        xg = _groups(x, 16)
        amax = xg.abs().amax(-1, keepdim=True)
        grid = _e4m3_values().to(x.device)
        first = (6 * grid < amax).sum(-1, keepdim=True).clamp(max=grid.numel() - 1)  # first s with 6 s >= amax
        scale = grid[first]
        safe = torch.where(scale > 0, scale, 1.0)
        y = _round_e2m1(xg / safe) * scale
    elif fmt == "mxfp4":
        xg = _groups(x, 32)
        amax = xg.abs().amax(-1, keepdim=True)
        _, e = torch.frexp(torch.where(amax > 0, amax, 1.0))  # floor(log2(amax)) = e - 1
        scale = torch.pow(2.0, (e - 3).clamp(-127, 127).to(F64))
        y = torch.where(amax > 0, _round_e2m1(xg / scale) * scale, 0.0)
    else:
        raise ValueError(f"unknown KV format {fmt!r}")
    return y.reshape(x.shape)


# --------------------------------------------------------------------------------------------------------
# The model.

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, R: int, theta: float, sign: float = 1.0) -> torch.Tensor:
    """Rotate adjacent pairs (2k, 2k+1) of the last R channels of x [T, ..., D] by sign * pos * theta^(-2k/R)."""
    k = torch.arange(R // 2, dtype=F64)
    ang = sign * pos.to(F64)[:, None] * theta ** (-2.0 * k / R)[None, :]  # [T, R/2]
    ang = ang.reshape(ang.shape[0], *([1] * (x.dim() - 2)), R // 2)
    c, s = torch.cos(ang), torch.sin(ang)
    head, tail = x[..., : x.shape[-1] - R], x[..., x.shape[-1] - R:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    rot = torch.empty_like(tail)
    rot[..., 0::2] = a * c - b * s
    rot[..., 1::2] = b * c + a * s
    return torch.cat([head, rot], dim=-1)


def _topk_ids(scores: torch.Tensor, allowed: torch.Tensor, K: int) -> torch.Tensor:
    """Per row the K allowed entries of highest score, ties toward the lower id, -1 padding: [T, K]."""
    T, J = scores.shape
    out = torch.full((T, K), -1, dtype=torch.long)
    for i, (row, ok) in enumerate(zip(scores.tolist(), allowed.tolist())):
        ids = sorted((j for j in range(J) if ok[j]), key=lambda j: (-row[j], j))[:K]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def _pool(scores: torch.Tensor, visible: torch.Tensor, block: int, nblocks: int) -> tuple:
    """The decoder's candidate pool: ([T, J] bool, block scores [T, nb] with -inf for blocks with nothing
    visible)."""
    T, J = scores.shape
    nb = -(-J // block)
    pool = torch.zeros(T, J, dtype=torch.bool)
    bscore = torch.full((T, nb), -math.inf, dtype=F64)
    for i, (row, ok) in enumerate(zip(scores.tolist(), visible.tolist())):
        vis = [j for j in range(J) if ok[j]]
        if not vis:
            continue
        best = [-math.inf] * nb
        for j in vis:
            best[j // block] = max(best[j // block], row[j])
        newest = vis[-1] // block
        rest = sorted((b for b in range(nb) if b != newest and best[b] > -math.inf), key=lambda b: (-best[b], b))
        for b in [newest] + rest[: nblocks - 1]:
            for j in range(b * block, min(J, (b + 1) * block)):
                pool[i, j] = ok[j]
        bscore[i] = torch.tensor(best, dtype=F64)
    return pool, bscore


@dataclass
class OracleRun:
    """What one oracle forward computed. ``logits`` [N - s, V] and ``hidden`` [N - s, d] (the final state
    before the norm) cover positions s..N-1; ``encoder_hidden`` [N, d] every position. ``layers[l]``: dict with
    ``pos`` [T] (the pass's query positions) and, as the layer has them: ``index_scores`` [T, J] and ``allowed``
    [T, J] (what top-K could pick), ``topk`` [T, K] (the entry ids attended; a reuse layer's are its source's),
    ``chooses_topk`` (bool: a fresh top-K), ``pool`` [T, J], ``block_scores`` [T, nb] and ``pool_block`` (the
    decoder's full layer), ``experts`` [T, k] and ``expert_scores`` [T, E] (selection scores: score + bias), ``ratio``.
    ``quant``: one dict per stored vector kind and layer: ``layer``, ``kind`` (swa, kv, ik), ``fmt``, ``pos``
    [n] (the position whose computation produces each row: its own for SWA, (j + 1) m - 1 for entry j),
    ``x`` [n, C] (before rounding) and ``y`` [n, C] (as stored; equal to x without fake_quant)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    encoder_hidden: torch.Tensor
    replay_start: int
    layers: dict = field(default_factory=dict)
    quant: list = field(default_factory=list)


class CEDOracle:
    def __init__(self, weights: dict, config: dict):
        missing = [k for k in CONFIG_FIELDS if k not in config]
        if missing:
            raise KeyError(f"CED config lacks {missing}")
        self.c = {k: config[k] for k in CONFIG_FIELDS}
        self.c["layer_modes"] = tuple(self.c["layer_modes"])
        self.w = {k: v.detach().to("cpu", F64) for k, v in weights.items()}

    # Which layer a reuse / reindex layer reads.
    def _part(self, l: int) -> range:
        E = self.c["num_encoder_layers"]
        return range(0, E) if l < E else range(E, self.c["num_layers"])

    def _latest(self, l: int, modes: tuple, inclusive: bool) -> int:
        part = self._part(l)
        for i in range(l if inclusive else l - 1, part.start - 1, -1):
            if self.c["layer_modes"][i] in modes:
                return i
        raise ValueError(f"layer {l} ({self.c['layer_modes'][l]}) has no earlier {modes} layer in its part")

    def _q(self, x, fmt, on):
        return quantize(x, fmt) if on else x

    def __call__(self, tokens, replay_start: int = 0, fake_quant: bool = False) -> OracleRun:
        c, W = self.c, self.w
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        N = ids.numel()
        s = max(0, min(int(replay_start), N - 1))
        E = c["num_encoder_layers"]
        run = OracleRun(None, None, None, s)
        state: dict = {}  # per layer: entries, index keys, topk, pool
        h = W["embed.weight"][ids]
        pos = torch.arange(N)
        for l in range(E):
            h = self._layer(l, h, pos, 0, h, state, run, fake_quant)
        run.encoder_hidden = h
        hd = h[s:]
        for l in range(E, c["num_layers"]):
            hd = self._layer(l, hd, pos[s:], s, run.encoder_hidden, state, run, fake_quant)
        run.hidden = hd
        head = W["embed.weight"] if c["tie_word_embeddings"] else W["lm_head"]
        run.logits = _rms(hd, W["norm"], c["rms_norm_eps"]) @ head.T
        return run

    def _layer(self, l, h, qpos, cut, h_src, state, run, fq):
        """h [T, d] at positions qpos (contiguous, from cut); h_src [N, d] what a full layer compresses."""
        c, W = self.c, self.w
        p = f"layers.{l}."
        mode = c["layer_modes"][l]
        m = c["encoder_ratio"] if l < c["num_encoder_layers"] else c["decoder_ratio"]
        T, H, D, R = h.shape[0], c["num_heads"], c["head_dim"], c["rope_dim"]
        eps, theta = c["rms_norm_eps"], c["rope_theta"]
        rec = {"pos": qpos.clone(), "ratio": m}
        run.layers[l] = rec

        x = _rms(h, W[p + "attn_norm"], eps)
        cq = _rms(x @ W[p + "wq_a"].T, W[p + "q_norm"], eps)
        q = _rope((cq @ W[p + "wq_b"].T).reshape(T, H, D), qpos, R, theta)
        kv_raw = _rope(_rms(x @ W[p + "wkv"].T, W[p + "kv_norm"], eps), qpos, R, theta)
        kv = self._q(kv_raw, c["swa_kv_format"], fq)
        run.quant.append(dict(layer=l, kind="swa", fmt=c["swa_kv_format"], pos=qpos.clone(), x=kv_raw, y=kv))

        # SWA keys: the pass's own latents at positions in [max(cut, i - n_win + 1), i].
        kp, ip = qpos[None, :], qpos[:, None]
        swa_mask = (kp <= ip) & (kp > ip - c["n_win"]) & (kp >= cut)  # [T, T]

        if mode == "swa":
            ents = torch.zeros(0, D, dtype=F64)
            sel = torch.zeros(T, 0, dtype=torch.bool)
        else:
            if mode == "full":
                state[l] = self._compress(l, m, h_src, fq, run)
            src = self._latest(l, ("full",), inclusive=True)
            ents, ikeys = state[src]["entries"], state[src]["ikeys"]
            J = ents.shape[0]
            visible = torch.arange(J)[None, :] < torch.div(qpos + 1, m, rounding_mode="floor")[:, None]  # [T, J]
            if mode in ("full", "reindex"):
                iq = (cq @ W[p + "wiq"].T).reshape(T, c["index_heads"], c["index_head_dim"])
                iw = (x @ W[p + "wiw"].T) * c["index_heads"] ** -0.5
                scores = (iw[:, :, None] * torch.relu(torch.einsum("thd,jd->thj", iq, ikeys))).sum(1)  # [T, J]
                allowed = visible
                if l >= c["num_encoder_layers"] and mode == "reindex":
                    allowed = visible & state[src]["pool"]
                topk = _topk_ids(scores, allowed, c["index_topk"])
                if l >= c["num_encoder_layers"] and mode == "full":
                    state[l]["pool"], rec["block_scores"] = _pool(scores, visible, c["pool_block"], c["pool_blocks"])
                    rec["pool"], rec["pool_block"] = state[l]["pool"], c["pool_block"]
                state[l] = dict(state.get(l, {}), topk=topk)
                rec.update(index_scores=scores, allowed=allowed, chooses_topk=True)
            else:
                topk = state[self._latest(l, ("full", "reindex"), inclusive=False)]["topk"]
                rec["chooses_topk"] = False
            rec["topk"] = topk
            sel = torch.zeros(T, J + 1, dtype=torch.bool)
            sel.scatter_(1, torch.where(topk >= 0, topk, J), True)  # -1 padding lands in the extra column
            sel = sel[:, :J]

        # One softmax over SWA keys, selected entries and the sink; K = V = the latent.
        keys = torch.cat([kv, ents], dim=0)  # [T + J, D]
        mask = torch.cat([swa_mask, sel], dim=1)  # [T, T + J]
        logit = torch.einsum("thd,kd->thk", q, keys) * D ** -0.5
        logit = logit.masked_fill(~mask[:, None, :], -math.inf)
        if c["use_sink"]:
            sink = W[p + "sink"][None, :, None].expand(T, H, 1)
            mx = torch.maximum(logit.amax(-1, keepdim=True), sink)
            e = torch.exp(logit - mx)
            prob = e / (e.sum(-1, keepdim=True) + torch.exp(sink - mx))
        else:
            mx = logit.amax(-1, keepdim=True)
            e = torch.exp(logit - mx)
            prob = e / e.sum(-1, keepdim=True)
        o = torch.einsum("thk,kd->thd", prob, keys)  # [T, H, D]
        o = _rope(o, qpos, R, theta, sign=-1.0)
        G = c["out_groups"]
        og = o.reshape(T, G, (H // G) * D)
        y = torch.einsum("tgi,goi->tgo", og, W[p + "wo_a"]).reshape(T, -1) @ W[p + "wo_b"].T
        h = h + y
        return h + self._moe(l, _rms(h, W[p + "ffn_norm"], eps), rec)

    def _compress(self, l, m, h_src, fq, run) -> dict:
        """Entries and indexer keys of the complete groups of m tokens of h_src [N, d] (normed by this layer's
        attention norm)."""
        c, W = self.c, self.w
        p = f"layers.{l}."
        eps = c["rms_norm_eps"]
        xs = _rms(h_src, W[p + "attn_norm"], eps)
        J = xs.shape[0] // m
        xs = xs[: J * m]
        v, ik = xs @ W[p + "wkv"].T, xs @ W[p + "wik"].T
        if m > 1:
            def pool(val, gate):  # channel-wise softmax over each group's m tokens (J may be 0: explicit widths)
                z = (xs @ gate.T).reshape(J, m, gate.shape[0])
                return (torch.softmax(z, dim=1) * val.reshape(J, m, val.shape[-1])).sum(1)

            v, ik = pool(v, W[p + "wz"]), pool(ik, W[p + "wzi"])
        jpos = torch.arange(J) * m
        e_raw = _rope(_rms(v, W[p + "kv_norm"], eps), jpos, c["rope_dim"], c["rope_theta"])
        ents = self._q(e_raw, c["global_kv_format"], fq)
        ikeys = self._q(ik, c["index_k_format"], fq)
        done = (torch.arange(J) + 1) * m - 1  # the position that completes entry j
        run.quant.append(dict(layer=l, kind="kv", fmt=c["global_kv_format"], pos=done, x=e_raw, y=ents))
        run.quant.append(dict(layer=l, kind="ik", fmt=c["index_k_format"], pos=done, x=ik, y=ikeys))
        return {"entries": ents, "ikeys": ikeys}

    def _moe(self, l, x, rec) -> torch.Tensor:
        c, W = self.c, self.w
        p = f"layers.{l}."
        lim, k = c["swiglu_limit"], c["num_experts_per_tok"]
        score = torch.sqrt(torch.nn.functional.softplus(x @ W[p + "gate"].T))  # [T, E]
        choose = score + W[p + "gate_bias"]
        experts = torch.sort(choose, dim=-1, descending=True, stable=True).indices[:, :k]  # [T, k]
        wsel = score.gather(1, experts)
        wsel = wsel / (wsel.sum(-1, keepdim=True) + 1e-20) * c["routed_scaling_factor"]
        rec.update(experts=experts, expert_scores=choose)

        def swiglu(x, w13, w2):
            g, u = (x @ w13.T).chunk(2, dim=-1)
            return (torch.nn.functional.silu(g.clamp(max=lim)) * u.clamp(-lim, lim)) @ w2.T

        mix = torch.zeros(x.shape[0], c["n_routed_experts"], dtype=F64).scatter(1, experts, wsel)  # [T, E]
        y = torch.zeros_like(x)
        for e in range(c["n_routed_experts"]):  # dense: every expert on every token, weight 0 where not chosen
            y = y + mix[:, e : e + 1] * swiglu(x, W[p + "w13"][e], W[p + "w2"][e])
        if p + "shared_w13" in W:
            y = y + swiglu(x, W[p + "shared_w13"], W[p + "shared_w2"])
        return y


__all__ = ["CEDOracle", "OracleRun", "load_ced_checkpoint", "quantize"]
