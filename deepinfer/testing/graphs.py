"""The engine's CUDA-graph path on the CPU, for tests: DecodeGraphs whose "graphs" run their function eagerly
at every replay instead of replaying a capture (capture needs CUDA), installed in an engine's forward stage."""

from __future__ import annotations

import torch

from ..backends.cuda_graph import DecodeGraphs


class EagerGraph:
    def __init__(self, forward):
        self.forward, self.out = forward, forward()

    def replay(self):
        self.out.copy_(self.forward())


class EagerGraphs(DecodeGraphs):
    def _record(self, key, st, forward):
        g = EagerGraph(forward)
        self.graphs[key] = (g, st, g.out)
        return self.graphs[key]


def install_eager_graphs(llm, width: int, scratch_block: int, sizes=(1, 2, 4, 8)) -> EagerGraphs:
    """Give a CPU engine's block tables a scratch row (every entry ``scratch_block``, a block the caller added
    to the engine's cache) and its forward stage EagerGraphs with verify graphs of ``width`` tokens a row."""
    eng = llm.engine
    tables = eng.block_tables
    tables.table = torch.cat([tables.table, torch.full((1, tables.max_blocks), scratch_block)])
    tables.cuts = torch.cat([tables.cuts, torch.zeros(2, 1, dtype=torch.long)], 1)
    tables.scratch_row = tables.table.shape[0] - 1
    graphs = EagerGraphs(eng.model, eng.kv_cache, tables, eng.config.block_size, "cpu", sizes)
    graphs.future = eng.future  # as the engine hands its own graphs the buffer (cuda_graph.RESOLVE_IN_GRAPH)
    graphs.enable_verify(width, eng.max_model_len)
    next(st for st in eng.stages["step"] if st.name == "forward").decode_graphs = graphs
    eng.decode_graphs = graphs  # (the engine's own view: dynamic draft lengths price a padded verify step)
    return graphs


def install_eager_graphs_paged(llm, width: int, sizes=(1, 2, 4, 8)) -> EagerGraphs:
    """install_eager_graphs for an engine with a paged KV cache ([*, slots, ...] tensors): one more block appended
    to every cache tensor serves as the scratch block."""
    eng = llm.engine
    bs = eng.config.block_size
    blocks = eng.kv_cache[0].shape[1] // bs
    eng.kv_cache = tuple(torch.cat([t, t.new_zeros(t.shape[0], bs, *t.shape[2:])], 1) for t in eng.kv_cache)
    return install_eager_graphs(llm, width, blocks, sizes)
