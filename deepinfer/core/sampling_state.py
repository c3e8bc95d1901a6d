"""The sampling side of the persistent batch: every running sequence's sampling parameters in device
tensors indexed by its state slot, and, from the first request with penalties on, its token counts
(``counts`` [max_seqs, V]: output tokens so far; ``prompt_mask`` [max_seqs, V]: tokens of its prompt).

A slot is written when a sequence takes it (O(joining rows) host work: its parameters, and its counts
rebuilt from its known tokens, which covers a sequence recomputed after preemption); a step's SamplingBatch
is gathered from the slots on the device; the step's sampled tokens are added to the counts on the device
(``record``), so rows with penalties never wait for the host to learn their tokens, under overlap
scheduling too. ``SamplingBatch.build`` (deepinfer.layout), which builds the same batch from token lists,
is the oracle (tests/test_sampling_state.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import SamplingBatch, _build_banned, _build_bias, _row_index, to_device

_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class SamplingState:
    def __init__(self, max_seqs: int, vocab_size: int, eos_token_ids, device):
        self.device, self.vocab_size, self.eos = torch.device(device), vocab_size, tuple(eos_token_ids or ())
        self.floats = torch.zeros(len(_FLOATS), max_seqs, dtype=torch.float32, device=self.device)  # [6, slots]
        self.top_k = torch.zeros(max_seqs, dtype=torch.int64, device=self.device)
        self.counts: Optional[torch.Tensor] = None  # [slots, V] float32, allocated at the first penalty request
        self.prompt_mask: Optional[torch.Tensor] = None  # [slots, V] bool
        # The sequence each slot mirrors, and the slot of each such sequence (a sequence that moved to another
        # slot, after a preemption, is written anew there; its old slot mirrors no one).
        self._owner: list = [None] * max_seqs
        self._slot_of: dict = {}
        self._idx: Optional[torch.Tensor] = None  # the last batch's slots, for record
        # The last batch's rows (each sequence and its slot) and its gathered slots, floats and top-k: a decode
        # stream's steps repeat one batch, and at batch 1 the upload and two gathers were ~0.1 ms of host time
        # a step. Only _join writes the slots, and it clears this.
        self._gathered: Optional[tuple] = None

    def _join(self, seqs: list) -> None:
        """Write the slots of sequences that just took them."""
        self._gathered = None
        idx = to_device([s.state_slot for s in seqs], torch.long, self.device)
        vals = [[0.0 if p.greedy else float(p.temperature), float(p.top_p), float(p.min_p),
                 float(p.presence_penalty), float(p.frequency_penalty), float(p.repetition_penalty)]
                for p in (s.params for s in seqs)]
        self.floats[:, idx] = to_device(vals, torch.float32, self.device).T
        self.top_k[idx] = to_device([s.params.effective_top_k for s in seqs], torch.long, self.device)
        pen = [s for s in seqs if s.params.needs_penalties]
        if pen and self.counts is None:
            n = self.top_k.shape[0]
            self.counts = torch.zeros(n, self.vocab_size, dtype=torch.float32, device=self.device)
            self.prompt_mask = torch.zeros(n, self.vocab_size, dtype=torch.bool, device=self.device)
        if self.counts is not None:  # a slot's counts start from its new owner's tokens (none without penalties)
            self.counts[idx] = 0
            self.prompt_mask[idx] = False
        if not pen:
            return
        rows = to_device([s.state_slot for s in pen], torch.long, self.device)
        out = [s.output_token_ids for s in pen]  # known tokens: a sequence joins with none in flight
        r, c = _row_index(out, [True] * len(pen), self.device)
        self.counts.index_put_((rows[r], c), torch.ones(c.numel(), device=self.device), accumulate=True)
        r, c = _row_index([s.prompt_token_ids for s in pen], [True] * len(pen), self.device)
        self.prompt_mask[rows[r], c] = True

    def batch(self, seqs: list) -> SamplingBatch:
        """The SamplingBatch of a step's sampling rows (in batch order)."""
        joins = [s for s in seqs if self._owner[s.state_slot] is not s or self._slot_of.get(id(s)) != s.state_slot]
        if joins:
            self._join(joins)
            for s in joins:
                old = self._owner[s.state_slot]
                if old is not None:
                    self._slot_of.pop(id(old), None)
                prev = self._slot_of.get(id(s))
                if prev is not None and self._owner[prev] is s:  # it moved: its old slot no longer mirrors it
                    self._owner[prev] = None
                self._owner[s.state_slot] = s
                self._slot_of[id(s)] = s.state_slot
        key = [(id(s), s.state_slot) for s in seqs]
        if self._gathered is not None and self._gathered[0] == key:
            _, idx, f, top_k = self._gathered
        else:
            idx = to_device([s.state_slot for s in seqs], torch.long, self.device)
            f, top_k = self.floats[:, idx], self.top_k[idx]  # [6, S], [S]
            self._gathered = (key, idx, f, top_k)
        self._idx = idx
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        pen = self.counts is not None and any(p.needs_penalties for p in params)
        extras = [p for p in params if p.min_tokens or p.bad_words_token_ids or p.allowed_token_ids is not None]
        outs = None
        if extras or any(p.logits_processors for p in params):
            outs = [s.output_token_ids + s.pending for s in seqs]  # pending count toward min_tokens, as before
        processors = None
        if any(p.logits_processors for p in params):
            processors = [(p.logits_processors, list(s.prompt_token_ids), list(o)) if p.logits_processors else None
                          for p, s, o in zip(params, seqs, outs)]
        return SamplingBatch(
            temperature=f[0], top_k=top_k, top_p=f[1], min_p=f[2],
            presence_penalty=f[3] if pen else None, frequency_penalty=f[4] if pen else None,
            repetition_penalty=f[5] if pen else None,
            output_counts=self.counts[idx] if pen else None, prompt_mask=self.prompt_mask[idx] if pen else None,
            banned=_build_banned(params, outs, self.vocab_size, self.eos, self.device) if extras else None,
            generators=[None if g else s.generator for g, s in zip(greedy, seqs)],
            all_greedy=all(greedy), all_random=not any(greedy),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            use_top_k=any(p.effective_top_k > 0 and not g for p, g in zip(params, greedy)),
            use_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            use_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)),
            logit_bias=_build_bias(params, self.vocab_size, self.device), processors=processors)

    def record_more(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count further tokens [R, n] of the last batch's sampling rows ``rows`` [R] (a verify step's accepted
        drafts after its first token; -1 entries are none) into their slots, on the device (no host sync)."""
        if self.counts is not None and self._idx is not None and tokens.numel():
            slots = self._idx[rows]
            f = self.floats[3:, slots]
            counted = ((f[0] != 0) | (f[1] != 0) | (f[2] != 1)).float()[:, None] * (tokens >= 0)  # [R, n]
            self.counts.index_put_((slots[:, None].expand_as(tokens), tokens.clamp_min(0)), counted, accumulate=True)

    def record(self, next_tokens: torch.Tensor) -> None:
        """Count the last batch's sampled tokens [S] into its slots (on the device, no host sync)."""
        if self.counts is not None and self._idx is not None and next_tokens is not None and next_tokens.numel():
            f = self.floats[3:, self._idx]  # presence, frequency, repetition of each row
            counted = ((f[0] != 0) | (f[1] != 0) | (f[2] != 1)).float()  # rows with penalties count their tokens
            self.counts.index_put_((self._idx, next_tokens.to(torch.long)), counted, accumulate=True)
