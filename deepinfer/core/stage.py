"""The Stage contract.

A stage is a small object with a ``name``, a ``kind``, the state fields it
``reads`` and ``writes``, and one call that runs it over the whole batch. It
gets what it needs through its constructor: its own keyword arguments plus any
engine context object its signature names (``config``, ``model``, ``ops``,
``tokenizer``, ``vocab_size``, ``device``, ``generator``). No module-level mutable state.

Phases: ``admit`` stages run once per request when it is added (their state is
an AdmitState); ``step`` stages run once per engine step over the whole batch
(their state is a StepState). A stage that both reads and writes a field
transforms it in place (a constrain stage masking ``logits``); it runs after
the field's producer.
"""

from __future__ import annotations

from typing import Any, ClassVar


class Stage:
    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    phase: ClassVar[str] = "step"  # "admit" | "step"
    reads: ClassVar[tuple] = ()
    writes: ClassVar[tuple] = ()
    replaces: ClassVar[tuple] = ()  # names or kinds of stages whose fields this one may write instead of them

    def __call__(self, state: Any) -> None:  # pragma: no cover - the contract
        raise NotImplementedError(f"stage {self.name!r} does not implement __call__")
