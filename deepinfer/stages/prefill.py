"""Step stage: lay out what each scheduled row feeds the model (prefill chunks: prompt tokens, or known
tokens recomputed after preemption; decode rows: their one new token) as one ragged token stream."""

from __future__ import annotations

import attrs

from ..core.stage import Stage
from ..core.inputs import plan


@attrs.define(eq=False)
class PrefillStage(Stage):
    name = "prefill"
    kind = "prefill"
    reads = ("batch",)
    writes = ("inputs",)

    config: object  # EngineConfig
    ops: object
    block_tables: object = None  # core.block_tables.BlockTables (synced by the engine): metadata built on the device

    def __call__(self, state) -> None:
        state.inputs = plan(state.batch, self.config.block_size, self.ops.device, self.block_tables)
