"""DeepSeek-V3's multi-token-prediction (MTP) module, run as a drafter (the ``mtp`` draft stage, stages/mtp_draft.py).

Checkpoint layout: module j is ``model.layers.{num_hidden_layers + j}.*``: ``enorm``, ``hnorm``, ``eh_proj``
[d, 2d], one decoder block under the target's own names (MLA, then MoE when ``mlp.gate.weight`` is stored, else a
dense MLP), ``shared_head.norm`` and ``shared_head.head`` [V, d] (the target's LM head when it is not stored). Its
``embed_tokens`` copy is not read: DeepSeek-V3 shares the embedding with the target, whose table is used.

One step, as DeepSeek-V3's paper and vLLM compute it, at position t with the target's final (normed) hidden state
h_t and the token after it x_{t+1}:

    z_t = eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)));  o_t = block(z_t);  logits_t = head(norm(o_t))

and logits_t predicts x_{t+2}. The block attends causally over the module's own earlier positions. Drafts past
the first chain the module on its own output (h := o_t, the next token := the draft), as vLLM reuses it k times.
Only the first module is used (DeepSeek-V3 has one).

The block's KV (the latent rows (c_kv, k_pe) of the target's MLA cache) lives in a compact per-sequence
``MTPCache``: rows for positions base .. base + length - 1, plus the target's hidden states of the positions it
has computed since (``observe``), consumed at the next draft. Rolling back is a number, as for the target: rows
past ``length`` (drafted positions) are overwritten by later steps. See docs/decisions.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from .deepseek import DecoderLayer, DeepseekForCausalLM
from .llama import RMSNorm
from .moe import MoEBlock
from .weights import FusedCheckpoint

log = logging.getLogger(__name__)


class MTPLayer(DecoderLayer):
    """One MTP module: the decoder block (DecoderLayer's own parameters and checkpoint names) plus its
    input norms and projection and its shared head."""

    def __init__(self, c, layer: int, rotary, ops, moe: bool, own_head: bool, moe_impl: str):
        super().__init__(attrs.evolve(c, moe_layers=(layer,) if moe else ()), layer, rotary, ops, None, moe_impl)
        d = c.hidden_size
        self.enorm = RMSNorm(d, c.rms_eps, ops)
        self.hnorm = RMSNorm(d, c.rms_eps, ops)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, c.rms_eps, ops)
        self.shared_head.head = nn.Linear(d, c.vocab_size, bias=False) if own_head else None


def latent_attention(q, keys, r: int, scale: float, offset: int):
    """Causal MQA over one sequence's latent rows: q [T, H, r + rope] at rows offset .. offset + T - 1,
    keys [S, r + rope] (value: the first r entries). Returns P @ c_kv [T, H, r]."""
    T, S = q.shape[0], keys.shape[0]
    scores = torch.einsum("thc,sc->ths", q.float(), keys.float()) * scale  # [T, H, S]
    allowed = torch.arange(S, device=q.device)[None, :] <= offset + torch.arange(T, device=q.device)[:, None]
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("ths,sr->thr", scores.softmax(dim=-1), keys[:, :r].float()).to(q.dtype)


@attrs.define(eq=False)
class MTPCache:
    """One sequence's MTP state. kv [capacity, r + rope]: rows for positions base .. base + length - 1 (row
    i = position base + i); hidden [P, d]: the target's hidden states at positions base + length .. (observed,
    not yet consumed)."""

    kv: torch.Tensor
    hidden: torch.Tensor
    base: int = 0
    length: int = 0

    def observe(self, start: int, rows: torch.Tensor) -> None:
        """The target computed positions start .. start + len(rows) - 1 (those it kept) with these hidden states."""
        end = self.base + self.length
        if start < self.base or start > end + self.hidden.shape[0]:
            # Recomputed from before what we hold (preemption), or positions we never saw (a prefix-cache
            # hit): start over there; earlier positions have no MTP rows.
            self.base, self.length, self.hidden = start, 0, rows
        elif start < end:  # recomputed positions we hold rows for
            self.length, self.hidden = start - self.base, rows
        else:
            self.hidden = torch.cat([self.hidden[:start - end], rows])

    def reserve(self, rows: int) -> None:
        if rows > self.kv.shape[0]:
            grown = self.kv.new_empty(max(rows, 2 * self.kv.shape[0]), self.kv.shape[1])
            grown[:self.length] = self.kv[:self.length]
            self.kv = grown


class DeepseekMTP(FusedCheckpoint, nn.Module):
    """The target's first MTP module with the checkpoint's names (``model.layers.{N}.*``); the target's
    embedding and rotary tables are borrowed, not owned."""

    FUSED = DeepseekForCausalLM.FUSED

    def __init__(self, target, names: set):
        super().__init__()
        c = target.config
        i = c.num_layers
        self.config, self.arch, self.lm_head = c, f"{target.arch} MTP", None
        self._host = (target,)  # a tuple: not a submodule, so its weights are not ours
        prefix = f"model.layers.{i}."
        impl = next((m.impl for m in target.modules() if isinstance(m, MoEBlock)), "routed")
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(i): MTPLayer(
            c, i, target.model.rotary, target.ops, moe=prefix + "mlp.gate.weight" in names,
            own_head=prefix + "shared_head.head.weight" in names, moe_impl=impl)})

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[str(self.config.num_layers)]

    def _fused_splits(self, fused: str) -> list:
        return [self.config.intermediate_size] * 2

    def new_cache(self, start: int, rows: torch.Tensor) -> MTPCache:
        c = self.config
        kv = rows.new_empty(64, c.kv_lora_rank + c.qk_rope_head_dim, dtype=self.layer.eh_proj.weight.dtype)
        return MTPCache(kv, rows, base=start)

    def step(self, cache: MTPCache, h: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The module at positions start .. start + T - 1 from the hidden states h [T, d] there and the tokens
        ids [T] after them: writes their KV rows and returns the block outputs o [T, d]."""
        layer, T = self.layer, h.shape[0]
        embed = self._host[0].model.embed_tokens
        z = layer.eh_proj(torch.cat([layer.enorm(embed(ids)), layer.hnorm(h.to(embed.weight.dtype))], dim=-1))
        positions = torch.arange(start, start + T, device=h.device)
        lo = start - cache.base
        cache.reserve(lo + T)

        def attend(attn, x):
            q, rows = attn.latent(x, positions)
            cache.kv[lo:lo + T] = rows.to(cache.kv.dtype)
            return attn.latent_out(latent_attention(q, cache.kv[:lo + T], attn.r, attn.scale, lo))

        x, residual = layer(z, None, attend)
        return x + residual

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        """Draft logits [T, V] (float32) of block outputs o [T, d]."""
        head = self.layer.shared_head
        x = head.norm(o)
        return F.linear(x, head.head.weight).float() if head.head is not None else self._host[0].compute_logits(x)

    def draft(self, cache: MTPCache, token_ids: list, computed: int, k: int, pick: Callable) -> tuple:
        """Up to k drafts after token_ids[-1] (position ``computed``, the sequence's last token) and their logits
        [k, V]; pick(logits [V]) -> token chooses each. Rows for the positions observed since the last draft are
        written first; the last one (position computed - 1) stays pending with its hidden state, so a repeated
        draft recomputes it. ([], None) when the target's hidden states there were not observed."""
        end = cache.base + cache.length
        if cache.hidden.shape[0] == 0 or end + cache.hidden.shape[0] != computed:
            return [], None
        ids = torch.tensor(token_ids[end + 1:computed + 1], device=cache.hidden.device)
        o = self.step(cache, cache.hidden, ids, end)[-1:]
        cache.length, cache.hidden = computed - 1 - cache.base, cache.hidden[-1:]
        tokens, logits = [], []
        for j in range(k):
            lg = self.logits(o)[0]
            tokens.append(pick(lg))
            logits.append(lg)
            if j + 1 < k:  # rows past cache.length: drafted positions, overwritten by later steps
                o = self.step(cache, o, torch.tensor([tokens[-1]], device=o.device), computed + j)
        return tokens, torch.stack(logits)


