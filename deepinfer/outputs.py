"""What generate() returns; shaped after vLLM's RequestOutput so users know it."""

from __future__ import annotations

from typing import Any, Optional

import attrs


@attrs.frozen
class Logprob:
    logprob: float
    rank: Optional[int] = None  # 1 = most likely
    decoded_token: Optional[str] = None


@attrs.define
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list] = None  # per generated token: {token_id: Logprob}
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Any = None  # the stop string or stop token id that ended it
    error: Optional[str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.define
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list  # [n] CompletionOutput
    finished: bool
    prompt_logprobs: Optional[list] = None  # per prompt token: None for the first, then {token_id: Logprob}
    error: Optional[str] = None  # set when the request could not be served
    metrics: dict = attrs.field(factory=dict)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (the most of any of its n sequences)


# Logprob tensors -> the per-token {token_id: Logprob} dicts users read (host side, only when asked).
def partial_prefix_len(text: str, tags) -> int:
    """Length of the longest tail of text that is a proper prefix of one of tags (a stop string, a tool tag):
    what a stream withholds until it knows whether the tag follows."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def held_for_stream(out: "RequestOutput", stops) -> "RequestOutput":
    """A streamed output with each unfinished completion's tail that may begin one of ``stops`` held back (as vLLM
    streams): a later output never takes back text an earlier one showed."""
    if not stops or out.finished:
        return out
    held = []
    for c in out.outputs:
        k = 0 if c.finished() else partial_prefix_len(c.text, stops)
        held.append(attrs.evolve(c, text=c.text[:len(c.text) - k]) if k else c)
    return attrs.evolve(out, outputs=held)


def decode_token_text(tokenizer, tid: int):
    if tokenizer is None:
        return None
    from .detokenizer import decode_token

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
            d[ids[r][j]] = Logprob(tops[r][j], j + 1, decode_token_text(tokenizer, ids[r][j]))
        out.append(d)
    return out, tok_lp, ranks
