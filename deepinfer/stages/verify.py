"""Step stage: score the positions the step asked for from the forward's hidden states: the next-token
logits of every sampling row (in batch order), and the prompt positions whose logprobs a request wants.
With draft tokens (speculative decoding), also the logits at every drafted position; the engine accepts or
rejects the drafts from them (core/speculative.py)."""

from __future__ import annotations

import attrs
import torch

from ..backends.base import to_device
from ..core.stage import Stage
from .logprobs import prompt_logprob_entries


@attrs.define(eq=False)
class VerifyStage(Stage):
    name = "verify"
    kind = "verify"
    reads = ("inputs", "hidden")
    writes = ("logits", "prompt_logprobs", "draft_logits")

    model: object
    ops: object
    tokenizer: object = None

    def __call__(self, state) -> None:
        inp, hidden = state.inputs, state.hidden
        state.prompt_logprobs = {}
        if inp is None or not inp.sample_index:
            state.logits = torch.empty(0, self.model.vocab_size, device=self.ops.device)
        else:
            if inp.sample_index == list(range(hidden.shape[0])):
                rows = hidden  # a decode-only step: every stream row samples, in order
            else:
                rows = hidden.index_select(0, to_device(inp.sample_index, torch.long, hidden.device))
            state.logits = self.model.compute_logits(rows)  # [S, V]
            if inp.draft_index:  # speculative rows: the target at every drafted position (core/speculative.py)
                at = to_device(inp.draft_index, torch.long, hidden.device)
                state.draft_logits = self.model.compute_logits(hidden.index_select(0, at))  # [D, V]
        if inp is not None:
            self._prompt_logprobs(state, inp, hidden)

    def _prompt_logprobs(self, state, inp, hidden) -> None:
        batch = inp.batch
        for i, seq in enumerate(batch.seqs):
            want = seq.params.prompt_logprobs
            if want is None:
                continue
            done = len(seq.prompt_logprobs or [])
            st, n = batch.start[i], batch.num_tokens[i]
            # Logits at position p predict token p + 1; keep those that predict prompt tokens.
            stop = min(st + n, seq.num_prompt_tokens - 1)
            if stop <= st or stop < done:
                continue  # nothing to score, or already computed before a preemption
            a, _ = inp.row_span(i)
            logits = self.model.compute_logits(hidden[a: a + stop - st])
            targets = torch.tensor(seq.token_ids[st + 1: stop + 1], device=logits.device)
            state.prompt_logprobs[seq.seq_id] = (st + 1, prompt_logprob_entries(
                self.ops, logits, targets, want, self.tokenizer))
