"""Turn logprob tensors into the per-token {token_id: Logprob} dicts users read (host side, only when asked)."""

from __future__ import annotations

from ..outputs import Logprob, decode_token_text as _decode, entries_from


def prompt_logprob_entries(ops, logits, targets, num_top: int, tokenizer) -> list:
    """One {token_id: Logprob} dict per target token: the actual token plus the top num_top."""
    lp = ops.compute_logprobs(logits, targets, num_top)
    n = lp.token_logprobs.shape[0]
    dicts, tok_lp, ranks = entries_from(lp, range(n), [num_top] * n, tokenizer)
    tg = targets.tolist()
    for d, t, l, rk in zip(dicts, tg, tok_lp, ranks):
        d[t] = Logprob(l, rk, _decode(tokenizer, t))
    return dicts
