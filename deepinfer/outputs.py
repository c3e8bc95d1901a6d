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
