"""``deepinfer check yoco``: mask vs compact and exact vs bounded replay over one fixed trajectory.

A trajectory is a prompt (N tokens) plus forced continuation tokens (M): every side scores the same tokens
(teacher forcing), so a difference never snowballs into another trajectory. For each continuation token t_j
(position N + j) a side gives log p(t_j | tokens before it) and its top-K tokens. Sides:

- ``full/<pool>/s=<s>``: the full-sequence path, ``model.forward_full(ids, replay_start=s)`` (masks, no
  cache) with ``model.pool_impl = <pool>``. s = 0 is exact replay; s = N - n_win is bounded replay as the
  engine runs it for this prompt (the decoder over positions >= s, every SWA window cut at s): the engine
  prefills the prompt with that replay start and then decodes the continuation with the same cut.
- ``engine``: the engine path (paged global KV, SWA rings), one request over prompt + continuation with
  ``SamplingParams(prompt_logprobs=K, max_tokens=1)``. A request with prompt_logprobs scores its prompt with
  exact replay semantics (models/ced/model.py ReplayStart), so this side is the engine's exact replay.

Comparisons (reference -> candidate):

- ``pool``:   full/mask/s=0 -> full/gather/s=0   (CED: decoder reindex layers scoring the pool by mask or by
  gathering its entries); expected equal up to float rounding.
- ``path``:   full/<model's pool>/s=0 -> engine  (masks vs paged caches and rings); expected equal up to float
  rounding (and a near-tie in a discrete choice now and then: top-K, MoE routing).
- ``replay``: full/<pool>/s=0 -> full/<pool>/s=N-n_win (exact vs bounded replay); differs by the trained-for
  approximation, most right after the cut (the first continuation tokens), fading as the windows move past it.

pool and replay need a CED model; other models run path only. Rows and summaries are plain dicts (JSONL).
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

COMPARISONS = ("pool", "path", "replay")


@attrs.frozen
class Scores:
    """One side over the continuation: per forced token, its logprob and the side's top-K token ids (best
    first)."""

    name: str
    logprobs: list
    top: list


def _is_ced(model) -> bool:
    return hasattr(model, "pool_impl") and hasattr(getattr(model, "config", None), "n_win")


def bounded_start(model, num_prompt_tokens: int) -> int:
    """The replay start the engine gives a prompt under bounded replay: N - n_win (0 for a short prompt)."""
    return max(0, num_prompt_tokens - model.config.n_win)


def _full_logits(model, ids: list, s: int, pool: Optional[str]) -> torch.Tensor:
    """forward_full's float32 logits for positions s .. len - 1 (all positions for a model without replay)."""
    dev = next(model.parameters()).device
    x = torch.tensor(ids, device=dev)
    if not _is_ced(model):
        return model.forward_full(x).float()
    saved = model.pool_impl
    model.pool_impl = pool or saved
    try:
        return model.forward_full(x, replay_start=s).float()
    finally:
        model.pool_impl = saved


def full_side(model, ids: list, n_prompt: int, k: int, s: int = 0, pool: Optional[str] = None) -> Scores:
    with torch.no_grad():
        logits = _full_logits(model, ids, s, pool)
    lp = torch.log_softmax(logits[n_prompt - 1 - s:len(ids) - 1 - s], dim=-1).cpu()  # [M, V]
    tgt = torch.tensor(ids[n_prompt:])
    name = "full" if not _is_ced(model) else f"full/{pool or model.pool_impl}/s={s}"
    return Scores(name, lp.gather(1, tgt[:, None])[:, 0].tolist(), lp.topk(min(k, lp.shape[-1]), dim=-1).indices.tolist())


def engine_side(llm, ids: list, n_prompt: int, k: int) -> Scores:
    from .core.params import SamplingParams

    out = llm.generate([{"prompt_token_ids": list(ids)}], SamplingParams(prompt_logprobs=k, max_tokens=1),
                       use_tqdm=False)[0]
    if out.error:
        raise ValueError(f"the engine failed the scoring request: {out.error}")
    lps, tops = [], []
    for j in range(n_prompt, len(ids)):
        d = out.prompt_logprobs[j]
        lps.append(d[ids[j]].logprob)
        tops.append([t for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank) if lp.rank <= k])
    return Scores("engine", lps, tops)


