"""Draft stage ``mtp``: DeepSeek-V3's multi-token-prediction layers (models/deepseek_mtp.py) proposing
speculative tokens.

Select it with ``LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": k})`` on a DeepSeek-V3
checkpoint that stores its ``num_nextn_predict_layers`` MTP layers (``model.layers.{num_hidden_layers}.*``);
elsewhere it fails naming the checkpoint, or, with ``"optional": True``, leaves speculation off. The engine shows
it every row's target hidden states after each step (``observe``); it keeps them, with the MTP block's own KV, in
``seq.draft_state`` and drafts from them at the next step: greedy rows take the MTP's argmax, sampled
rows draw from its distribution at the request's temperature (``seq.draft_probs``), against which they are
verified. The engine asks for every sequence of a step at once (``propose_batch``: one batched forward of the
module per draft position, models/mtp_batch.py); ``propose`` drafts one sequence (the batch's oracle).
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..core.speculative import can_speculate
from ..layout import to_device
from ..core.stage import Stage


@attrs.define(eq=False)
class MTPDraft(Stage):
    name = "mtp"
    kind = "draft"
    reads = ()
    writes = ()

    model: object  # the target (a DeepSeek model)
    model_path: Optional[str] = None  # the target checkpoint's directory (engine context)
    generator: Optional[torch.Generator] = None  # engine-wide, for unseeded sampled rows
    engine_config: object = None  # its fp8_experts: the MTP's experts are held as the target's are
    mtp: object = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        from ..models.deepseek_mtp import load_mtp

        self.mtp = load_mtp(self.model, self.model_path, getattr(self.engine_config, "fp8_experts", "fp8"))

    def observe(self, seq, start: int, hidden: torch.Tensor) -> None:
        """The target computed seq's positions start .. start + len(hidden) - 1 this step (the accepted ones of a
        verified row); hidden [n, d]: its final hidden states there."""
        if not can_speculate(seq.params) or hidden.shape[0] == 0:
            return
        rows = hidden.detach().clone()  # the step's buffer is reused (a CUDA-graph output)
        if seq.draft_state is None:
            seq.draft_state = self.mtp.new_cache(start, rows)
        else:
            seq.draft_state.observe(start, rows)

    def propose(self, seq, k: int) -> list:
        seq.draft_probs = None
        if seq.draft_state is None:
            return []
        p = seq.params
        gen = seq.generator if seq.generator is not None else self.generator

        def pick(logits):
            if p.greedy:
                return int(logits.argmax())
            q = (logits / p.temperature).softmax(dim=-1).double()
            return int(torch.multinomial(q.to(gen.device if gen is not None else "cpu"), 1, generator=gen))

        with torch.no_grad():
            tokens, logits = self.mtp.draft(seq.draft_state, seq.token_ids, seq.num_computed_tokens, k, pick)
        if tokens and not p.greedy:
            seq.draft_probs = (logits / p.temperature).softmax(dim=-1)
        return tokens

    def propose_batch(self, seqs: list, ks: list) -> list:
        """Up to ks[i] drafts for each of seqs, drafted together (the engine's call before a step)."""
        from ..models.mtp_batch import draft_batch

        for s in seqs:
            s.draft_probs = None
        if not seqs:
            return []
        dev = self.mtp.layer.eh_proj.weight.device
        greedy = [s.params.greedy for s in seqs]
        temps = to_device([1.0 if g else float(s.params.temperature) for s, g in zip(seqs, greedy)],
                          torch.get_default_dtype(), dev)
        gens = [None if g else (s.generator if s.generator is not None else self.generator)
                for s, g in zip(seqs, greedy)]
        is_greedy = None if all(greedy) else to_device(greedy, torch.bool, dev)  # once, not at every position

        def pick(logits):  # [B, V] -> [B]: greedy rows the argmax, sampled rows a draw (exponential race)
            best = logits.argmax(-1)
            if all(greedy):
                return best
            q = (logits / temps[:, None]).softmax(-1)
            e = torch.empty_like(q)
            for i, g in enumerate(gens):  # each sampled row from its own generator (its seed), as propose does
                if g is not None:
                    e[i].exponential_(generator=g)
            drawn = (q / e.clamp_min_(torch.finfo(e.dtype).tiny)).argmax(-1)
            return torch.where(is_greedy, best, drawn)

        with torch.no_grad():
            out = draft_batch(self.mtp, [s.draft_state for s in seqs], [s.token_ids for s in seqs],
                              [s.num_computed_tokens for s in seqs], ks, pick)
        drafts = []
        for s, g, t, (tokens, logits) in zip(seqs, greedy, temps, out):
            if tokens and not g:
                s.draft_probs = (logits / t).softmax(dim=-1)
            drafts.append(tokens)
        return drafts

    def __call__(self, state) -> None:
        raise TypeError("the mtp draft stage is called through propose_batch(seqs, ks) by the engine")
