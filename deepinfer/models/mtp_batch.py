"""MTP drafting for every sequence of a step at once: one batched forward of the module per draft position.

``draft_batch`` does what ``DeepseekMTP.draft`` (its oracle, one sequence at a time) does for each sequence:
first the positions observed since the sequence's last draft (ragged: 1 + its accepted drafts), then k - 1 chain
steps of one token each. The sequences' compact MTP caches are laid side by side once per call in a padded
buffer [B, S, r + rope] (row i of sequence b = position base_b + i); every forward writes its new rows there by
index and attends each token over its own sequence's rows up to its own; the new rows go back into the caches
at the end. Drafted tokens reach the host in one copy.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..backends.base import to_device


def _attention(q, keys, seq, rows, r: int, scale: float):
    """Each token's causal MQA over its own sequence's latent rows: q [N, H, r + rope], keys [B, S, r + rope],
    seq [N] its sequence, rows [N] its own row. Returns P @ c_kv [N, H, r]."""
    mine = keys[seq].float()  # [N, S, r + rope]
    scores = torch.einsum("nhc,nsc->nhs", q.float(), mine) * scale
    allowed = torch.arange(keys.shape[1], device=q.device)[None, :] <= rows[:, None]  # [N, S]
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("nhs,nsr->nhr", scores.softmax(dim=-1), mine[..., :r]).to(q.dtype)


def _block(mtp, keys, h, ids, seq, rows, positions):
    """The module over N tokens of several sequences (DeepseekMTP.step's math): returns block outputs [N, d]."""
    layer = mtp.layer
    embed = mtp._host[0].model.embed_tokens
    z = layer.eh_proj(torch.cat([layer.enorm(embed(ids)), layer.hnorm(h.to(embed.weight.dtype))], dim=-1))

    def attend(attn, x):
        q, new = attn.latent(x, positions)
        keys[seq, rows] = new.to(keys.dtype)
        return attn.latent_out(_attention(q, keys, seq, rows, attn.r, attn.scale))

    x, residual = layer(z, None, attend)
    return x + residual


def draft_batch(mtp, caches: list, token_ids: list, computed: list, ks: list, pick: Callable) -> list:
    """Per sequence b (MTPCache caches[b] or None, its token ids, its last token's position computed[b]): up to
    ks[b] drafts and their logits [ks[b], V], as DeepseekMTP.draft gives them; ([], None) for a sequence whose
    hidden states there were not observed. pick(logits [R, V]) -> tokens [R] (a device tensor) chooses every
    row's. All ready sequences draft max(ks) positions (the rows past a sequence's own k are drafted positions
    like any other, overwritten later)."""
    out = [([], None)] * len(caches)
    k = max(ks, default=0)
    ready = [b for b, c in enumerate(caches) if c is not None and c.hidden.shape[0]
             and c.base + c.length + c.hidden.shape[0] == computed[b]]
    if not ready or k < 1:
        return out
    cs = [caches[b] for b in ready]
    L, T = [c.length for c in cs], [c.hidden.shape[0] for c in cs]
    B, S = len(cs), max(a + t for a, t in zip(L, T)) + k - 1
    keys = cs[0].kv.new_zeros(B, S, cs[0].kv.shape[1])
    for i, c in enumerate(cs):  # the caches side by side, once per call
        keys[i, :L[i]] = c.kv[:L[i]]
    ids, seq, rows, pos, last = [], [], [], [], []
    for i, b in enumerate(ready):
        end = cs[i].base + L[i]
        ids.extend(token_ids[b][end + 1:computed[b] + 1])
        seq.extend([i] * T[i])
        rows.extend(range(L[i], L[i] + T[i]))
        pos.extend(range(end, computed[b]))
        last.append(len(ids) - 1)
    N = len(ids)
    host = to_device(ids + seq + rows + pos + last + [computed[b] for b in ready] + [L[i] + T[i] for i in range(B)],
                     torch.long, keys.device)  # one host-to-device copy
    ids_t, seq_t, rows_t, pos_t = host[:N], host[N:2 * N], host[2 * N:3 * N], host[3 * N:4 * N]
    last_t, comp_t, row0 = host[4 * N:4 * N + B], host[4 * N + B:4 * N + 2 * B], host[4 * N + 2 * B:]
    o = _block(mtp, keys, torch.cat([c.hidden for c in cs]), ids_t, seq_t, rows_t, pos_t)[last_t]  # [B, d]
    every = torch.arange(B, device=keys.device)
    tokens, logits = [], []
    for j in range(k):
        lg = mtp.logits(o)  # [B, V]
        tokens.append(pick(lg))
        logits.append(lg)
        if j + 1 < k:  # rows past each cache's length: drafted positions, overwritten by later steps
            o = _block(mtp, keys, o, tokens[-1], every, row0 + j, comp_t + j)
    for i, c in enumerate(cs):  # the new rows back into each sequence's cache
        n = L[i] + T[i] + k - 1
        c.reserve(n)
        c.kv[L[i]:n] = keys[i, L[i]:n]
        c.length, c.hidden = computed[ready[i]] - 1 - c.base, c.hidden[-1:]
    drafted = torch.stack(tokens, 1).tolist()  # [B, k]: the drafts' one trip to the host
    stacked = torch.stack(logits, 1)  # [B, k, V]
    for i, b in enumerate(ready):
        out[b] = (drafted[i][:ks[b]], stacked[i, :ks[b]])
    return out
