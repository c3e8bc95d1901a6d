"""Speculative acceptance for the whole batch as tensor ops: no loop over rows, no host sync.

The engine runs this on the device right after the step's forward (core/engine.py), so a verify step's
tokens reach the host in the step's one collection, like plain decode's. ``core/speculative.accept_row`` is
its oracle (one row at a time, Python scalars); both take the same random numbers (``draw_noise``), so a
test holds them equal token for token (tests/test_spec_accept.py).

Shapes: R drafting rows, K the longest draft of the step (rows with fewer are padded; ``lens`` [R] gives
each row's k_r in [0, K]), V the vocabulary. A row's verified positions are its k_r drafts and the one after
them (the bonus); padded positions past k_r never count.

Randomness per row: u [K] uniforms for the acceptance tests and e [V] exponentials for the one draw a row
makes (the first rejected position's residual, or the bonus): token = argmax(r / e) picks i with probability
r_i / sum(r) (the exponential race), so the residual needs no renormalisation.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..backends.reference.sampling import process_logits


def draw_noise(R: int, K: int, V: int, generators: list, default: Optional[torch.Generator], device,
               lens: Optional[list] = None) -> tuple:
    """(u [R, K] float64, e [R, V] float32 > 0): rows whose request has a seed draw from their own generator
    (one call each, as the sampler does), the rest from one batched draw of ``default``. lens [R] (host ints,
    each row's own draft count; None: K each): a seeded row draws only its own lens[i] uniforms (its padded
    ones are never read), so what its generator gives does not depend on its neighbours' draft lengths."""
    u = torch.ones(R, K, dtype=torch.float64, device=device)
    e = torch.empty(R, V, dtype=torch.float32, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < R:
        u.uniform_(generator=default)
        e.exponential_(generator=default)
    for i in seeded:
        u[i, :K if lens is None else lens[i]].uniform_(generator=generators[i])
        e[i].exponential_(generator=generators[i])
    return u, e.clamp_min_(torch.finfo(torch.float32).tiny)  # exponential_ may return 0


def flat_sampling(batch, rows: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor):
    """The SamplingBatch of R*(K+1) rows: sampling row rows[r] at each of its K+1 verified positions, its
    penalties counting the drafts before each position as output (row r, position j: index r*(K+1) + j).
    rows [R] int64 sampling rows of ``batch``; drafts [R, K] int64; lens [R] int64. Oracle:
    core/speculative.sampling_rows (one row)."""
    R, K = drafts.shape
    idx = rows.repeat_interleave(K + 1)  # [R*(K+1)]
    pen = {}
    if batch.output_counts is not None:
        V = batch.output_counts.shape[1]
        live = (torch.arange(K, device=drafts.device)[None, :] < lens[:, None]).to(batch.output_counts.dtype)
        seen = torch.zeros(R, K + 1, V, dtype=batch.output_counts.dtype, device=drafts.device)
        seen[:, 1:].scatter_(2, drafts[:, :, None], live[:, :, None])  # draft j counted from position j + 1 on
        counts = batch.output_counts[idx] + seen.cumsum(1).reshape(R * (K + 1), V)
        pen = dict(presence_penalty=batch.presence_penalty[idx], frequency_penalty=batch.frequency_penalty[idx],
                   repetition_penalty=batch.repetition_penalty[idx], output_counts=counts,
                   prompt_mask=batch.prompt_mask[idx])
    none = dict.fromkeys(("presence_penalty", "frequency_penalty", "repetition_penalty", "output_counts",
                          "prompt_mask"))
    return attrs.evolve(batch, temperature=batch.temperature[idx], top_k=batch.top_k[idx], top_p=batch.top_p[idx],
                        min_p=batch.min_p[idx], banned=None, generators=[None] * idx.shape[0], logit_bias=None,
                        processors=None, processor_errors={}, **{**none, **pen})


def process_rows(raw: torch.Tensor, batch, rows: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor):
    """raw [R, K+1, V] target logits at each row's verified positions -> the logits the sampler draws from
    (temperature, top-k, top-p, min-p, penalties), [R, K+1, V] float32."""
    R, K1, V = raw.shape
    return process_logits(raw.reshape(R * K1, V), flat_sampling(batch, rows, drafts, lens)).view(R, K1, V)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a row draws from where its draft was rejected: max(p - q, 0), unnormalised (the exponential race needs
    no normalising); p itself where that is zero everywhere (p <= q: p == q, a draw from p is exact). q is zero at
    the bonus position, so the residual there is p."""
    res = (p - q).clamp_min(0)
    return torch.where(res.sum(-1, keepdim=True) > 0, res, p)


def accept_batch(logits: Optional[torch.Tensor], drafts: torch.Tensor, lens: torch.Tensor, q: Optional[torch.Tensor],
                 greedy: torch.Tensor, noise: Optional[tuple], all_greedy: bool = False,
                 best: Optional[torch.Tensor] = None) -> tuple:
    """Every row's emitted tokens: its accepted drafts and one target token.

    logits [R, K+1, V]: processed target logits (what the sampler draws from); drafts [R, K] int64; lens [R]
    int64 drafts per row; q [R, K, V] the drafter's distributions (None: a point mass at each draft); greedy
    [R] bool; noise (u [R, K], e [R, V]) from draw_noise (unused, may be None, when ``all_greedy``).
    best [R, K+1]: the logits' argmaxes when known (then ``logits`` may be None for an all-greedy batch).
    Returns (tokens [R, K+1] int64: row r's emitted tokens in columns 0..accepted[r], -1 after them;
    accepted [R] int64)."""
    R, K = drafts.shape
    K1 = K + 1
    cols = torch.arange(K1, device=drafts.device)
    live = cols[None, :K] < lens[:, None]  # [R, K] real (not padded) drafts
    best = logits.argmax(-1) if best is None else best  # [R, K+1]
    ok = drafts == best[:, :K]  # greedy: the draft is the target's argmax
    if not all_greedy:
        u, e = noise
        p = logits.float().softmax(-1)  # [R, K+1, V]
        V = p.shape[-1]
        pd = p[:, :K].gather(2, drafts[:, :, None])[..., 0].double()  # [R, K] target probability of each draft
        qd = torch.ones_like(pd) if q is None else q.float().gather(2, drafts[:, :, None])[..., 0].double()
        ratio = (pd / torch.where(qd > 0, qd, 1.0)).clamp(max=1.0)
        ok = torch.where(greedy[:, None], ok, (qd > 0) & (u < ratio))
    acc = (ok & live).long().cumprod(1).sum(1)  # [R] leading drafts that stand
    fix = best.gather(1, acc[:, None])[:, 0]  # greedy: the argmax at the first rejected position (or the bonus)
    if not all_greedy:
        p_a = p.gather(1, acc[:, None, None].expand(R, 1, V))[:, 0]  # [R, V] target at that position
        rejected = (acc < lens).float()[:, None]  # a draft was rejected there (else it is the bonus: q = 0)
        at = acc.clamp(max=max(K - 1, 0))[:, None]
        if q is None:
            q_a = torch.zeros_like(p_a).scatter_(1, drafts.gather(1, at), rejected)
        else:
            q_a = q.float().gather(1, at[:, :, None].expand(R, 1, V))[:, 0] * rejected
        fix = torch.where(greedy, fix, (residual(p_a, q_a) / e).argmax(-1))
    padded = torch.cat([drafts, drafts.new_zeros(R, 1)], 1)  # [R, K+1]
    tokens = torch.where(cols[None, :] < acc[:, None], padded, -1)
    return tokens.scatter_(1, acc[:, None], fix[:, None]), acc
