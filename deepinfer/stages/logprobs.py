"""Turn logprob tensors into the per-token {token_id: Logprob} dicts users read (host side, only when asked)."""

from __future__ import annotations

from ..outputs import Logprob


def _decode(tokenizer, tid: int):
    if tokenizer is None:
        return None
    from ..detokenizer import decode_token

    return decode_token(tokenizer, tid)


def entries_from(lp, rows, num_tops, tokenizer) -> list:
    """lp: LogprobsTensors; rows: which rows; num_tops[r]: top-n asked by that row. One dict per row."""
    ids = lp.top_ids.tolist()
    tops = lp.top_logprobs.tolist()
    tok_lp = lp.token_logprobs.tolist()
    ranks = lp.token_ranks.tolist()
    out = []
    for r, n in zip(rows, num_tops):
        d = {}
        for j in range(min(n, len(ids[r]))):
            d[ids[r][j]] = Logprob(tops[r][j], j + 1, _decode(tokenizer, ids[r][j]))
        out.append(d)
    return out, tok_lp, ranks


def prompt_logprob_entries(ops, logits, targets, num_top: int, tokenizer) -> list:
    """One {token_id: Logprob} dict per target token: the actual token plus the top num_top."""
    lp = ops.compute_logprobs(logits, targets, num_top)
    n = lp.token_logprobs.shape[0]
    dicts, tok_lp, ranks = entries_from(lp, range(n), [num_top] * n, tokenizer)
    tg = targets.tolist()
    for d, t, l, rk in zip(dicts, tg, tok_lp, ranks):
        d[t] = Logprob(l, rk, _decode(tokenizer, t))
    return dicts
