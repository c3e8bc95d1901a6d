"""Draft stage ``dspark``: CED's parallel drafter (models/ced/dspark.py) proposing speculative tokens.

Select it with ``LLM(model, speculative_config={"method": "dspark", "num_speculative_tokens": k})``; the
drafter's weights come from ``drafter`` (vLLM's ``model`` key is accepted too), else from the target
checkpoint's ``dspark/`` directory (the bundled demo model ships one). It reads the target's hidden states
after its last layers at the position that produced each sequence's last token (the engine keeps them per
sequence after every step: ``seq.draft_context``), and proposes up to min(k, positions) tokens with their
draft distributions (``seq.draft_probs``, sampled rows only: a greedy row is verified by argmax alone),
against which sampled drafts are verified. The engine asks for every sequence of a step at once
(``propose_batch``: one forward of the drafter for all of them, one host copy of the drafts and confidences);
``propose`` drafts one sequence (the batch's oracle).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import attrs
import torch

from ..core.stage import Stage
from ..layout import HiddenRow


def _is_ced(model) -> bool:
    return hasattr(getattr(model, "config", None), "num_encoder_layers")


def _directory(model_path, drafter) -> Optional[Path]:
    """The drafter directory asked for, else the target checkpoint's dspark/ (None: neither is known)."""
    if drafter:
        return Path(drafter)
    return Path(model_path) / "dspark" if model_path else None


@attrs.define(eq=False)
class DSparkDraft(Stage):
    name = "dspark"
    kind = "draft"
    reads = ()
    writes = ()
    wants_hidden = True  # the engine keeps the target's last layers' hidden states for it (and runs eagerly)
    reports_confidence = True  # seq.draft_survival: speculative_config dynamic=True can use it

    model: object  # the target (a CED model)
    model_path: Optional[str] = None  # the target checkpoint's directory (engine context)
    generator: Optional[torch.Generator] = None  # engine-wide, for unseeded sampled rows
    drafter: Optional[str] = None  # the drafter's directory; None: <model_path>/dspark
    drafter_net: object = attrs.field(default=None, init=False)
    graphs: object = attrs.field(default=None, init=False)  # models/ced/dspark_graphs.DraftGraphs, CUDA only

    def __attrs_post_init__(self) -> None:
        from ..models.ced.dspark import load_dspark

        if not _is_ced(self.model):
            raise ValueError(f"speculative_config method='dspark': the dspark drafter needs a CED target; "
                             f"{type(self.model).__name__} is not one")
        where = _directory(self.model_path, self.drafter)
        if where is None:
            raise ValueError("speculative_config method='dspark' needs a drafter directory: pass 'drafter' "
                             "(or 'model') or serve a checkpoint with a dspark/ directory")
        device = next(self.model.parameters()).device
        self.drafter_net = net = load_dspark(where, device)
        c, t = net.config, self.model.config
        if c.target_hidden != t.hidden_size or c.vocab_size != t.vocab_size:
            raise ValueError(f"DSpark drafter {where} was trained for hidden size {c.target_hidden} and vocabulary "
                             f"{c.vocab_size}; the target has {t.hidden_size} and {t.vocab_size}")
        if c.target_layers > t.num_layers - t.num_encoder_layers:
            raise ValueError(f"DSpark drafter {where} reads {c.target_layers} target layers; the target's decoder "
                             f"has {t.num_layers - t.num_encoder_layers}")
        self.model.capture_last = c.target_layers

    def propose(self, seq, k: int) -> list:
        context = getattr(seq, "draft_context", None)
        if context is None:
            return []
        if isinstance(context, HiddenRow):
            context = context.tensor()
        gen = seq.generator if getattr(seq, "generator", None) is not None else self.generator
        tokens, q, conf = self.drafter_net.draft(context, seq.token_ids[-1], k, self.model, seq.params.greedy, gen)
        seq.draft_probs = None if seq.params.greedy else q
        seq.draft_survival = torch.cumprod(conf.float(), 0).tolist()  # S_i = c_1 ... c_i
        return tokens

    def propose_batch(self, seqs: list, ks: list) -> list:
        """Up to ks[i] drafts for each of seqs in one forward of the drafter (the engine's call before a step);
        ``propose`` is its oracle, one sequence at a time. A sequence with no kept context drafts nothing."""
        ready = [i for i, s in enumerate(seqs) if getattr(s, "draft_context", None) is not None]
        drafts = [[] for _ in seqs]
        if not ready:
            return drafts
        rows = [seqs[i] for i in ready]
        contexts, anchors = [s.draft_context for s in rows], [s.token_ids[-1] for s in rows]
        wanted = [ks[i] for i in ready]
        greedy = [s.params.greedy for s in rows]
        if self.graphs is not None and self.graphs.covers(contexts, greedy, wanted):
            (tokens, survival), q = self.graphs.draft(contexts, anchors, wanted), None
        else:
            gens = [s.generator if getattr(s, "generator", None) is not None else self.generator for s in rows]
            tokens, q, survival = self.drafter_net.draft_batch(contexts, anchors, wanted, self.model, greedy, gens)
        for r, (i, s) in enumerate(zip(ready, rows)):
            drafts[i] = tokens[r]
            s.draft_probs = None if s.params.greedy else q[r, :len(tokens[r])]
            s.draft_survival = survival[r]
        return drafts

    def capture_graphs(self, buckets: list, k: int) -> None:
        """Capture greedy drafting for these batch sizes (the engine's decode buckets; CUDA, at start-up)."""
        from ..models.ced.dspark_graphs import DraftGraphs

        if next(self.drafter_net.parameters()).device.type != "cuda" or not buckets:
            return
        self.graphs = DraftGraphs(self.drafter_net, self.model, buckets, k, self.model.embed.weight.dtype)
        self.graphs.capture()

    @staticmethod
    def locate(model, model_path, drafter) -> Optional[Path]:
        """The drafter directory this stage would load, or None when there is none (not a CED target, or no
        drafter beside it)."""
        where = _directory(model_path, drafter) if _is_ced(model) else None
        return where if where is not None and (where / "config.json").is_file() else None

    def __call__(self, state) -> None:
        raise TypeError("the dspark draft stage is called through propose_batch(seqs, ks) by the engine")
