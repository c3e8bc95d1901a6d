"""Step stage: choose the next token of every sampling row (greedy, temperature, top-k/p, min-p, penalties)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..core.stage import RowError, Stage


@attrs.define(eq=False)
class SampleStage(Stage):
    name = "sampler"
    kind = "sample"
    reads = ("logits", "sampling")
    writes = ("next_tokens", "logprobs")

    ops: object
    generator: Optional[torch.Generator] = None  # engine-wide, for rows without their own seed

    def __call__(self, state) -> None:
        logits, batch = state.logits, state.sampling
        if logits.shape[0] == 0:
            state.next_tokens, state.logprobs = torch.empty(0, dtype=torch.long, device=logits.device), None
            return
        state.next_tokens = self.ops.sample(logits, batch, self.generator)
        state.logprobs = None
        if batch.max_num_logprobs >= 0:
            state.logprobs = self.ops.compute_logprobs(logits, state.next_tokens, batch.max_num_logprobs)
        if batch.processor_errors:  # a request's logits processor raised: that request fails alone
            raise RowError.from_sample_rows(state, batch.processor_errors)
