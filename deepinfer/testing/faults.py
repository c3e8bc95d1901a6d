"""A fault-injecting stage plugin, for tests of the engine's fault isolation (and for users who want to see
what a broken stage does to a batch).

``FaultStage`` transforms the logits of the rows whose request id is in ``request_ids``:

- ``mode="nan"``: their logits become NaN (a kernel gone wrong in one row);
- ``mode="row_error"``: it raises RowError naming them, after finishing the other rows;
- ``mode="crash"``: it raises a plain RuntimeError, which cannot be traced to a row.

``HostFaultStage`` raises RowError for those rows when the step is collected (a host stage, after
detokenize). Register them with :func:`register` on a registry and insert them into a pipeline.
"""

from __future__ import annotations

import attrs
import torch

from ..core.stage import RowError, Stage


def _rows(state, request_ids) -> list:
    return [i for i, s in enumerate(state.batch.seqs) if s.request_id in request_ids]


@attrs.define(eq=False)
class FaultStage(Stage):
    name = "inject_fault"
    kind = "constrain"
    reads = ("logits", "batch")
    writes = ("logits",)

    mode: str = "nan"
    request_ids: tuple = ()

    def __call__(self, state) -> None:
        rows = _rows(state, self.request_ids)
        if not rows:
            return
        if self.mode == "crash":
            raise RuntimeError("injected crash")
        if self.mode == "row_error":
            raise RowError(rows, "injected row fault")
        hit = [r for r, i in enumerate(state.sample_rows) if i in set(rows)]
        state.logits[torch.tensor(hit, dtype=torch.long, device=state.logits.device)] = float("nan")


@attrs.define(eq=False)
class HostFaultStage(Stage):
    name = "inject_host_fault"
    kind = "detokenize"
    host = True
    reads = ("outputs", "batch")
    writes = ("outputs",)

    request_ids: tuple = ()

    def __call__(self, state) -> None:
        rows = _rows(state, self.request_ids)
        if rows:
            raise RowError(rows, "injected host fault")


def register(registry) -> None:
    registry.stage(kind=FaultStage.kind, name=FaultStage.name, factory=FaultStage)
    registry.stage(kind=HostFaultStage.kind, name=HostFaultStage.name, factory=HostFaultStage)
