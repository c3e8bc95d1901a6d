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

from deepinfer.core.params import SamplingParams
from deepinfer.backends.base import to_device

_GREEDY_EPS = 1e-5  # same threshold as SamplingParams.greedy


@attrs.define(eq=False)
class SamplingBatch:
    temperature: torch.Tensor  # [S] float32, 0 for greedy rows
    top_k: torch.Tensor  # [S] int64, 0 = disabled
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    presence_penalty: torch.Tensor | None  # [S] float32; None when no row uses penalties
    frequency_penalty: torch.Tensor | None  # [S] float32
    repetition_penalty: torch.Tensor | None  # [S] float32
    output_counts: torch.Tensor | None  # [S, V] float32 count of each token in the output so far
    prompt_mask: torch.Tensor | None  # [S, V] bool, token occurs in the prompt
    banned: torch.Tensor | None  # [S, V] bool, tokens not to sample now (min_tokens, allowed_token_ids, bad_words)
    generators: list  # [S] torch.Generator | None; None for greedy rows (they never draw)
    all_greedy: bool
    all_random: bool
    max_num_logprobs: int  # max requested SamplingParams.logprobs, -1 if no row asks
    # Host-side flags so `sample` can skip a filter without reading a device tensor.
    # They default to True (apply) so a hand-built batch is always correct.
    use_top_k: bool = True
    use_top_p: bool = True
    use_min_p: bool = True
    logit_bias: torch.Tensor | None = None  # [S, V] float32 added to the logits; None when no row has a bias
    # [S] None or (fns, prompt ids, output ids): SamplingParams.logits_processors of the rows that have them.
    processors: list | None = None
    # Written by sampling: {row: message} of rows whose logits processor raised (they drew from raw logits).
    processor_errors: dict = attrs.field(factory=dict)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device,
    ) -> "SamplingBatch":
        S = len(params)
        if not (len(prompt_ids) == len(output_ids) == len(generators) == S):
            raise ValueError("params, prompt_ids, output_ids and generators must have one entry per row")

        def f32(vals) -> torch.Tensor:
            return to_device(vals, torch.float32, device)

        greedy = [p.greedy for p in params]
        top_k = [p.effective_top_k for p in params]
        batch = dict(
            temperature=f32([0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]),
            top_k=to_device(top_k, torch.int64, device),
            top_p=f32([float(p.top_p) for p in params]),
            min_p=f32([float(p.min_p) for p in params]),
            generators=[None if g else gen for g, gen in zip(greedy, generators)],
            all_greedy=all(greedy),
            all_random=not any(greedy),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            # Filters only matter on random rows; greedy rows take the argmax anyway.
            use_top_k=any(k > 0 and not g for k, g in zip(top_k, greedy)),
            use_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            use_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)),
        )
        batch.update(_build_penalties(params, prompt_ids, output_ids, vocab_size, device))
        batch["banned"] = _build_banned(params, output_ids, vocab_size, eos_token_ids, device)
        batch["logit_bias"] = _build_bias(params, vocab_size, device)
        if any(p.logits_processors for p in params):
            batch["processors"] = [(p.logits_processors, list(pr), list(out)) if p.logits_processors else None
                                   for p, pr, out in zip(params, prompt_ids, output_ids)]
        return cls(**batch)