def load_mtp(target, path, fp8_experts: str = "fp8") -> DeepseekMTP:
    """The target's first MTP module with its weights from checkpoint ``path`` (only its tensors are read; FP8
    ones dequantized, or kept FP8 for the experts as the target's are). A ValueError naming the checkpoint
    when it has none."""
    from .loader import fp8_targets, iter_weights, load_config, tensor_names
    from .quant import fp8_block_size, store_experts_fp8

    if not isinstance(target, DeepseekForCausalLM):
        raise ValueError(f"speculative_config method='mtp' drafts with DeepSeek-V3's multi-token-prediction "
                         f"layers; the model {path} is a {type(target).__name__}")
    if path is None:
        raise ValueError("speculative_config method='mtp' reads the MTP layers from the target's checkpoint "
                         "directory, which is not known here")
    path, c = Path(path), target.config
    prefix = f"model.layers.{c.num_layers}."
    if c.num_mtp_layers < 1:
        raise ValueError(f"speculative_config method='mtp': checkpoint {path} has no multi-token-prediction layers "
                         f"(config.json num_nextn_predict_layers={c.num_mtp_layers})")
    names = tensor_names(path)
    if not any(n.startswith(prefix) for n in names):
        raise ValueError(f"speculative_config method='mtp': checkpoint {path} declares num_nextn_predict_layers="
                         f"{c.num_mtp_layers} but stores no {prefix}* tensors (its MTP layers were left out)")
    if c.num_mtp_layers > 1:
        log.info("%s: %d MTP modules; drafting chains the first", path, c.num_mtp_layers)
    hf = load_config(path)
    dtype, device = target.model.embed_tokens.weight.dtype, target.model.embed_tokens.weight.device
    with torch.device("meta"):
        mtp = DeepseekMTP(target, names)
    mtp = mtp.to(dtype)
    block = fp8_block_size(hf)
    if block is not None and fp8_experts == "fp8":
        store_experts_fp8(mtp, block)
    mtp = mtp.to_empty(device=device)
    shared = prefix + "embed_tokens."
    mtp.load_weights(iter_weights(path, hf, keep_fp8=fp8_targets(mtp),
                                  select=lambda n: n.startswith(prefix) and not n.startswith(shared)))
    return mtp.eval().requires_grad_(False)
