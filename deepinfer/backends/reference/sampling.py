"""Batched sampler of the reference backend: plain PyTorch, runs on any device.

One engine step builds a SamplingBatch from the S sequences that sample, then
`sample` turns their raw logits [S, V] into next tokens [S]. Work is batched
over rows and vocabulary; the only Python loops are over rows while building
the batch and over rows that carry their own seeded generator.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import attrs
import torch

from deepinfer.layout import GREEDY_EPS as _GREEDY_EPS, SamplingBatch, to_device  # noqa: F401 (re-exported)

def apply_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """SamplingParams.logits_processors, row by row in Python (vLLM v0's per-request callables): each gets the
    row's output token ids (and its prompt ids first, if it takes three arguments) and its logits [V], and
    returns new logits [V]. logits: [S, V] float32; returns a new tensor (the input itself when no row has any).
    A row whose processor raises, or returns anything but a [V] tensor, or logits with NaN or +inf or no finite
    entry, keeps its logits and is recorded in batch.processor_errors, for the sample stage to fail that request
    alone."""
    if batch.processors is None:
        return logits
    logits = logits.clone()
    for i, entry in enumerate(batch.processors):
        if entry is None:
            continue
        fns, prompt, out = entry
        row = logits[i]
        try:
            for fn in fns:
                row = fn(prompt, list(out), row) if _takes_prompt(fn) else fn(list(out), row)
                if not isinstance(row, torch.Tensor) or row.shape != logits[i].shape:
                    raise ValueError(f"{fn!r} returned {getattr(row, 'shape', type(row).__name__)}, not a tensor "
                                     f"of shape {tuple(logits[i].shape)}")
            # NaN, +inf or no finite logit left would sample a meaningless token (NaN probabilities pick id 0).
            if bool(row.isnan().any() | row.isposinf().any() | ~row.isfinite().any()):  # (one host read)
                raise ValueError("returned logits with NaN or +inf, or with no finite entry (every token removed)")
        except Exception as exc:  # the user's code: its request fails, the batch goes on
            batch.processor_errors[i] = f"SamplingParams.logits_processors: {type(exc).__name__}: {exc}"
            continue
        logits[i] = row
    return logits


def _takes_prompt(fn) -> bool:
    try:
        return len(inspect.signature(fn).parameters) == 3
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return False


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output tokens, then frequency and presence over output tokens.

    logits: [S, V] float32. Returns new logits (the input itself when no row has penalties).
    """
    if batch.output_counts is None:
        return logits
    counts = batch.output_counts  # [S, V]
    seen_out = counts > 0  # [S, V]
    rep = batch.repetition_penalty.unsqueeze(1)  # [S, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)  # [S, V]
    logits = torch.where(seen_out | batch.prompt_mask, penalized, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    return logits - batch.presence_penalty.unsqueeze(1) * seen_out.float()


def _penalized(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 logits [S, V] after logits processors, logit bias, penalties and banned tokens (vLLM's order);
    never modifies the input."""
    logits = apply_processors(logits.float(), batch)
    if batch.logit_bias is not None:
        logits = logits + batch.logit_bias
    logits = apply_penalties(logits, batch)
    if batch.banned is not None:
        logits = logits.masked_fill(batch.banned, float("-inf"))
    return logits


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on penalized logits [S, V]; -inf marks removed tokens."""
    S, V = logits.shape
    greedy = batch.temperature < _GREEDY_EPS  # [S]
    temp = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)  # [S], avoids 0-division
    logits = logits / temp.unsqueeze(1)  # [S, V]
    neg_inf = float("-inf")

    if batch.use_top_k or batch.use_top_p:
        # Stable sort: ties keep index order, so top-p's cut among equal tokens is deterministic.
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)  # [S, V] each
        if batch.use_top_k:
            k = torch.where(batch.top_k > 0, batch.top_k, V).clamp(max=V)  # [S]
            kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [S, 1]
            # Tokens tied with the k-th logit stay, as in HF/vLLM.
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)
        if batch.use_top_p:
            probs = sorted_logits.softmax(dim=-1)  # [S, V]
            mass_before = probs.cumsum(dim=-1) - probs  # [S, V], exactly 0 for the top token, so it always stays
            top_p = batch.top_p.unsqueeze(1)  # [S, 1]
            # top_p == 1 must keep everything even if rounding pushes the cumsum to 1 early.
            drop = (mass_before >= top_p) & (top_p < 1.0)
            sorted_logits = sorted_logits.masked_fill(drop, neg_inf)
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)

    if batch.use_min_p:
        # prob_i < min_p * max_prob  <=>  logit_i < max_logit + log(min_p); log(0) = -inf disables the row.
        max_logit = logits.max(dim=-1, keepdim=True).values  # [S, 1]
        threshold = max_logit + batch.min_p.log().unsqueeze(1)  # [S, 1]
        logits = logits.masked_fill(logits < threshold, neg_inf)
    return logits


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logits [S, V] float32 whose softmax is the distribution each random row samples from.

    -inf marks tokens that cannot be sampled. Greedy rows are processed at
    temperature 1 and their argmax is the token `sample` returns for them.
    """
    return _filter(_penalized(logits, batch), batch)


def _exponential(shape, batch: SamplingBatch, generator, device) -> torch.Tensor:
    """q ~ Exp(1) [S, V]: seeded rows from their own generator, the rest from one batched draw."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    seeded = [i for i, g in enumerate(batch.generators) if g is not None]
    if len(seeded) < shape[0]:
        q.exponential_(generator=generator)
    for i in seeded:
        q[i].exponential_(generator=batch.generators[i])
    # exponential_ may return 0; probs/0 would give nan (0/0) or pick a zero-probability token.
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token of each row. logits: [S, V] raw model logits (any float dtype). Returns [S] int64."""
    penalized = _penalized(logits, batch)  # [S, V] float32
    if batch.all_greedy:
        return penalized.argmax(dim=-1)
    probs = _filter(penalized, batch).softmax(dim=-1)  # [S, V]
    # Exponential race: argmax(p / q) with q ~ Exp(1) picks token i with probability p_i.
    q = _exponential(probs.shape, batch, generator, probs.device)  # [S, V]
    sampled = (probs / q).argmax(dim=-1)  # [S]
    if batch.all_random:
        return sampled
    greedy = batch.temperature < _GREEDY_EPS  # [S]
    return torch.where(greedy, penalized.argmax(dim=-1), sampled)


@attrs.frozen
class LogprobsTensors:
    token_logprobs: torch.Tensor  # [S] float32 logprob of the chosen token
    token_ranks: torch.Tensor  # [S] int64, 1 = most likely
    top_ids: torch.Tensor  # [S, n] int64
    top_logprobs: torch.Tensor  # [S, n] float32


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int,
                     stable: bool = False) -> LogprobsTensors:
    """Logprobs of the raw model distribution (before penalties/temperature), as vLLM reports by default.

    logits: [S, V]; token_ids: [S] int64 chosen tokens; num_top >= 0. ``stable``: tied top-n logprobs in
    ascending token id (a stable sort; topk's order among ties may change with the batch: batch-invariant mode).
    """
    logprobs = logits.float().log_softmax(dim=-1)  # [S, V]
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))  # [S, 1]
    # vLLM's rank: how many tokens are at least as likely as the chosen one (ties count against it).
    ranks = (logprobs >= token_logprobs).sum(dim=-1)  # [S]
    if num_top > 0:
        n = min(num_top, logprobs.shape[-1])
        if stable:
            top_logprobs, top_ids = logprobs.sort(dim=-1, descending=True, stable=True)
            top_logprobs, top_ids = top_logprobs[:, :n], top_ids[:, :n]
        else:
            top_logprobs, top_ids = logprobs.topk(n, dim=-1)  # [S, n] each
    else:
        top_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = token_ids.new_empty(logprobs.shape[0], 0)
    return LogprobsTensors(token_logprobs=token_logprobs.squeeze(1), token_ranks=ranks,
                           top_ids=top_ids, top_logprobs=top_logprobs)
