"""Step stage: run the model over prefill chunks (prompt tokens, or known tokens recomputed after preemption)."""

from __future__ import annotations

import attrs
import torch

from ..core.stage import Stage
from .forward import build_inputs, prefill_rows
from .logprobs import prompt_logprob_entries


@attrs.define(eq=False)
class PrefillStage(Stage):
    name = "prefill"
    kind = "prefill"
    reads = ("batch", "kv_cache")
    writes = ("prefill_logits", "prompt_logprobs")

    model: object
    config: object  # EngineConfig
    ops: object
    tokenizer: object = None

    def __call__(self, state) -> None:
        batch = state.batch
        rows = prefill_rows(batch)
        state.prompt_logprobs = {}
        if not rows:
            state.prefill_logits = None
            return
        ids, meta, qstart = build_inputs(batch, rows, self.config.block_size, self.ops.device)
        hidden = self.model(ids, meta, state.kv_cache)  # [T, d]
        last = [qstart[r + 1] - 1 for r, i in enumerate(rows) if batch.samples[i]]
        state.prefill_logits = self.model.compute_logits(hidden[last]) if last else None
        for r, i in enumerate(rows):
            seq = batch.seqs[i]
            want = seq.params.prompt_logprobs
            done = len(seq.prompt_logprobs or [])
            st, n = batch.start[i], batch.num_tokens[i]
            # Logits at position p predict token p + 1; keep those that predict prompt tokens.
            stop = min(st + n, seq.num_prompt_tokens - 1)
            if want is None or stop <= st or stop < done:
                continue  # not asked, nothing to score, or already computed before a preemption
            logits = self.model.compute_logits(hidden[qstart[r]: qstart[r] + stop - st])
            targets = torch.tensor(seq.token_ids[st + 1: stop + 1], device=logits.device)
            state.prompt_logprobs[seq.seq_id] = (st + 1, prompt_logprob_entries(
                self.ops, logits, targets, want, self.tokenizer))