def _row_index(rows: Sequence[Sequence[int]], keep: Sequence[bool], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for every token of the kept rows, for scatter on `device`."""
    r = [i for i, (ids, k) in enumerate(zip(rows, keep)) if k for _ in ids]
    c = [int(t) for ids, k in zip(rows, keep) if k for t in ids]
    return to_device(r, torch.int64, device), to_device(c, torch.int64, device)


def _build_penalties(params, prompt_ids, output_ids, vocab_size, device) -> dict:
    keep = [p.needs_penalties for p in params]
    if not any(keep):
        return dict(presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
                    output_counts=None, prompt_mask=None)
    S = len(params)
    # Rows without penalties keep neutral values and empty counts, so they are untouched.
    counts = torch.zeros(S, vocab_size, dtype=torch.float32, device=device)  # [S, V]
    idx = _row_index(output_ids, keep, device)
    counts.index_put_(idx, torch.ones(idx[0].numel(), dtype=torch.float32, device=device), accumulate=True)
    prompt_mask = torch.zeros(S, vocab_size, dtype=torch.bool, device=device)  # [S, V]
    prompt_mask[_row_index(prompt_ids, keep, device)] = True
    return dict(
        presence_penalty=to_device([float(p.presence_penalty) for p in params], torch.float32, device),
        frequency_penalty=to_device([float(p.frequency_penalty) for p in params], torch.float32, device),
        repetition_penalty=to_device([float(p.repetition_penalty) for p in params], torch.float32, device),
        output_counts=counts,
        prompt_mask=prompt_mask,
    )


def _bad_word_ends(p: SamplingParams, out: Sequence[int]) -> set[int]:
    """Last tokens of the bad words whose other tokens end the output: sampling one would complete the word."""
    ends = set()
    for ids in p.bad_words_token_ids:
        k = len(ids) - 1
        if k == 0 or (len(out) >= k and list(out[len(out) - k:]) == list(ids[:k])):
            ends.add(ids[-1])
    return ends


def _build_banned(params, output_ids, vocab_size, eos_token_ids, device) -> torch.Tensor | None:
    """Tokens a row may not sample now: its stop tokens while under min_tokens (EOS too unless ignore_eos),
    the tokens that would complete a bad word, and every token outside allowed_token_ids."""
    rows = []
    for p, out in zip(params, output_ids):
        ids: set[int] = _bad_word_ends(p, out) if p.bad_words_token_ids else set()
        if len(out) < p.min_tokens:
            ids.update(p.stop_token_ids)
            if not p.ignore_eos:
                ids.update(eos_token_ids)
        rows.append(sorted(t for t in ids if 0 <= t < vocab_size))  # an id outside the vocab can't be sampled anyway
    restrict = [p.allowed_token_ids is not None for p in params]
    if not any(rows) and not any(restrict):
        return None
    banned = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)  # [S, V]
    banned[_row_index(rows, [True] * len(rows), device)] = True
    if any(restrict):
        allowed = torch.zeros_like(banned)  # [S, V]
        allowed[_row_index([p.allowed_token_ids or () for p in params], restrict, device)] = True
        banned |= ~allowed & to_device(restrict, torch.bool, device).unsqueeze(1)
    return banned


def _build_bias(params, vocab_size, device) -> torch.Tensor | None:
    keep = [bool(p.logit_bias) for p in params]
    if not any(keep):
        return None
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)  # [S, V]
    ids = [list(p.logit_bias or ()) for p in params]
    vals = [float(b) for p, k in zip(params, keep) if k for b in p.logit_bias.values()]
    bias[_row_index(ids, keep, device)] = to_device(vals, torch.float32, device)
    return bias


def apply_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """SamplingParams.logits_processors, row by row in Python (vLLM v0's per-request callables): each gets the
    row's output token ids (and its prompt ids first, if it takes three arguments) and its logits [V], and
    returns new logits [V]. logits: [S, V] float32; returns a new tensor (the input itself when no row has any).
    A row whose processor raises, or returns anything but a [V] tensor, keeps its logits and is recorded in
    batch.processor_errors, for the sample stage to fail that request alone."""
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


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Logprobs of the raw model distribution (before penalties/temperature), as vLLM reports by default.

    logits: [S, V]; token_ids: [S] int64 chosen tokens; num_top >= 0.
    """
    logprobs = logits.float().log_softmax(dim=-1)  # [S, V]
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))  # [S, 1]
    # vLLM's rank: how many tokens are at least as likely as the chosen one (ties count against it).
    ranks = (logprobs >= token_logprobs).sum(dim=-1)  # [S]
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)  # [S, n] each
    else:
        top_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = token_ids.new_empty(logprobs.shape[0], 0)
    return LogprobsTensors(token_logprobs=token_logprobs.squeeze(1), token_ranks=ranks,
                           top_ids=top_ids, top_logprobs=top_logprobs)
