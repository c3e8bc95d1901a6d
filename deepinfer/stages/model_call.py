"""Step stage: the step's one model call, over the ragged stream of every row (prefill chunks and decode
rows together), so a mixed step reads the weights once. A decode-only step replays a CUDA graph when the
engine captured one for its size; so does a verify step (every row a decode row with its drafted tokens)
when the engine captured verify graphs (backends/cuda_graph.py)."""

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
        if graphs is not None and batch.drafts is not None and graphs.verify_width:
            hidden = self._verify_graph(inp, graphs)
            if hidden is not None:
                state.hidden = hidden
                return
        ids, meta = inp.tensors()
        state.hidden = self.model(ids, meta, state.kv_cache)  # [T, d]

    @staticmethod
    def _verify_graph(inp, graphs):
        """The hidden states of a verify step from its CUDA graph, in the stream's layout; None when some row is
        not a decode row with drafts (a prefill chunk) or no bucket covers the step."""
        batch = inp.batch
        if not all(batch.samples[i] and batch.num_tokens[i] == 1 + len(batch.drafts[i]) for i in inp.rows):
            return None
        seqs = [batch.seqs[i] for i in inp.rows]
        starts, nums = [batch.start[i] for i in inp.rows], [batch.num_tokens[i] for i in inp.rows]
        if not graphs.covers_verify(nums, starts):
            return None
        return graphs.run_verify([s.input_ids(st, n) for s, st, n in zip(seqs, starts, nums)], starts,
                                 [s.state_slot for s in seqs], batch.future)