def greedy_continuation(model, prompt: list, max_tokens: int) -> list:
    """max_tokens tokens chosen greedily by the full-sequence path with exact replay (the reference side)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(_full_logits(model, ids, 0, None)[-1].argmax()))
    return ids[len(prompt):]


def compare(ref: Scores, cand: Scores, ids: list, n_prompt: int, k: int, threshold: float, **extra) -> tuple:
    """(rows, summary) of one comparison: a row per forced token, the summary of them all."""
    rows = []
    for j, (a, b, ta, tb) in enumerate(zip(ref.logprobs, cand.logprobs, ref.top, cand.top)):
        rows.append(dict(extra, reference=ref.name, candidate=cand.name, step=j, position=n_prompt + j,
                         token=ids[n_prompt + j], ref_logprob=a, cand_logprob=b, dlogprob=b - a,
                         topk_overlap=len(set(ta[:k]) & set(tb[:k])) / k, ref_argmax=ta[0], cand_argmax=tb[0],
                         argmax_agree=ta[0] == tb[0]))
    d = [abs(r["dlogprob"]) for r in rows]
    first = lambda rs: next((r["position"] for r in rs), None)
    summary = dict(extra, reference=ref.name, candidate=cand.name, positions=len(rows), top_k=k,
                   threshold=threshold, max_abs_dlogprob=max(d, default=0.0),
                   mean_abs_dlogprob=sum(d) / len(d) if d else 0.0,
                   mean_topk_overlap=sum(r["topk_overlap"] for r in rows) / len(rows) if rows else 1.0,
                   first_argmax_divergence=first(r for r in rows if not r["argmax_agree"]),
                   first_over_threshold=first(r for r in rows if abs(r["dlogprob"]) > threshold))
    return rows, summary


def check_yoco(llm, prompt: list, continuation: list, top_k: int = 10, threshold: float = 0.1,
               comparisons=COMPARISONS) -> tuple:
    """Run the comparisons over prompt + continuation. Returns (rows, summaries, notes): notes say which
    comparisons were skipped and why."""
    model = llm.engine.model
    ids, N = list(prompt) + list(continuation), len(prompt)
    if N < 1 or not continuation:
        raise ValueError("check yoco needs a prompt of at least one token and at least one continuation token")
    ced = _is_ced(model)
    common = dict(prompt_tokens=N, continuation_tokens=len(continuation))
    rows, summaries, notes, cache = [], [], [], {}

    def full(s=0, pool=None):
        key = (s, pool)
        if key not in cache:
            cache[key] = full_side(model, ids, N, top_k, s, pool)
        return cache[key]

    for name in comparisons:
        if name not in COMPARISONS:
            raise ValueError(f"comparison {name!r} is unknown: expected some of {', '.join(COMPARISONS)}")
        if name in ("pool", "replay") and not ced:
            notes.append(f"{name}: skipped ({type(model).__name__} has no {'pool_impl' if name == 'pool' else 'SWA replay'})")
            continue
        extra = dict(common, comparison=name)
        if name == "pool":
            pair = full(pool="mask"), full(pool="gather")
        elif name == "path":
            pair = full(), engine_side(llm, ids, N, top_k)
        else:
            s = bounded_start(model, N)
            extra.update(n_win=model.config.n_win, replay_start=s)
            if s == 0:
                notes.append(f"replay: the prompt ({N} tokens) is not longer than n_win={model.config.n_win}, so "
                             "bounded replay starts at 0 and equals exact replay")
            pair = full(), full(s=s)
        r, summ = compare(*pair, ids, N, top_k, threshold, **extra)
        rows += r
        summaries.append(summ)
    return rows, summaries, notes


def format_table(rows: list, summaries: list, notes: list) -> str:
    """Per comparison: a line per forced token, then its summary line."""
    out = []
    for summ in summaries:
        name = summ["comparison"]
        out.append(f"== {name}: {summ['reference']} -> {summ['candidate']}")
        out.append(f"{'pos':>6} {'token':>7} {'ref lp':>9} {'dlogprob':>10} {'top' + str(summ['top_k']):>6} argmax")
        for r in (r for r in rows if r["comparison"] == name):
            mark = "=" if r["argmax_agree"] else f"{r['ref_argmax']}->{r['cand_argmax']}"
            flag = " *" if abs(r["dlogprob"]) > summ["threshold"] else ""
            out.append(f"{r['position']:>6} {r['token']:>7} {r['ref_logprob']:>9.4f} {r['dlogprob']:>+10.2e} "
                       f"{r['topk_overlap']:>6.2f} {mark}{flag}")
        out.append(f"summary {name}: {summ['positions']} positions, max |dlogprob| {summ['max_abs_dlogprob']:.3g}, "
                   f"mean |dlogprob| {summ['mean_abs_dlogprob']:.3g}, mean top-{summ['top_k']} overlap "
                   f"{summ['mean_topk_overlap']:.3f}, first argmax divergence: "
                   f"{_pos(summ['first_argmax_divergence'])}, first |dlogprob| > {summ['threshold']:g}: "
                   f"{_pos(summ['first_over_threshold'])}")
    out += [f"note: {n}" for n in notes]
    return "\n".join(out)


def _pos(p) -> str:
    return "none" if p is None else f"position {p}"
