"""Step stage: the step's one model call, over the ragged stream of every row (prefill chunks and decode
rows together), so a mixed step reads the weights once. A decode-only step replays a CUDA graph when the
engine captured one for its size."""

from __future__ import annotations

import attrs

from ..core.stage import Stage


@attrs.define(eq=False)
class ForwardStage(Stage):
    name = "forward"
    kind = "forward"
    reads = ("inputs", "kv_cache")
    writes = ("hidden",)

    model: object
    decode_graphs: object = None  # backends.cuda_graph.DecodeGraphs on CUDA, else None (eager)

    def __call__(self, state) -> None:
        inp = state.inputs
        if inp is None:
            state.hidden = None
            return
        graphs, batch = self.decode_graphs, inp.batch
        if graphs is not None and inp.decode_only:
            seqs = [batch.seqs[i] for i in inp.rows]
            nb = max(len(s.block_table) for s in seqs)
            if graphs.covers(len(seqs), nb):
                starts = [batch.start[i] for i in inp.rows]
                state.hidden = graphs.run([s.input_ids(st, 1)[0] for s, st in zip(seqs, starts)], starts,
                                          [s.state_slot for s in seqs], nb, batch.future)
                return
        ids, meta = inp.tensors()
        state.hidden = self.model(ids, meta, state.kv_cache)  # [T, d]
