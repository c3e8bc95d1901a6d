"""The engine's record of a request (its n sequences, error, timing) and the RequestOutput built from it."""

from __future__ import annotations

import time
from typing import Optional

from ..outputs import CompletionOutput, RequestOutput
from .params import SamplingParams
from .speculative import SpecStats


class Request:
    """The engine's record of one request and its n sequences."""

    def __init__(self, request_id: str, prompt, params: SamplingParams):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.prompt_token_ids: list = []
        self.seqs: list = []
        self.error: Optional[str] = None
        self.arrival_time = time.perf_counter()
        self.first_token_time: Optional[float] = None
        self.reported_done = False
        self.stream = False

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finished for s in self.seqs)


def spec_metrics(seqs) -> dict:
    """Speculative decoding's counts over a request's sequences, named as vLLM's (SpecStats.vllm_counts)."""
    total = SpecStats()
    for s in seqs:
        if s.spec_stats is not None:
            total.add(s.spec_stats)
    return total.vllm_counts()


def request_output(req: Request) -> RequestOutput:
    """The RequestOutput users read (built only for finished and streamed requests: it is per-sequence Python)."""
    prompt = req.prompt if isinstance(req.prompt, str) else None
    if isinstance(req.prompt, dict) and isinstance(req.prompt.get("prompt"), str):
        prompt = req.prompt["prompt"]  # the text of {"prompt": ...}, or chat's rendered template
    if req.error is not None:
        comp = [CompletionOutput(index=0, text="", token_ids=[], finish_reason="error", error=req.error)]
        return RequestOutput(req.request_id, prompt, req.prompt_token_ids, comp, True, error=req.error)
    comps = []
    for s in req.seqs:
        cum = None
        if s.logprobs is not None:
            cum = sum(d[t].logprob for d, t in zip(s.logprobs, s.output_token_ids))
        comps.append(CompletionOutput(index=s.index, text=s.text, token_ids=list(s.output_token_ids),
                                      cumulative_logprob=cum, logprobs=s.logprobs, finish_reason=s.finish_reason,
                                      stop_reason=s.stop_reason))
    metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
               "num_preemptions": sum(s.num_preemptions for s in req.seqs), **spec_metrics(req.seqs)}
    return RequestOutput(req.request_id, prompt, req.prompt_token_ids, comps, req.finished,
                         prompt_logprobs=req.seqs[0].prompt_logprobs, metrics=metrics,
                         num_cached_tokens=max(s.num_cached_tokens for s in req.seqs))
