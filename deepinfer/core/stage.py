"""The Stage contract.

A stage is a small object with a ``name``, a ``kind``, the state fields it
``reads`` and ``writes``, and one call that runs it over the whole batch. It
gets what it needs through its constructor: its own keyword arguments plus any
engine context object its signature names (``config``, ``model``, ``ops``,
``tokenizer``, ``vocab_size``, ``device``, ``generator``, ``engine_config``, ``decode_graphs``,
``block_tables``, ``cache_identity``; docs/plugins.md says what each is). No module-level mutable state.

A stage that can name the rows a fault belongs to raises ``RowError`` (below): those requests fail alone.

Phases: ``admit`` stages run once per request when it is added (their state is
an AdmitState); ``step`` stages run once per engine step over the whole batch
(their state is a StepState). A stage that both reads and writes a field
transforms it in place (a constrain stage masking ``logits``); it runs after
the field's producer.

Host stages (``host = True``, e.g. detokenize) read the step's sampled tokens on
the host. The engine runs every step stage before the first host stage when it
launches a step, and the host stages (with all that follow them) when it
collects the step; with overlap scheduling the next step is launched in between,
so the GPU never waits for detokenization or stop checks.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional


class Stage:
    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    phase: ClassVar[str] = "step"  # "admit" | "step"
    reads: ClassVar[tuple] = ()
    writes: ClassVar[tuple] = ()
    host: ClassVar[bool] = False  # reads step results on the host: runs at collection (see above)
    replaces: ClassVar[tuple] = ()  # names or kinds of stages whose fields this one may write instead of them

    def __call__(self, state: Any) -> None:  # pragma: no cover - the contract
        raise NotImplementedError(f"stage {self.name!r} does not implement __call__")


class RowError(Exception):
    """Raised by a stage that can name the rows at fault (``rows``: indices into ``state.batch.seqs``).

    The stage must have finished its work for every other row before raising. The engine fails the
    requests of those rows alone (finish_reason "error", with this message) and the step goes on for the
    rest. Any other exception cannot be traced to a row: it fails every request of the step, and the
    engine keeps serving new ones.
    """

    def __init__(self, rows, message: str, messages: Optional[dict] = None):
        super().__init__(message)
        self.rows = list(rows)
        self.messages = dict(messages or {})  # {row: its own message}, where rows failed differently

    @classmethod
    def from_sample_rows(cls, state, failed: dict) -> "RowError":
        """``failed``: {sampling row (an index into state.logits / next_tokens): message}; the error names
        their batch rows and joins the messages."""
        rows = state.sample_rows
        return cls([rows[r] for r in failed], "; ".join(sorted(set(failed.values()))))
