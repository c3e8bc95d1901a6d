"""Step stage: structured outputs. Masks each constrained row's logits to the tokens its grammar admits.

Per step, for every sampling row whose request has ``structured_outputs``: catch its matcher up with the
tokens the engine folded since the last step (advance), fill the row of the batch's token bitmask on the
host (xgrammar, batched over the rows, outside the GIL), copy it to the device and apply it to the logits
(``ops.apply_token_bitmask``: a Triton kernel on the nvidia backend). Unconstrained rows are not touched.

Where the fill happens: after the forward was queued (this stage runs after verify), so on a GPU the host
fills while the device runs the forward. With overlap scheduling the tokens of the step in flight are
needed first: the stage declares ``reads_known_tokens``, and the engine collects that step just before this
stage runs, after the forward of the new one is queued (core/engine.py), so the fill still overlaps the
forward. On the CPU the forward runs in line, and the stage's time is added to the step (0.6 ms at batch 16,
1.9 ms at batch 64 with the demo model: 1.2-1.5% of its step; docs/benchmarks.md).

The engine calls three hooks of this stage (duck-typed, so core never imports stages):
- ``admit_request(request_id, params)``, when a request is added: a JSON schema that uses a feature xgrammar
  would silently weaken is refused (ValueError naming the keyword: the request fails alone), and the
  grammar's compilation starts on a thread pool (cached by grammar and tokenizer), overlapping the
  request's prefill. Its first sampling step waits for it until ``structured_outputs_timeout_s`` after
  admission; a grammar that does not compile, or not in time, fails its request alone (RowError, with the
  compiler's message).
- ``release_request(request_id)``, when the engine forgets a request.
- ``jump_forward(seq)``, after a step's tokens were folded into a sequence with nothing in flight: the
  tokens the grammar forces (``StructuredOutputsParams.jump_forward``), which the engine appends without a
  model step (see deepinfer/structured/matcher.py for the tokenization at the boundaries).

A request ends when its grammar is complete: the mask then admits only the stop tokens (EOS), so the
detokenizer stops it with finish_reason "stop".
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any, Optional

import attrs
import torch

from ..core.stage import RowError, Stage
from ..layout import to_device
from ..structured import GrammarCompilers, SeqGrammar, check_json_schema, compiler_message
from ..structured.compiler import describe


def _result(fut, deadline: float, limit: float):
    """The compiled grammar, waiting until ``deadline`` (admission + the limit) or, for a grammar that waited
    behind others for a compile thread, until ``limit`` after its compilation started (the limit is on a
    grammar's compile time: a burst of schemas must not time out in the queue). Raises TimeoutError."""
    while True:
        started = getattr(fut, "started_at", None)
        if fut.done() or started is not None:
            end = deadline if started is None else max(deadline, started + limit)
            return fut.result(timeout=max(end - time.monotonic(), 0.0))
        try:  # queued: poll until it starts (or is done)
            return fut.result(timeout=0.05)
        except concurrent.futures.TimeoutError:
            continue


_NO_TOKEN = ("structured outputs: the grammar admits no token after {} accepted token(s): it cannot be satisfied "
             "(an empty regex, choice or schema)")


@attrs.define(eq=False)
class _Request:
    spec: Any  # StructuredOutputsParams
    future: concurrent.futures.Future  # of the compiled grammar
    deadline: float  # time.monotonic() by which it must have compiled
    compiled: Any = None
    seqs: dict = attrs.field(factory=dict)  # seq_id -> SeqGrammar


class GrammarFailure(Exception):
    """The request's grammar cannot be used (it does not compile, or not in time)."""


@attrs.define(eq=False)
class GrammarStage(Stage):
    name = "grammar"
    kind = "constrain"
    reads = ("logits", "batch", "draft_logits")
    writes = ("logits", "draft_logits")  # masked in place (draft_logits: a speculating row's drafted positions)
    reads_known_tokens = True  # the engine collects the step in flight before this stage (see above)

    tokenizer: object
    vocab_size: int
    ops: object
    engine_config: object = None
    timeout_s: Optional[float] = None  # default: engine_config.structured_outputs_timeout_s
    _requests: dict = attrs.field(factory=dict, init=False)
    _compiler: Any = attrs.field(default=None, init=False)
    _bitmask: Optional[torch.Tensor] = attrs.field(default=None, init=False)

    @property
    def time_limit(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return getattr(self.engine_config, "structured_outputs_timeout_s", 10.0)

    @property
    def compiler(self):
        if self._compiler is None:
            self._compiler = GrammarCompilers.get(self.tokenizer, self.vocab_size)
        return self._compiler

    # Engine hooks.
    def admit_request(self, request_id: str, params) -> None:
        spec = params.structured_outputs
        if spec is None:
            return
        if spec.kind == "json":
            check_json_schema(json.loads(spec.key[1]))
        fut = self.compiler.submit(spec)
        if fut.done() and fut.exception() is not None:  # known bad (cached): fail now, at admission
            raise ValueError(f"structured outputs: {describe(spec)} does not compile: "
                             f"{compiler_message(fut.exception())}")
        self._requests[request_id] = _Request(spec, fut, time.monotonic() + self.time_limit)

    def release_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def jump_forward(self, seq) -> list:
        req = self._requests.get(seq.request_id)
        g = None if req is None else req.seqs.get(seq.seq_id)
        if g is None or not req.spec.jump_forward:
            return []
        g.catch_up(seq.output_token_ids)
        return g.jump_forward(self.tokenizer)

    def rollback(self, seq, num_tokens: int) -> None:
        """Forget the last num_tokens tokens the sequence's matcher accepted (speculative decoding rejects
        drafted tokens this way); the next catch-up accepts whatever the sequence then holds."""
        req = self._requests.get(seq.request_id)
        g = None if req is None else req.seqs.get(seq.seq_id)
        if g is not None:
            g.rollback(num_tokens)

    # The step.
    def grammar(self, seq) -> Optional[SeqGrammar]:
        """The sequence's matcher (None if its request is not constrained); waits for the compilation until
        the request's deadline. Raises GrammarFailure."""
        req = self._requests.get(seq.request_id)
        if req is None:
            return None
        if req.compiled is None:
            try:
                req.compiled = _result(req.future, req.deadline, self.time_limit)
            except concurrent.futures.TimeoutError:
                raise GrammarFailure(f"structured outputs: {describe(req.spec)} did not compile within "
                                     f"structured_outputs_timeout_s={self.time_limit:g} s") from None
            except Exception as exc:
                raise GrammarFailure(f"structured outputs: {describe(req.spec)} does not compile: "
                                     f"{compiler_message(exc)}") from None
        g = req.seqs.get(seq.seq_id)
        if g is None:
            g = req.seqs[seq.seq_id] = SeqGrammar(self.compiler, req.compiled)
        return g

    def _verify_masks(self, g: SeqGrammar, drafts: list) -> torch.Tensor:
        """A speculating row's masks [k + 1, words]: after its tokens, then after each draft in turn. Past a draft
        the grammar does not admit, positions are never reached (that draft's own mask rejects it): they repeat
        its mask. The matcher is left as it was (the engine folds the accepted drafts; the next step catches up)."""
        masks = self.compiler.allocate_bitmask(len(drafts) + 1)
        taken = 0
        for j in range(len(drafts) + 1):
            g.fill(masks, j)
            if j == len(drafts) or g.terminated or not g.matcher.accept_token(int(drafts[j])):
                masks[j + 1:] = masks[j]
                break
            taken += 1
        if taken:
            g.matcher.rollback(taken)
        return masks

    def _rows(self, n: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = self.compiler.allocate_bitmask(max(n, 8))
        return self._bitmask

    def __call__(self, state) -> None:
        if not self._requests:
            state.logits_kept = True  # nothing masked: the engine need not guard the logits again
            return
        batch = state.batch
        rows = state.sample_rows
        work = []  # (sampling row, SeqGrammar)
        failed: dict = {}
        for r, i in enumerate(rows):
            seq = batch.seqs[i]
            if seq.request_id not in self._requests or seq.finished:
                continue  # unconstrained, or finished while this step was in flight (its token is dropped)
            try:
                g = self.grammar(seq)
                g.catch_up(seq.output_token_ids)
            except Exception as exc:  # this request alone: its grammar, or a token it does not admit
                failed[i] = str(exc) if isinstance(exc, GrammarFailure) else f"structured outputs: {exc}"
                continue
            work.append((r, g))
        drafts = batch.drafts or [None] * len(batch.seqs)
        spec = [(r, g, drafts[rows[r]]) for r, g in work if drafts[rows[r]]]
        if spec:  # speculating rows: every drafted position gets its own mask (core/speculative.py)
            offsets, off = {}, 0
            for r, i in enumerate(rows):
                offsets[r] = off
                off += len(drafts[i] or ())
            device = state.logits.device
            for r, g, d in spec:
                masks = self._verify_masks(g, d)
                if not bool(masks[0].any()):
                    failed[rows[r]] = _NO_TOKEN.format(g.num_accepted)
                at = torch.arange(offsets[r], offsets[r] + len(d), device=device)
                self.ops.apply_token_bitmask(state.draft_logits, to_device(masks[:-1], torch.int32, device), at)
                self.ops.apply_token_bitmask(state.logits, to_device(masks[-1:], torch.int32, device),
                                             torch.tensor([r], device=device))
            work = [(r, g) for r, g in work if not drafts[rows[r]]]
        if work:
            bitmask = self._rows(len(work))
            live = [(k, g) for k, (_, g) in enumerate(work) if not g.terminated]
            if live:
                self.compiler.batch_fill([g.matcher for _, g in live], bitmask, [k for k, _ in live])
            for k, (_, g) in enumerate(work):
                if g.terminated:
                    g.fill(bitmask, k)
            for k in (~bitmask[:len(work)].any(dim=1)).nonzero().flatten().tolist():  # (a host tensor)
                failed[rows[work[k][0]]] = _NO_TOKEN.format(work[k][1].num_accepted)
            device = state.logits.device
            self.ops.apply_token_bitmask(state.logits, to_device(bitmask[:len(work)], torch.int32, device),
                                         to_device([r for r, _ in work], torch.int64, device))
        if not spec and not work:
            state.logits_kept = True
        if failed:
            # Each request gets its own message (its grammar's).
            raise RowError(list(failed), "; ".join(sorted(set(failed.values()))), messages=failed)
