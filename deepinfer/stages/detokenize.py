"""Step stage: incremental detokenization and stop checks for every sampling row (per sequence by nature)."""

from __future__ import annotations

import attrs

from ..core.stage import RowError, Stage


@attrs.define(frozen=True)
class SeqUpdate:
    token_id: int
    text: str  # the whole output text after this token (stop string removed)
    finish_reason: object = None
    stop_reason: object = None


@attrs.define(eq=False)
class DetokenizeStage(Stage):
    name = "detokenize"
    kind = "detokenize"
    host = True
    reads = ("next_tokens", "batch")
    writes = ("outputs",)

    tokenizer: object

    def __call__(self, state) -> None:
        batch = state.batch
        seqs = [s for s, smp in zip(batch.seqs, batch.samples) if smp]
        toks = state.next_tokens.tolist()  # the one host sync a step needs
        eos = self.tokenizer.eos_token_ids
        outs, failed = [], {}
        for r, (seq, tok) in enumerate(zip(seqs, toks)):
            try:
                outs.append(self._row(seq, tok, eos, self.tokenizer))
            except Exception as exc:  # one row's text or stop check: that request alone fails
                failed[r] = f"{type(exc).__name__}: {exc}"
                outs.append(SeqUpdate(tok, seq.text))
        state.outputs = outs
        if failed:
            raise RowError.from_sample_rows(state, failed)

    @staticmethod
    def _row(seq, tok: int, eos, tokenizer) -> SeqUpdate:
        from ..detokenizer import IncrementalDetokenizer, StopChecker

        p = seq.params
        if seq.detok is None:  # first token of this sequence: this stage owns its detokenizer
            seq.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, p.skip_special_tokens)
            seq.stopper = StopChecker(p.stop, p.stop_token_ids, eos, p.ignore_eos, p.min_tokens, p.max_tokens,
                                      p.include_stop_str_in_output)
        delta = seq.detok.step([tok])
        text = seq.detok.text
        reason, cut, stop_reason = seq.stopper.check(text, len(delta), tok, seq.num_output_tokens + 1)
        if reason == "length":
            seq.detok.flush()  # release text held back for an unfinished UTF-8 character
            text = seq.detok.text
        if cut is not None:
            text = text[:cut]
        return SeqUpdate(tok, text, reason, stop_reason)
