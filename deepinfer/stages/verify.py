"""Step stage: run the model over decode rows (one token each; with no draft tokens, verify is plain decode)
and assemble the logits of every sampling row in batch order."""

from __future__ import annotations

import attrs
import torch

from ..core.stage import Stage
from ..backends.base import to_device
from .forward import build_inputs, decode_rows


@attrs.define(eq=False)
class VerifyStage(Stage):
    name = "verify"
    kind = "verify"
    reads = ("batch", "kv_cache", "prefill_logits")
    writes = ("logits",)

    model: object
    config: object
    ops: object
    decode_graphs: object = None  # backends.cuda_graph.DecodeGraphs on CUDA, else None (eager)

    def __call__(self, state) -> None:
        batch = state.batch
        rows = decode_rows(batch)
        dec = None
        if rows:
            seqs = [batch.seqs[i] for i in rows]
            graphs = self.decode_graphs
            if graphs is not None and graphs.covers(len(rows), max(len(s.block_table) for s in seqs)):
                dec = graphs.run([s.input_ids(batch.start[i], 1)[0] for s, i in zip(seqs, rows)],
                                 [batch.start[i] for i in rows], [s.block_table for s in seqs], batch.future)
            else:
                ids, meta, _ = build_inputs(batch, rows, self.config.block_size, self.ops.device)
                dec = self.model.compute_logits(self.model(ids, meta, state.kv_cache))  # [R, V]
        pre = state.prefill_logits
        if pre is None or dec is None:
            state.logits = dec if pre is None else pre
            if state.logits is None:  # nothing samples this step (only non-final prefill chunks)
                state.logits = torch.empty(0, self.model.vocab_size, device=self.ops.device)
            return
        # Interleave back into batch order over the sampling rows (index copies: a boolean mask would sync).
        decode = set(rows)
        is_dec = [i in decode for i, s in enumerate(batch.samples) if s]
        out = torch.empty(len(is_dec), dec.shape[1], dtype=dec.dtype, device=dec.device)
        out.index_copy_(0, to_device([r for r, d in enumerate(is_dec) if d], torch.long, dec.device), dec)
        out.index_copy_(0, to_device([r for r, d in enumerate(is_dec) if not d], torch.long, dec.device),
                        pre.to(dec.dtype))
        state.logits = out
