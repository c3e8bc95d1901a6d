"""A verify step's acceptance, launched on the device with the step and read back at its one collection.

``launch_acceptance`` runs after the step's device stages (the verify stage's logits, the constrain stage's
masks, the sampler): it lays the drafting rows' logits out as [R, K+1, V] (one index gather), accepts every
row at once (core/spec_accept.py), puts each row's first emitted token into ``state.next_tokens`` (so the
usual token copy and penalty count carry it), counts the further accepted tokens for penalties, and starts
non-blocking copies of what the engine folds at collection: accepted counts and tokens, and logprobs where a
row wants them. Nothing here waits for the device.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..backends.base import to_device
from ..layout import GREEDY_EPS, to_host
from .spec_accept import accept_batch, draw_noise, process_rows


@attrs.define(eq=False)
class SpecLaunch:
    rows: list  # [R] (sampling row r, batch row i) of the drafting rows
    K: int  # longest draft of the step
    host: torch.Tensor  # [R, K+2] int64 on the host once collected: accepted count, then K+1 emitted tokens
    logprobs: Optional[tuple] = None  # LogprobsTensors fields on the host, rows r*(K+1)+j, or None

    def row(self, n: int) -> tuple:
        """(accepted, emitted tokens) of the n-th drafting row (read after the step's collection)."""
        acc = int(self.host[n, 0])
        return acc, self.host[n, 1:acc + 2].tolist()

    def all_rows(self) -> list:
        """[R] (accepted, emitted tokens) of every drafting row: ``row`` for each, from one host conversion."""
        return [(h[0], h[1:h[0] + 2]) for h in self.host.tolist()]


def launch_acceptance(state, sampling_state, ops, generator, max_num_logprobs: int) -> Optional[SpecLaunch]:
    """Accept or reject every drafting row's drafts on the device (see the module docstring); None when no
    sampling row drafted. max_num_logprobs: the most logprobs a drafting row asks for (-1: none)."""
    batch, sampling = state.batch, state.sampling
    rows = [(r, i) for r, i in enumerate(state.sample_rows) if batch.drafts[i]]
    if not rows or state.draft_logits is None:
        return None
    ks = [len(batch.drafts[i]) for _, i in rows]  # each drafting row's own draft count
    R, K = len(rows), max(ks)
    D, V = state.draft_logits.shape
    layout, off = [], 0  # per row: K+1 positions into cat(draft_logits, logits), its K drafts, k, r
    for (r, i), k in zip(rows, ks):
        d = batch.drafts[i]
        layout.append([off + j for j in range(k)] + [D + r] * (K + 1 - k) + d + [0] * (K - k) + [k, r])
        off += k
    dev = to_device(layout, torch.long, state.logits.device)  # one host-to-device copy
    at, drafts, lens, srows = dev[:, :K + 1], dev[:, K + 1:2 * K + 1], dev[:, 2 * K + 1], dev[:, 2 * K + 2]
    greedy = sampling.temperature[srows] < GREEDY_EPS  # [R]
    all_greedy = all(batch.seqs[i].params.greedy for _, i in rows)
    raw = logits = None
    if all_greedy and sampling.output_counts is None:  # argmaxes of the raw logits: no [R, K+1, V] copy
        best = torch.cat([state.draft_logits.argmax(-1), state.logits.argmax(-1)])[at]
    else:
        raw = torch.cat([state.draft_logits, state.logits])[at]  # [R, K+1, V]
        logits, best = process_rows(raw, sampling, srows, drafts, lens), None
    noise = None
    if not all_greedy:
        noise = draw_noise(R, K, V, [sampling.generators[r] for r, _ in rows], generator, dev.device, ks)
    q = _draft_probs([batch.seqs[i] for _, i in rows], ks, drafts, V, dev.device)
    tokens, acc = accept_batch(logits, drafts, lens, q, greedy, noise, all_greedy=all_greedy, best=best)
    state.next_tokens = state.next_tokens.index_copy(0, srows, tokens[:, 0])
    sampling_state.record_more(srows, tokens[:, 1:])  # the engine's record() counts the first tokens
    lp = None
    if max_num_logprobs >= 0:  # each emitted token's logprobs at its own position (raw logits)
        if raw is None:
            raw = torch.cat([state.draft_logits, state.logits])[at]
        t = ops.compute_logprobs(raw.reshape(R * (K + 1), V), tokens.clamp_min(0).reshape(-1), max_num_logprobs)
        lp = tuple(to_host(x) for x in (t.token_logprobs, t.token_ranks, t.top_ids, t.top_logprobs))
    return SpecLaunch(rows, K, to_host(torch.cat([acc[:, None], tokens], 1)), lp)


def _draft_probs(seqs: list, ks: list, drafts, V: int, device) -> Optional[torch.Tensor]:
    """q [R, K, V]: each row's drafter distributions over its ks[n] drafts, point masses for rows without
    (None when no row has any)."""
    own = [s.draft_probs is not None and len(s.draft_probs) >= k for s, k in zip(seqs, ks)]
    if not any(own):
        return None
    R, K = drafts.shape
    q = torch.zeros(R, K, V, device=device).scatter_(2, drafts[:, :, None], 1.0)
    for n, (s, k) in enumerate(zip(seqs, ks)):  # a copy per row that has them (device work, no sync)
        if own[n]:
            q[n, :k] = s.draft_probs[:k].to(device=device, dtype=q.dtype)
    return q
